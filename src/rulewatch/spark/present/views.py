"""The dashboard's SQL views, written once and created either locally or in Unity Catalog.

Every dashboard dataset, the local HTML report and the explore notebook read these views, so a
number means the same thing everywhere. Each view's SQL names its inputs as ``{placeholders}``:

- locally (:func:`register_views`) the gold/silver/config tables become temp views read from the
  lakehouse's tables (conformed to ``storage/schema.py``, so a lakehouse written before a column
  existed still answers), and the views become temp views of the same names;
- in Unity Catalog (:func:`catalog_view_statements`) the inputs are the lakehouse's tables by name
  (managed tables of ``Lakehouse.schema``, or Delta paths without one) and the views are ``CREATE OR REPLACE VIEW <catalog>.<schema>.<name>``; the
  dashboard's datasets name the views unqualified and the bundle sets their catalog and schema.

Account identifiers are masked in ``alerts_masked`` for viewers outside a group. On Databricks the
test is ``is_account_group_member('<group>')``, evaluated per viewer at query time; that function
does not exist in open-source Spark, so locally the caller states whether the viewer is in the group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StructType

from rulewatch.spark.storage import schema, tables
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.runtime.env import is_databricks
from rulewatch.spark.evaluator.settings import HLL_LG_CONFIG_K, NEAR_LIMIT_SHARE

# Rule fields that identify an account or a person; their values are masked for non-members.
ACCOUNT_FIELDS = ("payeeId", "beneficiaryId", "userId", "ip")
# key_parts may be keyed by rule field name or by column name; both spellings are masked.
_MASKED_KEYS = ", ".join(f"'{name}'" for f in ACCOUNT_FIELDS for name in dict.fromkeys((f, schema.FIELD_COLUMNS[f])))

# Input name -> (layer, table, schema); the view SQL refers to them as {name}.
SOURCES: dict[str, tuple[str, str, StructType]] = {
    "alerts": ("gold", "alerts", schema.ALERTS),
    "window_metrics": ("gold", "window_metrics", schema.WINDOW_METRICS),
    "pipeline_metrics": ("gold", "pipeline_metrics", schema.PIPELINE_METRICS),
    "rule_history": ("gold", "rule_history", schema.RULE_HISTORY),
    "late_events": ("gold", "late_events", schema.LATE_EVENTS),
    "quarantine": ("silver", "quarantine", schema.QUARANTINE),
    "duplicates": ("silver", "duplicates", schema.DUPLICATES),
    "silver_transactions": ("silver", "transactions", schema.SILVER),
    "rules": ("config", "rules", schema.RULES),
}


def _mask(expr: str) -> str:
    """A stable pseudonym: the same identifier always masks to the same token, so counts per key still work."""
    return f"concat('#', substr(sha2({expr}, 256), 1, 10))"


@dataclass(frozen=True)
class View:
    name: str
    comment: str
    sql: str


# In dependency order: a view may use the ones above it.
VIEWS: tuple[View, ...] = (
    View(
        "alerts_masked",
        "Every alert; account identifiers (group key, key parts, distinct values) pseudonymised unless the viewer is in the PII group",
        f"""
SELECT
  alert_id, rule_id, rule_version, rule_description,
  CASE WHEN {{viewer_sees_pii}} OR NOT coalesce(exists(map_keys(key_parts), k -> k IN ({_MASKED_KEYS})), TRUE)
       THEN group_key ELSE {_mask('group_key')} END AS group_key,
  CASE WHEN {{viewer_sees_pii}} THEN key_parts
       ELSE transform_values(key_parts, (k, v) -> CASE WHEN k IN ({_MASKED_KEYS}) THEN {_mask('v')} ELSE v END)
  END AS key_parts,
  transaction_id, event_time, ingest_time, aggregator, aggregate_value, `limit`, operator,
  window_start, window_end, event_count,
  CASE WHEN {{viewer_sees_pii}} THEN distinct_values ELSE transform(distinct_values, v -> {_mask('v')}) END AS distinct_values,
  decision_time, latency_ms
FROM {{alerts}}""",
    ),
    View(
        "key_window_metrics",
        "Per rule and key near its limit (or every key, as gold was told), each micro-batch's window aggregate at the key's last event and the batch's peak (key masked like alerts_masked)",
        f"""
