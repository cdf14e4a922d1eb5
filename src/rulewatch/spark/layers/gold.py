"""Gold: silver events + the rules change feed -> stateful evaluator -> alerts, metrics, late events.

Flow: silver stream (or, live, the Kafka source itself: parsed, checked and de-duplicated as silver does,
``_first_lines``) -> watermark -> fan out per keyset (evaluator/keying.py) -> union with every rule change
broadcast to all shards -> ``transformWithStateInPandas`` grouped by shard (evaluator/shard.py) ->
one ``foreachBatch`` that splits the output into idempotent Delta appends (storage/sinks.py).
"""

from __future__ import annotations

import time
from datetime import datetime
from decimal import Decimal
from dataclasses import dataclass, replace
from functools import cache, partial
from typing import Any, Callable, ContextManager

from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.types import LongType, StructField, StructType

from rulewatch.spark.storage import first_commit, schema, tables
from rulewatch.spark.storage.checkpoints import SILVER_AFTER_BATCH, STARTING_VERSIONS, WATERMARK_FLOOR, batch_base, check_gold_layout, gold_record
from rulewatch.spark.storage.delta_log import CheckpointError
from rulewatch.spark.control.commands import command_stream, ensure_commands_table
from rulewatch.engine.engine import MONEY_SCALE, OUTPUT_SCHEMA
from rulewatch.spark.evaluator.dedup import EVENT_MS, DedupProcessor
from rulewatch.spark.evaluator.processor import RuleProcessor
from rulewatch.spark.layers import silver
from rulewatch.kafka import alerts as kafka_alerts
from rulewatch.kafka.client import KafkaTopic
from rulewatch.kafka.source import KafkaSource, read_kafka
from rulewatch.spark.evaluator.keying import fan_out, keysets, shard_label
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.evaluator.packing import pack
from rulewatch.spark.storage.metrics import Recorder, Steps, ensure_metrics_table, latency_columns, metrics_row
from rulewatch.engine.rules import parse_duration
from rulewatch.spark.control.rules_table import ensure_rules_table, rule_change_feed
from rulewatch.spark.runtime.session import session_confs
from rulewatch.spark.evaluator.settings import HLL_LG_CONFIG_K, NEAR_LIMIT_SHARE, GoldSettings
from rulewatch.spark.storage.sinks import append_once, batch_column, crash_point, per_run, shifted, sink_name, together

NO_DATA_BATCHES = "spark.sql.streaming.noDataMicroBatches.enabled"
SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"


@dataclass(frozen=True)
class Continued:
    """Where a rescaled gold's new checkpoint goes on from the old one's (checkpoints.gold_record):
    each Delta source's first version, and the watermark below which events stay late.

    Delta needs a starting version that exists. Where the next one does not yet, a source starts at the
    newest, which the old query had read, and its rows are filtered down to what comes after: silver's
    by batch id (``silver_after_batch``), the rules' by commit version (``rules_from``). Never Delta's
    ``latest``, which it resolves later than this check: a commit in between would be skipped."""

    silver: int | None = None
    silver_after_batch: int | None = None
    rules: int = 0
    rules_from: int | None = None
    commands: int | None = None
    watermark_floor_ms: int = 0

    @classmethod
    def of(cls, spark: SparkSession, lakehouse: Lakehouse) -> "Continued":
        """The checkpoint's record. Its starting versions are given at every start: Delta goes by the
        checkpoint's offsets where a source has one, and by the option where it has none yet."""
        record = gold_record(lakehouse.checkpoint("gold"))
        floor = int(record.get(WATERMARK_FLOOR, 0))
        versions = record.get(STARTING_VERSIONS)
        if not versions:
            return cls(watermark_floor_ms=floor)
        silver, silver_next = _existing(spark, lakehouse.silver_transactions, versions["silver"])
        rules, rules_next = _existing(spark, lakehouse.rules, versions["rules"])
        commands, commands_next = _existing(spark, lakehouse.rule_commands, versions["commands"])
        if commands_next:  # the rescale appends a command before the new query starts: it exists
            raise CheckpointError(f"gold's checkpoint goes on from version {versions['commands']} of {lakehouse.rule_commands}, which is not there")
        after = int(record[SILVER_AFTER_BATCH]) if silver_next else None
        return cls(silver, after, rules, versions["rules"] if rules_next else None, commands, floor)


