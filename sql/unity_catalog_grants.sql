-- Unity Catalog grants for rulewatch: who can read alerts, who can change rules, what the job may touch.
--
-- Run as the schema owner (a metastore or catalog admin), e.g. in the SQL editor, in two parts: up to
-- and including the engineers' grants after the first `databricks bundle deploy -t prod` and before
-- its first run (the job needs them to run); the rest after that first run, which creates the tables
-- and views they name (docs/deploy.md). Names are the prod target's (catalog `main`, schema
-- `rulewatch`); replace them, and the four principals, with your own:
--   `rulewatch-job`       the service principal the prod job runs as (run_as)
--   `fraud-engineers`     operate the pipeline; may repair tables and checkpoints
--   `fraud-rule-editors`  change rules, and nothing else
--   `fraud-analysts`      read alerts and the dashboard views, never raw events
--
-- Every rulewatch table is a Unity Catalog managed table in the schema, named <layer>_<table>
-- (src/rulewatch/spark/storage/lakehouse.py; the bundle variable `tables`), so each is granted on its own:
--   * analysts get SELECT on each dashboard view by name (src/rulewatch/spark/present/views.py), never on the
--     schema, which would open every table (raw events) to them too. Account identifiers reach them
--     masked in the views unless they are in the PII group (bundle variable pii_viewer_group);
--   * rule editors change rules with SQL on config_rules (the running stream validates each change
--     and quarantines a bad rule in config_rule_errors), or by writing a rules file into the `rules`
--     volume that the setup task applies (bundle variable rules_file);
--   * the job creates and owns the tables and views; the `lakehouse` volume holds only its checkpoints.
-- Masking stays in the views rather than as column masks on the tables: a column mask applies to
-- every reader, the job's own reads of silver included, and masked keys would change its alerts.
-- Views run with their owner's rights on what they read: the job creates them. Check the result
-- with SHOW GRANTS (at the end).

CREATE VOLUME IF NOT EXISTS main.rulewatch.rules COMMENT 'Rules files that the rulewatch job validates and applies';

-- Everyone involved needs to see the catalog and schema.
GRANT USE CATALOG ON CATALOG main TO `rulewatch-job`, `fraud-engineers`, `fraud-rule-editors`, `fraud-analysts`;
GRANT USE SCHEMA ON SCHEMA main.rulewatch TO `rulewatch-job`, `fraud-engineers`, `fraud-rule-editors`, `fraud-analysts`;

-- The job: read what lands and the rules file, create (and so own) every table and view, keep its checkpoints.
GRANT READ VOLUME ON VOLUME main.rulewatch.landing TO `rulewatch-job`;
GRANT READ VOLUME ON VOLUME main.rulewatch.rules TO `rulewatch-job`;
GRANT READ VOLUME, WRITE VOLUME ON VOLUME main.rulewatch.lakehouse TO `rulewatch-job`;
GRANT CREATE TABLE ON SCHEMA main.rulewatch TO `rulewatch-job`;

-- Engineers: operate and repair (docs/reliability.md, Recovery), including landing files by hand.
GRANT READ VOLUME, WRITE VOLUME ON VOLUME main.rulewatch.landing TO `fraud-engineers`;
GRANT READ VOLUME, WRITE VOLUME ON VOLUME main.rulewatch.rules TO `fraud-engineers`;
GRANT READ VOLUME, WRITE VOLUME ON VOLUME main.rulewatch.lakehouse TO `fraud-engineers`;
GRANT SELECT, MODIFY ON SCHEMA main.rulewatch TO `fraud-engineers`;

-- ---- After the first run: the tables and views below exist only once the job has created them. ----

-- Rule editors: the rules table and the rules file; what the stream made of their changes.
GRANT SELECT, MODIFY ON TABLE main.rulewatch.config_rules TO `fraud-rule-editors`;
GRANT SELECT ON TABLE main.rulewatch.config_rule_errors TO `fraud-rule-editors`;
GRANT READ VOLUME, WRITE VOLUME ON VOLUME main.rulewatch.rules TO `fraud-rule-editors`;
GRANT SELECT ON VIEW main.rulewatch.rule_changes TO `fraud-rule-editors`;

-- Analysts: the dashboard's views, each by name. Views that read silver_transactions
-- (rule_effectiveness, freshness) return counts and the newest event time, never an event.
GRANT SELECT ON VIEW main.rulewatch.alerts_masked TO `fraud-analysts`;
GRANT SELECT ON VIEW main.rulewatch.key_window_metrics TO `fraud-analysts`;
GRANT SELECT ON VIEW main.rulewatch.alerts_per_rule_hour TO `fraud-analysts`;
GRANT SELECT ON VIEW main.rulewatch.top_alerting_keys TO `fraud-analysts`;
GRANT SELECT ON VIEW main.rulewatch.rule_effectiveness TO `fraud-analysts`;
GRANT SELECT ON VIEW main.rulewatch.latency_trend TO `fraud-analysts`;
GRANT SELECT ON VIEW main.rulewatch.quarantine_reasons TO `fraud-analysts`;
GRANT SELECT ON VIEW main.rulewatch.id_conflicts TO `fraud-analysts`;
GRANT SELECT ON VIEW main.rulewatch.rule_changes TO `fraud-analysts`;
GRANT SELECT ON VIEW main.rulewatch.pipeline_batches TO `fraud-analysts`;
GRANT SELECT ON VIEW main.rulewatch.freshness TO `fraud-analysts`;

SHOW GRANTS ON SCHEMA main.rulewatch;
SHOW GRANTS ON TABLE main.rulewatch.config_rules;
SHOW GRANTS ON VOLUME main.rulewatch.lakehouse;
SHOW GRANTS ON VOLUME main.rulewatch.rules;