SELECT
  w.rule_id, w.rule_version,
  -- No key parts here: the rule's grouping fields decide, so keys mask exactly as in alerts_masked.
  CASE WHEN {{viewer_sees_pii}} OR NOT coalesce(exists(r.groupingKeyNames, k -> k IN ({_MASKED_KEYS})), TRUE)
       THEN w.group_key ELSE {_mask('w.group_key')} END AS group_key,
  w.event_time, w.aggregate_value, w.max_aggregate, w.`limit`, w.operator, w.event_count, w.window_start, w.window_end,
  w.gold_batch_id
FROM {{window_metrics}} w
LEFT JOIN {{rules}} r ON r.ruleId = w.rule_id
WHERE w.keys_sketch IS NULL""",
    ),
    View(
        "alerts_per_rule_hour",
        "Alerts per rule per hour of event time, with the number of distinct keys alerted",
        """
SELECT
  date_trunc('HOUR', event_time) AS hour,
  rule_id,
  concat('rule ', rule_id) AS rule,
  count(*) AS alerts,
  count(DISTINCT group_key) AS keys_alerted
FROM {alerts}
GROUP BY date_trunc('HOUR', event_time), rule_id""",
    ),
    View(
        "top_alerting_keys",
        "Keys ranked by their number of alerts per rule (masked like alerts_masked)",
        """
SELECT
  rank() OVER (ORDER BY count(*) DESC) AS key_rank,
  rule_id,
  group_key,
  count(*) AS alerts,
  min(event_time) AS first_alert,
  max(event_time) AS last_alert,
  max(aggregate_value) AS max_aggregate,
  max(`limit`) AS `limit`
FROM {alerts_masked}
GROUP BY rule_id, group_key""",
    ),
    View(
        "rule_effectiveness",
        "Per rule: alerts, alerts per 1,000 silver events, keys evaluated (a HyperLogLog estimate, ~1.6 % error beyond a few hundred keys), and keys whose peak came near the limit without alerting",
        f"""
WITH events AS (
  SELECT count(*) AS silver_events FROM {{silver_transactions}}
),
alerted AS (
  SELECT rule_id, count(*) AS alerts, count(DISTINCT group_key) AS keys_alerted FROM {{alerts}} GROUP BY rule_id
),
peaks AS (
  -- Nearness is only defined for upper limits: the evaluator records each key's peak, not its low.
  -- In decimals, as gold.kept_metric decides which keys have rows: a double ratio puts 2.4 of 3 below 80 %.
  SELECT rule_id, group_key,
    max(operator IN ('GREATER', 'GREATER_EQUAL') AND `limit` > 0 AND max_aggregate >= `limit` * {NEAR_LIMIT_SHARE}) AS near
  FROM {{window_metrics}}
  WHERE keys_sketch IS NULL
  GROUP BY rule_id, group_key
),
near AS (
  SELECT p.rule_id, count_if(p.near AND a.group_key IS NULL) AS keys_near_limit
  FROM peaks p
  LEFT JOIN (SELECT DISTINCT rule_id, group_key FROM {{alerts}}) a ON a.rule_id = p.rule_id AND a.group_key = p.group_key
  GROUP BY p.rule_id
),
sketches AS (
  -- Every evaluated key is in its rule's summary rows' sketches; the per-key rows' keys are too (a
  -- subset), which also counts the batches of a lakehouse written before summary rows existed.
  SELECT rule_id, keys_sketch FROM {{window_metrics}} WHERE keys_sketch IS NOT NULL
  UNION ALL
  SELECT rule_id, hll_sketch_agg(group_key, {HLL_LG_CONFIG_K}) FROM {{window_metrics}} WHERE keys_sketch IS NULL GROUP BY rule_id
),
keys AS (
  SELECT s.rule_id, hll_sketch_estimate(hll_union_agg(s.keys_sketch)) AS keys_evaluated,
    coalesce(first(n.keys_near_limit), 0) AS keys_near_limit
  FROM sketches s
  LEFT JOIN near n ON n.rule_id = s.rule_id
  GROUP BY s.rule_id
)
SELECT
  r.ruleId AS rule_id,
  r.ruleState AS rule_state,
  r.description AS rule_description,
  coalesce(a.alerts, 0) AS alerts,
  e.silver_events,
  round(1000.0 * coalesce(a.alerts, 0) / nullif(e.silver_events, 0), 3) AS alerts_per_1k_events,
  coalesce(k.keys_evaluated, 0) AS keys_evaluated,
  coalesce(a.keys_alerted, 0) AS keys_alerted,
  coalesce(k.keys_near_limit, 0) AS keys_near_limit,
  round(k.keys_near_limit / nullif(k.keys_evaluated, 0), 4) AS share_near_limit
