"""Table schemas and the mapping between rule field names (reference JSON) and silver columns."""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType, BinaryType, BooleanType, DecimalType, IntegerType, LongType, MapType, StringType, StructField, StructType,
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
    StructField("value", StringType(), metadata={"comment": "The landed line; invalid UTF-8 sequences shown as U+FFFD (the bytes are in value_bytes)"}),
    StructField("source_file", StringType(), metadata={"comment": "File the line came from"}),
    StructField("ingest_time", TimestampType(), metadata={"comment": "When the micro-batch read it"}),
    StructField("ingest_seq", LongType(), metadata={"comment": "Order of the line within its micro-batch"}),
    StructField("value_bytes", BinaryType(), metadata={"comment": "The line's exact bytes when they are not valid UTF-8, else null"}),
    StructField("source_file_size", LongType(), metadata={"comment": "Size of the file in bytes when it was read"}),
    StructField("source_file_mtime", TimestampType(), metadata={"comment": "Modification time of the file when it was read"}),
    StructField("kafka_topic", StringType(), metadata={"comment": "Kafka topic of the record (null for landed files)"}),
    StructField("kafka_partition", IntegerType(), metadata={"comment": "Kafka partition of the record"}),
    StructField("kafka_offset", LongType(), metadata={"comment": "Offset of the record in its partition"}),
    StructField("kafka_key", BinaryType(), metadata={"comment": "The record's key, exact bytes"}),
    StructField("kafka_timestamp", TimestampType(), metadata={"comment": "The record's Kafka timestamp"}),
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
    StructField("reason_code", StringType(), metadata={"comment": "Stable code of each reason, '; '-separated like reason (silver.REASON_CODES); group charts by it"}),
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
    StructField("conflict", BooleanType(), metadata={"comment": "The id repeats with other content than the accepted line's (first wins): a reused id, not a redelivery"}),
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

# gold/rule_keysets: the grouping-field sets gold's evaluator held rules for after its newest batch that
# said (every shard holds the same rules). Gold routes each event to these as well as to the rules
# table's own: a rule deleted or regrouped in config/rules is still evaluated until its change reaches
# the evaluator (a run's later batches, a live batch planned before the commit), and needs its events.
RULE_KEYSETS = StructType([
    StructField("keyset", StringType(), False, metadata={"comment": "Grouping fields, joined with ,"}),
    StructField("groupingKeyNames", ArrayType(StringType()), False, metadata={"comment": "The grouping fields, in order"}),
    StructField("gold_batch_id", LongType(), metadata={"comment": "Gold micro-batch whose evaluator held them"}),
])  # fmt: skip

ALERTS = StructType([
    StructField("alert_id", StringType(), False, metadata={"comment": "Deterministic id: hash of rule, key and transaction, so a replay writes the same id"}),
    StructField("rule_id", IntegerType(), False, metadata={"comment": "Rule that fired (config/rules.ruleId)"}),
    StructField("rule_version", LongType(), metadata={"comment": "Commit version of config/rules that defined the rule as evaluated"}),
    StructField("rule_description", StringType(), metadata={"comment": "The rule's description at that version"}),
    StructField("group_key", StringType(), metadata={"comment": "Values of the rule's grouping fields, joined with |"}),
    StructField("key_parts", MapType(StringType(), StringType()), metadata={"comment": "Grouping field name -> value for this key"}),
    StructField("transaction_id", StringType(), metadata={"comment": "Transaction whose arrival triggered the alert"}),
    StructField("event_time", TimestampType(), metadata={"comment": "Event time of the triggering transaction"}),
    StructField("ingest_time", TimestampType(), metadata={"comment": "When the triggering transaction landed in bronze"}),
    StructField("aggregator", StringType(), metadata={"comment": "Aggregate function: SUM, COUNT, AVG, MIN, MAX or UNIQUE_COUNT"}),
    StructField("aggregate_value", AGGREGATE, metadata={"comment": "Aggregate over the window ending at the triggering transaction"}),
    StructField("limit", DecimalType(38, 10), metadata={"comment": "Limit the aggregate was compared with"}),
    StructField("operator", StringType(), metadata={"comment": "Comparison that held: aggregate <operator> limit"}),
    StructField("window_start", TimestampType(), metadata={"comment": "Start of the look-back window (inclusive)"}),
    StructField("window_end", TimestampType(), metadata={"comment": "End of the window: the triggering event's time (inclusive)"}),
    StructField("event_count", LongType(), metadata={"comment": "Events of the key in the window that passed the rule's filter"}),
    StructField("distinct_values", ArrayType(StringType()), metadata={"comment": "Distinct values counted (UNIQUE_COUNT rules only)"}),
    StructField("decision_time", TimestampType(), metadata={"comment": "When the evaluator decided to alert"}),
    StructField("latency_ms", LongType(), metadata={"comment": "decision_time - ingest_time, in ms"}),
    StructField("gold_batch_id", LongType(), metadata={"comment": "Gold micro-batch that wrote the row"}),
])  # fmt: skip