def _existing(spark: SparkSession, table: str, version: int) -> tuple[int, bool]:
    """A starting version Delta can take for ``version``: itself, or the newest when ``version`` is the
    next one, not committed yet (True)."""
    newest = tables.newest_version(spark, table)
    if version <= newest:
        return version, False
    if version == newest + 1:
        return newest, True
    raise CheckpointError(f"gold's checkpoint goes on from version {version} of {table}, which has only {newest + 1}")


def _events(
    spark: SparkSession, lakehouse: Lakehouse, settings: GoldSettings, continued: Continued, source: KafkaSource | None = None
) -> DataFrame:
    lateness_ms = parse_duration(settings.allowed_lateness)
    if source is None:
        lines = _silver_lines(spark, lakehouse, settings, continued).withWatermark("event_time", f"{lateness_ms} milliseconds")
    else:
        lines = _first_lines(read_kafka(spark, source), settings, lateness_ms)
    # The watermark column is projected away before the stateful operator: Spark would otherwise
    # drop rows behind the watermark silently, and late events must be recorded with a reason.
    # Both are read again for every micro-batch: the rules table's keysets, and those the evaluator still
    # holds rules for (a change to the table reaches the evaluator only through its change feed, later).
    held = tables.read_each_run(spark, lakehouse.rule_keysets, schema.RULE_KEYSETS).select("groupingKeyNames")
    rules = tables.read_each_run(spark, lakehouse.rules, StructType([schema.RULES["groupingKeyNames"], schema.RULES["ruleState"]]))
    # Both are a few rows: one partition makes the distinct one stage, not a shuffle into every partition each batch.
    routed = keysets(rules).unionByName(held).coalesce(1).distinct()
    fanned = fan_out(lines, routed, settings.shard_labels)
    amount_units = (F.col("payment_amount") * (10**MONEY_SCALE)).cast("long")
    return fanned.select(
        "shard",
        "keyset",
        "group_key",
        F.unix_millis("event_time").alias("eventTime"),
        F.unix_millis("ingest_time").alias("ingestTime"),
        *[F.col(c).alias(f) for f, c in schema.FIELD_COLUMNS.items() if f != "paymentAmount"],
        F.coalesce(amount_units, F.lit(0)).alias("paymentAmount"),
        F.col("payment_amount").isNull().alias("paymentAmount_null"),
    )


def _silver_lines(spark: SparkSession, lakehouse: Lakehouse, settings: GoldSettings, continued: Continued) -> DataFrame:
    reader = spark.readStream.format("delta")
    if settings.max_files_per_trigger:
        reader = reader.option("maxFilesPerTrigger", settings.max_files_per_trigger)
    silver = tables.read_stream(reader, lakehouse.silver_transactions, starting_version=continued.silver)
    if continued.silver_after_batch is not None:
        silver = silver.where(F.col("silver_batch_id") > continued.silver_after_batch)
    return silver


# NFC maps only these three characters outside ASCII into it (to ';', '`', 'K'); any other text with a
# character outside ASCII stays outside after NFC. Routing by the id with them mapped, and every other
# non-ASCII id to one shard, sends the forms of one id that NFC makes equal to the same shard.
_NFC_INTO_ASCII = ("\u037e\u1fef\u212a", ";`K")


def _first_lines(bronze: DataFrame, settings: GoldSettings, lateness_ms: int) -> DataFrame:
    """Gold straight from the source: the lines silver would accept, as silver's columns (evaluator/dedup.py).

    Parsed and checked as silver does (``silver.parse``); quarantined lines are silver's to record, so
    they stop here. Repeats are dropped by keyed state, grouped by a hash of the id over the shards' labels."""
    valid = silver.parse(bronze).where(F.size("reasons") == 0).withWatermark("event_time", f"{lateness_ms} milliseconds")
    mapped = F.translate("transaction_id", *_NFC_INTO_ASCII)
    ascii_only = F.octet_length(mapped) == F.length(mapped)
    labels = settings.shard_labels
    shard = shard_label(F.when(ascii_only, F.pmod(F.xxhash64(mapped), F.lit(len(labels)))).otherwise(F.lit(0)), labels)
    # As for the evaluator below, the watermarked column itself is not handed to the operator (Spark may
    # filter late input rows on it); late lines must reach the evaluator to be recorded (the test checks they do).
    passed = [c for c in FIRST_LINES.fieldNames() if c not in silver.LINE_ORDER and c != EVENT_MS]
    routed = valid.select(shard.alias("dedup_shard"), F.unix_millis("event_time").alias(EVENT_MS), *silver.LINE_ORDER, *passed)
    processor = DedupProcessor(
        silver.dedup_horizon_ms(), parse_duration(settings.cleanup_granularity), FIRST_LINES.fieldNames(), silver.ID_COLUMNS, silver.LINE_ORDER
    )
    first = routed.groupBy("dedup_shard").transformWithStateInPandas(processor, FIRST_LINES, "Append", "EventTime")
    return first.withColumn("event_time", F.timestamp_millis(EVENT_MS))