FROM {{rules}} r
CROSS JOIN events e
LEFT JOIN alerted a ON a.rule_id = r.ruleId
LEFT JOIN keys k ON k.rule_id = r.ruleId""",
    ),
    View(
        "latency_trend",
        "Per gold micro-batch: alerts and ingest-to-alert latency percentiles (ms)",
        """
SELECT
  batch_id, batch_end, alerts, processing_ms,
  latency_p50_ms, latency_p95_ms, latency_p99_ms, latency_max_ms,
  event_latency_p50_ms, event_latency_p99_ms
FROM {pipeline_metrics}
WHERE layer = 'gold'""",
    ),
    View(
        "quarantine_reasons",
        "Quarantined lines per reason code (a line failing several checks counts under each), with one example reason",
        """
SELECT reason_code, count(*) AS lines, min(ingest_time) AS first_seen, max(ingest_time) AS last_seen, min(example) AS example
FROM (
  SELECT code AS reason_code, element_at(split(reason, '; '), i + 1) AS example, ingest_time
  FROM {quarantine} LATERAL VIEW posexplode(split(coalesce(reason_code, 'uncoded'), '; ')) codes AS i, code
)
GROUP BY reason_code""",
    ),
    View(
        "id_conflicts",
        "Lines that reused an accepted transaction id with other content (first wins; the line is in silver/duplicates)",
        """
SELECT transaction_id, ingest_time, source_file, silver_batch_id
FROM {duplicates}
WHERE conflict""",
    ),
    View(
        "rule_changes",
        "Every change of config/rules, newest first in the dashboard: who, when, before and after",
        """
SELECT
  rule_id, change, commit_version, commit_timestamp, updated_by,
  get_json_object(coalesce(after, before), '$.description') AS rule_description,
  before, after
FROM {rule_history}""",
    ),
    View(
        "pipeline_batches",
        "One row per micro-batch per layer: rows in/out, quarantined, alerts, processing time, state size, rules",
        """
SELECT
  layer, batch_id, batch_start, batch_end, processing_ms, rows_in, rows_out, quarantined, duplicates,
  alerts, late_events, keys_touched, state_rows_total, state_bytes_total, active_rules, rules_version,
  -- Every layer reads the rows the one before wrote: only bronze's rows_in are new lines.
  CASE WHEN layer = 'bronze' THEN rows_in ELSE 0 END AS rows_ingested
FROM {pipeline_metrics}""",
    ),
    View(
        "freshness",
        "How current the tables are: newest event time in silver, end of the last gold micro-batch, and how long ago each was (minutes)",
        """
SELECT
  e.newest_event_time,
  g.last_gold_batch_end,
  current_timestamp() AS checked_at,
  round((unix_millis(current_timestamp()) - unix_millis(e.newest_event_time)) / 60000.0, 1) AS event_lag_minutes,
  round((unix_millis(current_timestamp()) - unix_millis(g.last_gold_batch_end)) / 60000.0, 1) AS gold_lag_minutes
FROM (SELECT max(event_time) AS newest_event_time FROM {silver_transactions}) e
CROSS JOIN (SELECT max(batch_end) AS last_gold_batch_end FROM {pipeline_metrics} WHERE layer = 'gold') g""",
    ),
)
VIEW_NAMES = tuple(v.name for v in VIEWS)

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}")
_GROUP = re.compile(r"[A-Za-z0-9_. @+-]{1,255}")


def _identifier(value: str, what: str) -> str:
    if not _IDENTIFIER.fullmatch(value or ""):
        raise ValueError(f"{what} {value!r} is not a plain identifier (letters, digits and _, not starting with a digit)")
    return value


def render(view: View, sources: dict[str, str], viewer_sees_pii: str) -> str:
    """``view``'s SQL with its inputs and the PII-group test filled in."""
    return view.sql.format(**sources, viewer_sees_pii=viewer_sees_pii).strip()


