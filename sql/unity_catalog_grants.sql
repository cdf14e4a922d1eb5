-- Unity Catalog grants for rulewatch: who can read alerts, who can change rules, what the job may touch.
--
-- Run once per workspace as the schema owner (a metastore or catalog admin), e.g. in the SQL editor,
-- after the first `databricks bundle deploy -t prod` (docs/deploy.md). Names are the prod target's
-- (catalog `main`, schema `rulewatch`); replace them, and the four principals, with your own:
--   `rulewatch-job`       the service principal the prod job runs as (run_as)
--   `fraud-engineers`     operate the pipeline; may repair tables and checkpoints
--   `fraud-rule-editors`  change rules, and nothing else
--   `fraud-analysts`      read alerts and the dashboard views, never raw events
--
-- Every rulewatch table is a path-based Delta table inside the `lakehouse` volume, so volume
-- rights are all-or-nothing for the tables in it. Hence:
--   * readers get the views in the schema (SELECT), never the volume: alerts reach them through
--     the views (account identifiers masked in alerts_masked unless they are in the PII group);
--   * rule editors do not write config/rules directly (that needs WRITE VOLUME on the whole
--     lakehouse). They write a rules file into the `rules` volume; the job's setup task validates it
--     and MERGEs it (bundle variable rules_file = /Volumes/main/rulewatch/rules/rules.json), and an
--     invalid file fails the run with every problem listed and nothing written;
--   * only the job and the engineers can write the lakehouse.
-- Views run with their owner's rights on what they read, so they must be created by a principal
-- that can READ VOLUME lakehouse (the job). Check the result with SHOW GRANTS (at the end).

CREATE VOLUME IF NOT EXISTS main.rulewatch.rules COMMENT 'Rules files that the rulewatch job validates and applies';

-- Everyone involved needs to see the catalog and schema.
GRANT USE CATALOG ON CATALOG main TO `rulewatch-job`, `fraud-engineers`, `fraud-rule-editors`, `fraud-analysts`;
GRANT USE SCHEMA ON SCHEMA main.rulewatch TO `rulewatch-job`, `fraud-engineers`, `fraud-rule-editors`, `fraud-analysts`;

-- The job: read what lands and the rules file, write every table and checkpoint, (re)create the views.
GRANT READ VOLUME ON VOLUME main.rulewatch.landing TO `rulewatch-job`;
GRANT READ VOLUME ON VOLUME main.rulewatch.rules TO `rulewatch-job`;
GRANT READ VOLUME, WRITE VOLUME ON VOLUME main.rulewatch.lakehouse TO `rulewatch-job`;
GRANT CREATE TABLE ON SCHEMA main.rulewatch TO `rulewatch-job`;

-- Engineers: operate and repair (docs/reliability.md, Recovery), including landing files by hand.
GRANT READ VOLUME, WRITE VOLUME ON VOLUME main.rulewatch.landing TO `fraud-engineers`;
GRANT READ VOLUME, WRITE VOLUME ON VOLUME main.rulewatch.rules TO `fraud-engineers`;
GRANT READ VOLUME, WRITE VOLUME ON VOLUME main.rulewatch.lakehouse TO `fraud-engineers`;
GRANT SELECT ON SCHEMA main.rulewatch TO `fraud-engineers`;

-- Rule editors: the rules file, plus the views (rule_changes shows what the job applied).
GRANT READ VOLUME, WRITE VOLUME ON VOLUME main.rulewatch.rules TO `fraud-rule-editors`;
GRANT SELECT ON SCHEMA main.rulewatch TO `fraud-rule-editors`;

-- Analysts: the views only (SELECT on the schema covers every view in it, freshness included; the
-- schema holds no tables, only views and volumes). No volume rights: no raw events, no writes. Views
-- that read silver/transactions (rule_effectiveness, freshness) return counts and the newest event
-- time, never an event.
GRANT SELECT ON SCHEMA main.rulewatch TO `fraud-analysts`;

SHOW GRANTS ON SCHEMA main.rulewatch;
SHOW GRANTS ON VOLUME main.rulewatch.lakehouse;
SHOW GRANTS ON VOLUME main.rulewatch.rules;