def gold_reads(source: KafkaSource | None) -> str:
    """What gold's checkpoint records it reads (``checkpoints.check_gold_layout``): silver, or the topic's identity."""
    return source.identity if source else "silver"


# What the de-duplication passes on: silver's columns but its batch id and source file, the event time in ms.
FIRST_LINES = StructType([
    StructField(EVENT_MS, LongType(), False) if f.name == "event_time" else f
    for f in schema.SILVER.fields
    if f.name not in ("silver_batch_id", "source_file")
])


def _rule_changes(spark: SparkSession, lakehouse: Lakehouse, settings: GoldSettings, continued: Continued) -> DataFrame:
    feed = rule_change_feed(spark, lakehouse, continued.rules)
    if continued.rules_from is not None:
        feed = feed.where(F.col("_commit_version") >= continued.rules_from)
    # Underscore-led names do not survive the trip to pandas; rename them.
    changes = feed.select(
        *schema.RULE_FIELDS,
        F.col("_change_type").alias("change_type"),
        F.col("_commit_version").alias("commit_version"),
    )
    return _to_every_shard(spark, changes, settings)


def _to_every_shard(spark: SparkSession, stream: DataFrame, settings: GoldSettings) -> DataFrame:
    # Every shard needs every rule change and command: broadcast by fanning out to all shards.
    return stream.crossJoin(spark.range(settings.shards).select(shard_label(F.col("id"), settings.shard_labels).alias("shard")))


def evaluated(
    spark: SparkSession,
    lakehouse: Lakehouse,
    settings: GoldSettings,
    continued: Continued = Continued(),
    initial_state: DataFrame | None = None,
    source: KafkaSource | None = None,
) -> DataFrame:
    """The evaluator's output stream (one row per alert / metric / late event / rule error).

    ``continued`` and ``initial_state``: a rescaled gold's first start (layers/rescale.py). ``source``:
    read that topic itself instead of silver (``_first_lines``)."""
    stream = (
        pack(_events(spark, lakehouse, settings, continued, source))
        .unionByName(_rule_changes(spark, lakehouse, settings, continued), allowMissingColumns=True)
        .unionByName(
            _to_every_shard(spark, command_stream(spark, lakehouse, continued.commands), settings), allowMissingColumns=True
        )
    )
    processor = RuleProcessor(
        parse_duration(settings.cleanup_granularity),
        settings.state_slots,
        parse_duration(settings.allowed_lateness),
        continued.watermark_floor_ms,
        settings.shard_labels[0],
    )
    initial = None if initial_state is None else initial_state.groupBy("shard")
    return stream.groupBy("shard").transformWithStateInPandas(processor, OUTPUT_SCHEMA, "Append", "EventTime", initialState=initial)


def _ts(col: str) -> F.Column:
    return F.timestamp_millis(F.col(col))


StateTotals = Callable[[], tuple[int | None, int | None]]
# Told of each batch's alerts once they are committed: (batch id, its pipeline_metrics row's
# batch_end, one row per alert with ALERT_FIELDS). Only where foreachBatch runs in this process.
AlertsCommitted = Callable[[int, datetime, list[Row]], None]
ALERT_FIELDS = ("rule_id", "group_key", "transaction_id", "aggregate", "event_count", "ingest_ms", "event_ms")