def _local_source_name(name: str) -> str:
    return f"rulewatch_src_{name}"


def register_views(spark: SparkSession, lakehouse: Lakehouse, viewer_in_pii_group: bool) -> None:
    """Create every view as a session temp view over ``lakehouse``'s Delta tables.

    ``viewer_in_pii_group`` stands in for ``is_account_group_member``: pass whether the person
    looking is allowed to see account identifiers. A table the lakehouse does not have yet reads as
    empty, so the views answer on a lakehouse that has not run every layer.
    """
    for name, (layer, table, table_schema) in SOURCES.items():
        _read_or_empty(spark, lakehouse.table(layer, table), table_schema).createOrReplaceTempView(_local_source_name(name))
    sources = {name: _local_source_name(name) for name in SOURCES} | {name: name for name in VIEW_NAMES}
    for view in VIEWS:
        spark.sql(f"CREATE OR REPLACE TEMP VIEW {view.name} AS {render(view, sources, str(viewer_in_pii_group).upper())}")


def _read_or_empty(spark: SparkSession, table: str, table_schema: StructType) -> DataFrame:
    """``table`` conformed to ``table_schema``; an empty one if nothing is there yet."""
    try:
        frame = tables.read(spark, table)
        frame.columns  # analysis is lazy under Spark Connect: fail here, not in the first query
    except AnalysisException as err:
        if err.getCondition() not in ("PATH_NOT_FOUND", "DELTA_TABLE_NOT_FOUND", "TABLE_OR_VIEW_NOT_FOUND"):
            raise
        return spark.createDataFrame([], table_schema)
    return schema.conform(frame, table_schema)


def catalog_view_statements(catalog: str, schema_name: str, lakehouse: Lakehouse, pii_group: str) -> list[str]:
    """``CREATE OR REPLACE VIEW`` statements for Unity Catalog, in dependency order.

    The views read ``lakehouse``'s tables (managed tables of its schema, or Delta folders without one)
    and mask account identifiers for anyone not in account group ``pii_group``.
    """
    _identifier(catalog, "catalog")
    _identifier(schema_name, "schema")
    if not _GROUP.fullmatch(pii_group or ""):
        raise ValueError(
            f"PII group {pii_group!r} is not a valid group name (letters, digits, space and _ . @ + -); "
            "set the bundle variable pii_viewer_group"
        )
    qualified = {name: f"`{catalog}`.`{schema_name}`.`{name}`" for name in VIEW_NAMES}
    sources = {name: tables.table_ref(lakehouse.table(layer, table)) for name, (layer, table, _) in SOURCES.items()} | qualified
    member = f"is_account_group_member('{pii_group}')"
    return [
        f"CREATE OR REPLACE VIEW {qualified[v.name]} COMMENT {tables.sql_string(v.comment)} AS {render(v, sources, member)}" for v in VIEWS
    ]


def create_catalog_views(spark: SparkSession, catalog: str, schema_name: str, lakehouse: Lakehouse, pii_group: str) -> list[str]:
    """Create or replace every view in ``catalog.schema_name`` (on Databricks); returns the view names created."""
    for statement in catalog_view_statements(catalog, schema_name, lakehouse, pii_group):
        spark.sql(statement)
    return [f"{catalog}.{schema_name}.{name}" for name in VIEW_NAMES]


def setup_dashboard_views(spark: SparkSession, lakehouse: Lakehouse, catalog: str, schema_name: str, pii_group: str) -> list[str]:
    """The setup task's step: the dashboard's views in Unity Catalog when running on Databricks
    with a catalog given; elsewhere nothing (locally ``register_views`` makes session views)."""
    if not (catalog and is_databricks()):
        return []
    return create_catalog_views(spark, catalog, schema_name, lakehouse, pii_group)