WINDOW_METRICS = StructType([
    StructField("rule_id", IntegerType(), False, metadata={"comment": "Rule evaluated"}),
    StructField("rule_version", LongType(), metadata={"comment": "Commit version of config/rules that defined the rule as evaluated"}),
    StructField("group_key", StringType(), metadata={"comment": "Values of the rule's grouping fields, joined with |"}),
    StructField("event_time", TimestampType(), metadata={"comment": "Time of the key's last event in the micro-batch"}),
    StructField("aggregate_value", AGGREGATE, metadata={"comment": "Aggregate over the window ending at that last event"}),
    StructField("max_aggregate", AGGREGATE, metadata={"comment": "Highest aggregate over the key's events in the micro-batch"}),
    StructField("limit", DecimalType(38, 10), metadata={"comment": "Limit of the rule"}),
    StructField("operator", StringType(), metadata={"comment": "Comparison of the rule: aggregate <operator> limit alerts"}),
    StructField("event_count", LongType(), metadata={"comment": "Events in the window ending at the last event"}),
    StructField("window_start", TimestampType(), metadata={"comment": "Start of that window (inclusive)"}),
    StructField("window_end", TimestampType(), metadata={"comment": "End of that window (inclusive)"}),
    StructField("gold_batch_id", LongType(), metadata={"comment": "Gold micro-batch that wrote the row"}),
    # A rule's summary row per batch (no key): every key it evaluated, also those without a row here.
    StructField("keys_evaluated", LongType(), metadata={"comment": "Summary row (group_key null): distinct keys the rule evaluated in the micro-batch"}),
    StructField("keys_sketch", BinaryType(), metadata={"comment": "Summary row: those keys as an hll_sketch_agg sketch (lgConfigK 12); merge with hll_union_agg"}),
])  # fmt: skip