def write_batch(
    out: DataFrame,
    batch_id: int,
    lakehouse: Lakehouse,
    recorder: Recorder,
    state_totals: StateTotals | None = None,
    alerts_topic: KafkaTopic | None = None,
    on_alerts: AlertsCommitted | None = None,
    window_metrics: str = "near",
    held_keysets: HeldKeysets | None = None,
) -> None:
    """Split one evaluator batch into the gold tables; every append is idempotent per batch id.

    ``window_metrics`` (GoldSettings'): which keys' window metrics are written (``kept_metric``);
    ``held_keysets``: where the keysets the evaluator holds rules for are kept for routing."""
    started = time.time()
    steps = Steps()
    out = out.persist()
    try:
        batch = batch_column("gold_batch_id", batch_id)
        columns = _batch_columns(type(out.sparkSession).__module__, window_metrics == "near", on_alerts is not None)
        with steps("evaluate"):  # the first job over ``out``: the evaluator's batch runs in it
            counts, summaries = _counts(out, columns.aggregates)
        # One time for the batch's alerts, taken once the evaluator has decided: the topic's records
        # and the table's rows are separate jobs and must carry the same.
        # In microseconds since the epoch: a datetime literal is TIMESTAMP_NTZ under Spark Connect when the
        # session's timestampType says so, and costs the client a round trip to ask.
        decision = F.timestamp_micros(F.lit(time.time_ns() // 1000))
        alerts = out.where("kind = 'alert'").select(
            *columns.alerts,
            decision.alias("decision_time"),
            (F.unix_millis(decision) - F.col("ingest_ms")).alias("latency_ms"),
            batch,
        )
        per_key = out.where(columns.kept_metrics).select(*columns.metrics, batch)
        late = out.where("kind = 'late'").select(*columns.late, batch)
        errors = out.where("kind = 'rule_error'").select(*columns.errors, batch)
        fired = counts.pop("fired")
        metrics = per_key
        if summaries:  # each rule's summary row rides in the per-key rows' append: a table of its own costs a commit a batch
            summary = out.sparkSession.createDataFrame(summaries, SUMMARY_SCHEMA).select("*", batch)
            metrics = per_key.unionByName(summary, allowMissingColumns=True)
        # A table this batch adds nothing to gets no commit (each costs a Delta state
        # reconstruction); the others are written at once, alerts not waiting behind the metrics.
        written: dict[str, int] = {}
        writes = []
        for frame, path, sink, rows in [
            (alerts, lakehouse.alerts, "alerts", counts["alerts"]),
            (metrics, lakehouse.window_metrics, "window_metrics", counts.pop("metrics") + len(summaries)),
            (late, lakehouse.late_events, "late_events", counts["late_events"]),
            (errors, lakehouse.rule_errors, "rule_errors", counts.pop("rule_errors")),
        ]:
            writes.append(steps.timed(sink, partial(append_once, frame, path, sink_name("gold", sink), batch_id, rows=rows)))
            written[lakehouse.name_of(path)] = rows
        if alerts_topic and counts["alerts"]:
            with steps("topic"):
                _alerts_to_topic(alerts, batch_id, alerts_topic)
        held = counts.pop("keysets")
        if held_keysets is not None and held is not None:  # read by the next batch's routing, so beside the appends
            writes.append(steps.timed("keysets", partial(held_keysets.record, out.sparkSession, held, batch_id)))
        together(writes)
        committed = time.time()
        rows_total, bytes_total = state_totals() if state_totals else (None, None)
        row = metrics_row(
            "gold", batch_id, started, committed,
            **counts,
            rows_out=counts["alerts"],
            rows_written=written,
            state_rows_total=rows_total,
            state_bytes_total=bytes_total,
            step_ms=steps.ms,
            **latency_columns([r.ingest_ms for r in fired if r.ingest_ms], [r.event_ms for r in fired], round(committed * 1000)),
        )  # fmt: skip
        if on_alerts:
            on_alerts(batch_id, row["batch_end"], fired)
        recorder.record_rows(out.sparkSession, batch_id, [row])
    finally:
        out.unpersist()


class HeldKeysets:
    """``gold/rule_keysets``: the keysets the evaluator held rules for after its newest batch that said.

    Written only when they change, which is when a rule change that adds or drops a keyset reaches the
    evaluator: one small overwrite, or an append while the table holds no row. A replayed batch finds
    what it wrote in the table and writes nothing again."""

    def __init__(self, lakehouse: Lakehouse) -> None:
        self.lakehouse = lakehouse
        self.known: list[str] | None = None  # read once per query, on its first batch that reports them

    def record(self, spark: SparkSession, held: list[str], batch_id: int) -> None:
        table = self.lakehouse.rule_keysets
        if self.known is None:
            # From the files its log names: a Delta read would first run a job over the log (~0.5 s,
            # the longest step beside the batch's appends), and a new lakehouse's table has no file at all.
            rows = tables.read_near(spark, table, schema.RULE_KEYSETS)
            self.known = sorted(r.keyset for r in rows.select("keyset").collect()) if rows is not None else []
        if held == self.known:
            return
        rows = [(keyset, keyset.split(","), batch_id) for keyset in held]
        # A table holding no row (a new lakehouse's first batch) gets an append, which writes the same: an
        # overwrite first has Delta rebuild the table's state to remove its files, a job (~0.5 s) that
        # ended last among a small batch's writes.
        mode = "overwrite" if self.known else "append"
        tables.save(spark.createDataFrame(rows, schema.RULE_KEYSETS).write.format("delta").mode(mode), table)
        self.known = list(held)


def _alerts_to_topic(alerts: DataFrame, batch_id: int, topic: KafkaTopic) -> None:
    # Before the Delta appends: downstream acts on the topic, so it waits for no commit. A crash
    # before the batch's commit replays it and publishes again (at least once, same alert_id).
    kafka_alerts.publish(alerts, topic)
    crash_point(sink_name("kafka", "alerts"), batch_id, "after")


def kept_metric() -> F.Column:
    """Whether a metric row goes to gold/window_metrics by default: always, unless its rule has an
    upper limit above zero (GREATER, GREATER_EQUAL) and the key's batch peak stayed below
    NEAR_LIMIT_SHARE of it or has no value. Compared in decimals from the stored column types, as
    rule_effectiveness compares them, so every key that view calls near has its rows; a key that
    alerted is above its limit."""
    limit = F.col("limit_value").cast(schema.WINDOW_METRICS["limit"].dataType)
    upper = F.col("operator").isin("GREATER", "GREATER_EQUAL") & (limit > 0)
    return ~upper | (F.col("max_aggregate").cast(schema.AGGREGATE) >= limit * F.lit(Decimal(str(NEAR_LIMIT_SHARE))))


# A rule's summary row in gold/window_metrics, as _counts finds it.
SUMMARY_SCHEMA = "rule_id int, rule_version long, keys_evaluated long, keys_sketch binary"
_SUMS = ("alerts", "metrics", "late_events", "rule_errors", "rows_in", "keys_touched", "state_rows_written", "state_bytes_written")


@dataclass(frozen=True)
class _BatchColumns:
    """``write_batch``'s columns that depend on no batch: ``_counts``' aggregates and each table's columns
    but the batch's own (its id, the alerts' decision time)."""

    aggregates: tuple[F.Column, ...]
    alerts: tuple[F.Column | str, ...]
    kept_metrics: F.Column  # the window metric rows written
    metrics: tuple[F.Column | str, ...]
    late: tuple[F.Column | str, ...]
    errors: tuple[F.Column | str, ...]


@cache
def _batch_columns(session_kind: str, near_only: bool, details: bool) -> _BatchColumns:
    """Built once per session kind (a classic session's columns are JVM objects that a Spark Connect plan
    cannot carry) and setting, as silver's parse is: ~750 calls into the JVM a batch otherwise."""
    kept = kept_metric() if near_only else F.lit(True)
    alerts = [
        F.sha2(F.concat_ws("\x1f", "rule_id", "group_key", "transaction_id"), 256).substr(1, 32).alias("alert_id"),
        "rule_id",
        "rule_version",
        F.col("detail").alias("rule_description"),
        "group_key",
        F.map_from_arrays(F.split("keyset", ","), "key_values").alias("key_parts"),
        "transaction_id",
        _ts("event_ms").alias("event_time"),
        _ts("ingest_ms").alias("ingest_time"),
        "aggregator",
        F.col("aggregate_value").cast(schema.AGGREGATE).alias("aggregate_value"),
        F.col("limit_value").cast("decimal(38,10)").alias("limit"),
        "operator",
        _ts("window_start_ms").alias("window_start"),
        _ts("window_end_ms").alias("window_end"),
        "event_count",
        "distinct_values",
    ]
    metrics = [
        "rule_id",
        "rule_version",
        "group_key",
        _ts("event_ms").alias("event_time"),
        F.col("aggregate_value").cast(schema.AGGREGATE).alias("aggregate_value"),
        F.col("max_aggregate").cast(schema.AGGREGATE).alias("max_aggregate"),
        F.col("limit_value").cast("decimal(38,10)").alias("limit"),
        "operator",
        "event_count",
        _ts("window_start_ms").alias("window_start"),
        _ts("window_end_ms").alias("window_end"),
    ]
    late = ["transaction_id", "keyset", "group_key", _ts("event_ms").alias("event_time"), F.col("detail").alias("reason")]
    errors = ["rule_id", F.col("rule_version").alias("commit_version"), F.col("aggregator").alias("field"), F.col("detail").alias("reason")]
    kept_metrics = (F.col("kind") == "metric") & kept
    return _BatchColumns(tuple(_aggregates(kept, details)), tuple(alerts), kept_metrics, tuple(metrics), tuple(late), tuple(errors))


def _aggregates(kept: F.Column, details: bool) -> list[F.Column]:
    """``_counts``' aggregates per rule (``kept``: the window metrics written; with ``details``, each alert's ALERT_FIELDS)."""
    kind = F.col("kind")
    metric = kind == "metric"
    aggregate = F.col("aggregate_value").cast(schema.AGGREGATE).cast("string").alias("aggregate")
    fired = F.struct(*ALERT_FIELDS[:3], aggregate, *ALERT_FIELDS[4:]) if details else F.struct("ingest_ms", "event_ms")
    return [
        F.count(F.when(kind == "alert", 1)).alias("alerts"),
        F.collect_list(F.when(kind == "alert", fired)).alias("fired"),
        F.count(F.when(metric & kept, 1)).alias("metrics"),
        F.count(F.when(metric, 1)).alias("keys_evaluated"),
        F.hll_sketch_agg(F.when(metric, F.col("group_key")), HLL_LG_CONFIG_K).alias("keys_sketch"),
        F.count(F.when(kind == "late", 1)).alias("late_events"),
        F.count(F.when(kind == "rule_error", 1)).alias("rule_errors"),
        _total(F.when(kind == "stats", F.col("event_count"))).alias("rows_in"),
        _total("keys_touched").alias("keys_touched"),
        _total("state_rows").alias("state_rows_written"),
        _total("state_bytes").alias("state_bytes_written"),
        F.max("active_rules").alias("active_rules"),
        F.max(F.when(kind == "stats", F.col("rule_version"))).alias("rules_version"),
        F.max(F.when(kind == "stats", F.col("key_values"))).alias("keysets"),
    ]


def _counts(out: DataFrame, aggregates: tuple[F.Column, ...]) -> tuple[dict[str, Any], list[tuple]]:
    """Row counts per output table, the batch's evaluator statistics and the alerts' times (or their
    ALERT_FIELDS), and each rule's summary row (rule, version, keys evaluated, their sketch), in one pass
    grouped by rule (``aggregates``: ``_aggregates``').

    The evaluator sees all of a shard's rows at once, so a key is one metric row per rule in a batch."""
    groups = out.groupBy("rule_id", "rule_version").agg(*aggregates).collect()
    counts: dict[str, Any] = {name: sum(g[name] for g in groups) for name in _SUMS}
    counts["fired"] = [alert for g in groups for alert in g.fired]
    for name in ("active_rules", "rules_version", "keysets"):
        counts[name] = max((g[name] for g in groups if g[name] is not None), default=None)
    summaries = [(g.rule_id, g.rule_version, g.keys_evaluated, g.keys_sketch) for g in groups if g.keys_evaluated]
    return counts, summaries


def _total(col: str | F.Column) -> F.Column:
    return F.coalesce(F.sum(col), F.lit(0)).cast("long")


def _state_totals_of(holder: dict) -> StateTotals:
    """State size as of the query's last finished batch (the running batch has not reported yet).

    Only a classic session can see its query from inside ``foreachBatch``; elsewhere: unknown."""

    def totals() -> tuple[int | None, int | None]:
        progress = holder["query"].lastProgress if "query" in holder else None
        if not progress:
            return None, None
        operators = progress.get("stateOperators") or []
        return sum(op.get("numRowsTotal", 0) for op in operators), sum(op.get("memoryUsedBytes", 0) for op in operators)

    return totals


def ensure_gold_tables(spark: SparkSession, lakehouse: Lakehouse) -> None:
    """Gold's tables and the rules' (created together: each is mostly the driver waiting on its log)."""
    with first_commit.settings_read_once(spark):
        together([
            partial(ensure_rules_table, spark, lakehouse),
            partial(ensure_commands_table, spark, lakehouse),
            partial(tables.ensure_table, spark, lakehouse.alerts, schema.ALERTS, "One row per rule firing on an event"),
            partial(
                tables.ensure_table, spark, lakehouse.window_metrics, schema.WINDOW_METRICS,
                "Window aggregate per rule and key near its limit (or every key touched), and per rule the keys evaluated, per micro-batch",
                stats_columns=["rule_id", "group_key", "event_time", "gold_batch_id"],
            ),
            partial(tables.ensure_table, spark, lakehouse.late_events, schema.LATE_EVENTS, "Events beyond the allowed lateness: recorded, not evaluated"),
            partial(tables.ensure_table, spark, lakehouse.rule_errors, schema.RULE_ERRORS, "Rule rows that failed validation; never executed"),
            partial(tables.ensure_table, spark, lakehouse.rule_keysets, schema.RULE_KEYSETS,
                    "Grouping-field sets gold's evaluator holds rules for; events are routed to them until a rule change reaches it"),
            partial(ensure_metrics_table, spark, lakehouse),
        ])  # fmt: skip


def query_confs(spark: SparkSession, settings: GoldSettings) -> ContextManager[None]:
    """The session settings the evaluator's query starts with: a batch without input (which only
    fires cleanup timers) runs only if ``settings`` asks for it."""
    return session_confs(spark, {NO_DATA_BATCHES: str(settings.no_data_batches).lower()})


def start_gold(
    spark: SparkSession,
    lakehouse: Lakehouse,
    settings: GoldSettings = GoldSettings(),
    available_now: bool = True,
    processing_time: str | None = None,
    recorder: Recorder | None = None,
    on_alerts: AlertsCommitted | None = None,
    initial_state: DataFrame | None = None,
    source: KafkaSource | None = None,
) -> StreamingQuery:
    """The evaluator's query; its metrics rows are written at once unless ``recorder`` says otherwise.

    ``on_alerts`` is called in this process, so only for a classic session (Spark Connect runs
    ``foreachBatch`` in the server's own Python process). ``initial_state``: a rescale's (layers/rescale.py).
    ``source``: the Kafka source gold reads itself, de-duplicating as silver does (``_first_lines``),
    instead of reading silver: an alert then waits for one query's batch, not two."""
    ensure_gold_tables(spark, lakehouse)
    recorder = recorder or Recorder(lakehouse, "gold")
    checkpoint = lakehouse.checkpoint("gold")
    # New checkpoints spread their shards over the partitions the query starts with; a resumed one
    # keeps its record's (Spark keeps the checkpoint's partition count, and its state the labels).
    partitions = int(spark.conf.get(SHUFFLE_PARTITIONS) or 0)
    spread = check_gold_layout(checkpoint, settings.layout, partitions, rescaling=initial_state is not None, source=gold_reads(source))
    settings = replace(settings, shard_partitions=spread)
    holder: dict = {}
    totals = _state_totals_of(holder)
    write = partial(write_batch, lakehouse=lakehouse, recorder=recorder, state_totals=totals, alerts_topic=settings.alerts_topic,
                    on_alerts=on_alerts, window_metrics=settings.window_metrics, held_keysets=HeldKeysets(lakehouse))  # fmt: skip
    writer = (
        evaluated(spark, lakehouse, settings, Continued.of(spark, lakehouse), initial_state, source)
        .writeStream.queryName("rulewatch_gold")
        .option("checkpointLocation", checkpoint)
        .foreachBatch(per_run(shifted(write, batch_base(checkpoint))))
    )
    writer = writer.trigger(availableNow=True) if available_now else writer.trigger(processingTime=processing_time or "1 second")
    with query_confs(spark, settings):
        holder["query"] = writer.start()
    return holder["query"]
