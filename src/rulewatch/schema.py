"""Table schemas and the mapping between rule field names (reference JSON) and silver columns."""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType, BooleanType, DecimalType, IntegerType, LongType, MapType, StringType, StructField, StructType,
    TimestampType,
)  # fmt: skip

MONEY = DecimalType(18, 2)
AGGREGATE = DecimalType(38, 6)

# Rule field name -> silver column. Rules speak the reference's camelCase; tables speak snake_case.
FIELD_COLUMNS: dict[str, str] = {
    "transactionId": "transaction_id",
    "payeeId": "payee_id",
    "beneficiaryId": "beneficiary_id",
    "paymentAmount": "payment_amount",
    "paymentType": "payment_type",
    "userId": "user_id",
    "ip": "ip",
    "action": "action",
}

# What silver parses from each JSON line; every field is read as text first so a wrong type becomes
# a quarantine reason instead of a silent null.
RAW_FIELDS = ["transactionId", "eventTime", *[f for f in FIELD_COLUMNS if f != "transactionId"]]
RAW_SCHEMA = StructType(
    [StructField(name, StringType()) for name in RAW_FIELDS] + [StructField("_corrupt_record", StringType())]
)

BRONZE = StructType([
    StructField("value", StringType()),
    StructField("source_file", StringType()),
    StructField("ingest_time", TimestampType()),
    StructField("ingest_seq", LongType()),
])  # fmt: skip

SILVER = StructType([
    StructField("transaction_id", StringType(), False),
    StructField("event_time", TimestampType(), False),
    StructField("payee_id", StringType()),
    StructField("beneficiary_id", StringType()),
    StructField("payment_amount", MONEY),
    StructField("payment_type", StringType()),
    StructField("user_id", StringType()),
    StructField("ip", StringType()),
    StructField("action", StringType()),
    StructField("source_file", StringType()),
    StructField("ingest_time", TimestampType()),
    StructField("silver_batch_id", LongType()),
])  # fmt: skip

QUARANTINE = StructType([
    StructField("value", StringType()),
    StructField("reason", StringType(), False),
    StructField("source_file", StringType()),
    StructField("ingest_time", TimestampType()),
    StructField("silver_batch_id", LongType()),
])  # fmt: skip

DUPLICATES = StructType([
    StructField("transaction_id", StringType(), False),
    StructField("value", StringType()),
    StructField("source_file", StringType()),
    StructField("ingest_time", TimestampType()),
    StructField("silver_batch_id", LongType()),
])  # fmt: skip

# config/rules: one row per rule, columns named exactly like the reference JSON fields so analysts'
# SQL reads like the rule files (UPDATE ... SET limit = 500 WHERE ruleId = 1).
RULES = StructType([
    StructField("ruleId", IntegerType(), False),
    StructField("ruleState", StringType()),
    StructField("groupingKeyNames", ArrayType(StringType())),
    StructField("aggregateFieldName", StringType()),
    StructField("aggregatorFunctionType", StringType()),
    StructField("limitOperatorType", StringType()),
    StructField("limit", DecimalType(38, 10)),
    StructField("window", StringType()),
    StructField("filter", MapType(StringType(), StringType())),
    StructField("cooldown", StringType()),
    StructField("reportNewValuesOnly", BooleanType()),
    StructField("bucket", StringType()),
    StructField("description", StringType()),
    StructField("updated_at", TimestampType()),
    StructField("updated_by", StringType()),
])  # fmt: skip
RULE_FIELDS = [f.name for f in RULES.fields if f.name not in ("updated_at", "updated_by")]

# config/rule_commands: control operations for the running evaluator, appended by
# ``rulewatch rules clear-state`` (or its notebook call) and read by gold as a stream.
RULE_COMMANDS = StructType([
    StructField("command_id", StringType(), False),
    StructField("command", StringType(), False),  # clear_state
    StructField("rule_id", IntegerType()),  # null: every rule
    StructField("clear_before", TimestampType(), False),
    StructField("requested_at", TimestampType()),
    StructField("requested_by", StringType()),
])  # fmt: skip