LATE_EVENTS = StructType([
    StructField("transaction_id", StringType(), metadata={"comment": "Transaction that arrived too late"}),
    StructField("keyset", StringType(), metadata={"comment": "Grouping fields (keyset) the event was keyed by"}),
    StructField("group_key", StringType(), metadata={"comment": "Its values of those fields, joined with |"}),
    StructField("event_time", TimestampType(), metadata={"comment": "Its event time"}),
    StructField("reason", StringType(), metadata={"comment": "Why it was not evaluated"}),
    StructField("gold_batch_id", LongType(), metadata={"comment": "Gold micro-batch that recorded it"}),
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
    StructField("layer", StringType(), False, metadata={"comment": "bronze, silver or gold"}),
    StructField("batch_id", LongType(), False, metadata={"comment": "Micro-batch id of the layer's stream"}),
    StructField("batch_start", TimestampType(), metadata={"comment": "When the micro-batch started"}),
    StructField("batch_end", TimestampType(), metadata={"comment": "When its writes committed"}),
    StructField("processing_ms", LongType(), metadata={"comment": "batch_end - batch_start in ms"}),
    StructField("rows_in", LongType(), metadata={"comment": "Rows read by the micro-batch"}),
    StructField("rows_out", LongType(), metadata={"comment": "Rows written to the layer's main table"}),
    StructField("quarantined", LongType(), metadata={"comment": "Lines quarantined (silver)"}),
    StructField("duplicates", LongType(), metadata={"comment": "Repeated transaction ids dropped (silver)"}),
    StructField("alerts", LongType(), metadata={"comment": "Alerts written (gold)"}),
    StructField("late_events", LongType(), metadata={"comment": "Events recorded as too late (gold)"}),
    StructField("latency_p50_ms", LongType(), metadata={"comment": "Median bronze ingest -> alert latency of the batch's alerts, ms"}),
    StructField("latency_p95_ms", LongType(), metadata={"comment": "95th percentile ingest -> alert latency, ms"}),
    StructField("latency_p99_ms", LongType(), metadata={"comment": "99th percentile ingest -> alert latency, ms"}),
    StructField("latency_max_ms", LongType(), metadata={"comment": "Largest ingest -> alert latency, ms"}),
    StructField("event_latency_p50_ms", LongType(), metadata={"comment": "Median event time -> alert latency, ms"}),
    StructField("event_latency_p99_ms", LongType(), metadata={"comment": "99th percentile event time -> alert latency, ms"}),
    StructField("keys_touched", LongType(), metadata={"comment": "Keys evaluated in the batch (gold)"}),
    StructField("state_rows_written", LongType(), metadata={"comment": "State rows written by the batch (gold)"}),
    StructField("state_bytes_written", LongType(), metadata={"comment": "State bytes written by the batch (gold)"}),
    StructField("state_rows_total", LongType(), metadata={"comment": "State rows held after the batch (gold)"}),
    StructField("state_bytes_total", LongType(), metadata={"comment": "State bytes held after the batch (gold)"}),
    StructField("active_rules", IntegerType(), metadata={"comment": "Active rules after the batch (gold)"}),
    StructField("rules_version", LongType(), metadata={"comment": "Newest config/rules commit version applied (gold)"}),
    StructField("rows_written", MapType(StringType(), LongType()), metadata={"comment": "Rows appended per table (layer/table) by the micro-batch; a start-up check compares it with each table's commits"}),
    StructField("step_ms", MapType(StringType(), LongType()), metadata={"comment": "Wall ms of each step of the micro-batch (parse, evaluate, each table's append, ...); steps run at once overlap"}),
])  # fmt: skip

# gold/rule_history: one row per change of config/rules, built from its change data feed.
# ``before`` / ``after`` are the rule as reference JSON text (null for an insert / a delete).
RULE_HISTORY = StructType([
    StructField("rule_id", IntegerType(), False, metadata={"comment": "Rule changed"}),
    StructField("change", StringType(), False, metadata={"comment": "inserted, updated or deleted"}),
    StructField("commit_version", LongType(), False, metadata={"comment": "Commit version of config/rules with the change"}),
    StructField("commit_timestamp", TimestampType(), metadata={"comment": "When it was committed"}),
    StructField("updated_by", StringType(), metadata={"comment": "Who changed it"}),
    StructField("before", StringType(), metadata={"comment": "The rule as JSON before the change (null for an insert)"}),
    StructField("after", StringType(), metadata={"comment": "The rule as JSON after the change (null for a delete)"}),
])  # fmt: skip


def conform(df: DataFrame, schema: StructType) -> DataFrame:
    """``df`` with ``schema``'s columns in order; the ones it lacks become typed nulls."""
    return df.select(
        *[(F.col(f.name) if f.name in df.columns else F.lit(None)).cast(f.dataType).alias(f.name) for f in schema.fields]
    )