ALERTS = StructType([
    StructField("alert_id", StringType(), False),
    StructField("rule_id", IntegerType(), False),
    StructField("rule_version", LongType()),
    StructField("rule_description", StringType()),
    StructField("group_key", StringType()),
    StructField("key_parts", MapType(StringType(), StringType())),
    StructField("transaction_id", StringType()),
    StructField("event_time", TimestampType()),
    StructField("ingest_time", TimestampType()),
    StructField("aggregator", StringType()),
    StructField("aggregate_value", AGGREGATE),
    StructField("limit", DecimalType(38, 10)),
    StructField("operator", StringType()),
    StructField("window_start", TimestampType()),
    StructField("window_end", TimestampType()),
    StructField("event_count", LongType()),
    StructField("distinct_values", ArrayType(StringType())),
    StructField("decision_time", TimestampType()),
    StructField("latency_ms", LongType()),
    StructField("gold_batch_id", LongType()),
])  # fmt: skip

WINDOW_METRICS = StructType([
    StructField("rule_id", IntegerType(), False),
    StructField("rule_version", LongType()),
    StructField("group_key", StringType()),
    StructField("event_time", TimestampType()),
    StructField("aggregate_value", AGGREGATE),
    StructField("max_aggregate", AGGREGATE),
    StructField("limit", DecimalType(38, 10)),
    StructField("operator", StringType()),
    StructField("event_count", LongType()),
    StructField("window_start", TimestampType()),
    StructField("window_end", TimestampType()),
    StructField("gold_batch_id", LongType()),
])  # fmt: skip

LATE_EVENTS = StructType([
    StructField("transaction_id", StringType()),
    StructField("keyset", StringType()),
    StructField("group_key", StringType()),
    StructField("event_time", TimestampType()),
    StructField("reason", StringType()),
    StructField("gold_batch_id", LongType()),
])  # fmt: skip

RULE_ERRORS = StructType([
    StructField("rule_id", IntegerType()),
    StructField("commit_version", LongType()),
    StructField("field", StringType()),
    StructField("reason", StringType()),
    StructField("gold_batch_id", LongType()),
])  # fmt: skip

# gold/pipeline_metrics: one row per micro-batch of each layer. Latencies are gold-only: from the
# bronze ingest time (and from the event time) of each alert's event to the commit of its alerts.
PIPELINE_METRICS = StructType([
    StructField("layer", StringType(), False),  # bronze | silver | gold
    StructField("batch_id", LongType(), False),
    StructField("batch_start", TimestampType()),
    StructField("batch_end", TimestampType()),
    StructField("processing_ms", LongType()),
    StructField("rows_in", LongType()),
    StructField("rows_out", LongType()),
    StructField("quarantined", LongType()),
    StructField("duplicates", LongType()),
    StructField("alerts", LongType()),
    StructField("late_events", LongType()),
    StructField("latency_p50_ms", LongType()),
    StructField("latency_p95_ms", LongType()),
    StructField("latency_p99_ms", LongType()),
    StructField("latency_max_ms", LongType()),
    StructField("event_latency_p50_ms", LongType()),
    StructField("event_latency_p99_ms", LongType()),
    StructField("keys_touched", LongType()),
    StructField("state_rows_written", LongType()),
    StructField("state_bytes_written", LongType()),
    StructField("state_rows_total", LongType()),
    StructField("state_bytes_total", LongType()),
    StructField("active_rules", IntegerType()),
    StructField("rules_version", LongType()),
])  # fmt: skip

# gold/rule_history: one row per change of config/rules, built from its change data feed.
# ``before`` / ``after`` are the rule as reference JSON text (null for an insert / a delete).
RULE_HISTORY = StructType([
    StructField("rule_id", IntegerType(), False),
    StructField("change", StringType(), False),  # inserted | updated | deleted
    StructField("commit_version", LongType(), False),
    StructField("commit_timestamp", TimestampType()),
    StructField("updated_by", StringType()),
    StructField("before", StringType()),
    StructField("after", StringType()),
])  # fmt: skip


def conform(df: DataFrame, schema: StructType) -> DataFrame:
    """``df`` with ``schema``'s columns in order; the ones it lacks become typed nulls."""
    return df.select(
        *[(F.col(f.name) if f.name in df.columns else F.lit(None)).cast(f.dataType).alias(f.name) for f in schema.fields]
    )
