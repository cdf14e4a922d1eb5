"""Silver: typed, validated, de-duplicated transactions; everything else quarantined with a reason.

Nothing disappears: every bronze row ends in exactly one of ``silver/transactions``,
``silver/quarantine`` (with the reasons it failed) or ``silver/duplicates`` (a transaction id
already accepted, in this batch or an earlier one, with an event time within the dedup horizon;
the first occurrence wins).
"""

from __future__ import annotations

import os
import time
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from rulewatch import schema
from rulewatch.lakehouse import Lakehouse
from rulewatch.metrics import ensure_metrics_table, record
from rulewatch.rules import parse_duration
from rulewatch.sinks import append_once, batch_column, ensure_table

MAX_AMOUNT = 10**12
# An event time this far past its own ingest time is a broken clock or a typo, not a real event: it
# would drag the watermark into the future and make every later event "late".
FUTURE_TOLERANCE_HOURS = 24
# The payment types silver accepts (the brief's cash and card). Data, not code: the environment
# variable replaces the list ("CSH,CRD,WIRE") without a release; docs/reliability.md lists both.
PAYMENT_TYPES_ENV = "RULEWATCH_PAYMENT_TYPES"
DEFAULT_PAYMENT_TYPES = "CSH,CRD"
TEXT_FIELDS = [f for f in schema.FIELD_COLUMNS if f != "paymentAmount"]
# A transaction id accepted before counts as a duplicate when the two event times lie within this
# duration (a redelivery has the same event time). Bounding it keeps the check on recent silver
# files instead of the whole table; set e.g. "30d" to look further back, at that scan's cost.
DEDUP_HORIZON_ENV = "RULEWATCH_DEDUP_HORIZON"
DEFAULT_DEDUP_HORIZON = "1d"


def payment_types() -> list[str]:
    """The allowed ``paymentType`` values, sorted."""
    return sorted({t.strip() for t in os.environ.get(PAYMENT_TYPES_ENV, DEFAULT_PAYMENT_TYPES).split(",") if t.strip()})


def _text(name: str) -> Column:
    return F.col(f"j.{name}")


def _json_type(name: str) -> Column:
    # from_json hands an object or array back as its JSON text; the variant parse (``v``) tells them apart.
    return F.split(F.expr(f"schema_of_variant(v:{name})"), "<")[0]


def _wrong_types() -> list[tuple[Column, Column]]:
    """Text fields given as an object, array or boolean (numbers are fine as ids: 123 is "123")."""
    return [
        (_json_type(f).isin("OBJECT", "ARRAY", "BOOLEAN"), F.concat(F.lit(f"{f} must be text, got "), F.lower(_json_type(f))))
        for f in TEXT_FIELDS
    ]


def parse(bronze: DataFrame) -> DataFrame:
    """Bronze rows -> typed columns plus ``reasons``: an array of every check the row failed."""
    allowed_types = payment_types()
    parsed = bronze.withColumn(
        "j",
        F.from_json(
            "value", schema.RAW_SCHEMA, {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": "_corrupt_record"}
        ),
    ).withColumn("v", F.expr("try_parse_json(value)"))
    event_time_text = _text("eventTime")
    amount_text = _text("paymentAmount")
    amount_exact = F.expr("try_cast(j.paymentAmount AS decimal(38, 10))")
    amount = F.expr("try_cast(j.paymentAmount AS decimal(18, 2))")
    event_time = F.when(
        event_time_text.rlike(r"^-?[0-9]{1,15}$"), F.timestamp_millis(event_time_text.cast("long"))
    ).otherwise(F.expr("try_cast(j.eventTime AS timestamp)"))
    blank = F.trim(F.col("value")) == ""
    malformed = F.col("j").isNull() | _text("_corrupt_record").isNotNull()
    checks: list[tuple[Column, Column]] = [
        (blank, F.lit("blank line")),
        (~blank & malformed, F.lit("malformed JSON (not a JSON object on one line)")),
        (F.coalesce(F.trim(_text("transactionId")), F.lit("")) == "", F.lit("missing transactionId")),
        (event_time_text.isNull(), F.lit("missing eventTime")),
        (
            event_time_text.isNotNull() & event_time.isNull(),
            F.concat(F.lit("unparsable eventTime '"), event_time_text, F.lit("' (expected epoch ms or ISO-8601)")),
        ),
        (
            amount_text.isNotNull() & amount_exact.isNull(),
            F.concat(F.lit("paymentAmount is not a number: '"), amount_text, F.lit("'")),
        ),
        (amount_exact < 0, F.concat(F.lit("negative paymentAmount "), amount_text)),
        (amount_exact > MAX_AMOUNT, F.concat(F.lit(f"paymentAmount above {MAX_AMOUNT:,}: "), amount_text)),
        (
            (amount_exact <= MAX_AMOUNT) & (amount_exact != amount),
            F.concat(F.lit("paymentAmount has more than 2 decimal places: "), amount_text),
        ),
        (
            event_time > F.col("ingest_time") + F.expr(f"INTERVAL {FUTURE_TOLERANCE_HOURS} HOURS"),
            F.concat(F.lit("eventTime '"), event_time_text, F.lit(f"' is more than {FUTURE_TOLERANCE_HOURS}h after its ingest time")),
        ),
        (
            _text("paymentType").isNotNull() & ~_text("paymentType").isin(*allowed_types),
            F.concat(F.lit("unknown paymentType '"), _text("paymentType"), F.lit(f"' (allowed: {', '.join(allowed_types)})")),
        ),
        *_wrong_types(),
    ]
    reasons = F.filter(F.array(*[F.when(cond, msg) for cond, msg in checks]), lambda r: r.isNotNull())
    typed = [
        F.trim(_text("transactionId")).alias("transaction_id"),
        event_time.alias("event_time"),
        amount.alias("payment_amount"),
        *[_text(f).alias(c) for f, c in schema.FIELD_COLUMNS.items() if c not in ("transaction_id", "payment_amount")],
    ]
    # A malformed line fails every check that reads a field; report only the cause.
    reasons = F.when(blank | malformed, F.slice(reasons, 1, 1)).otherwise(reasons)
    return parsed.select("value", "source_file", "ingest_time", "ingest_seq", *typed, reasons.alias("reasons"))


def dedup_horizon_ms() -> int:
    """How far apart two event times of one transaction id may be and still count as a duplicate."""
    return parse_duration(os.environ.get(DEDUP_HORIZON_ENV, DEFAULT_DEDUP_HORIZON))


def _earlier_times(
    spark: SparkSession, lakehouse: Lakehouse, batch_id: int, event_range: tuple[Any, Any], horizon_ms: int
) -> DataFrame:
    """Per transaction id, the event times (ms) silver accepted it with in earlier batches near this batch's.

    Earlier batches only: a replay of this batch must classify its rows exactly as before. The
    event-time bound lets Delta skip files by their min/max statistics, so the check reads the
    recent part of silver instead of all of it. (Built from the silver table alone; joining back a
    frame derived from the batch is a self-join Spark may resolve ambiguously.)
    """
    horizon = F.expr(f"INTERVAL {horizon_ms} MILLISECONDS")
    low, high = event_range
    return (
        spark.read.format("delta")
        .load(lakehouse.silver_transactions)
        .where(F.col("silver_batch_id") < batch_id)
        .where(F.col("event_time").between(F.lit(low) - horizon, F.lit(high) + horizon))
        .groupBy("transaction_id")
        .agg(F.collect_list(F.unix_millis("event_time")).alias("_seen_ms"))
    )


def write_classified(lines: DataFrame, batch_id: int, lakehouse: Lakehouse, layer: str = "silver") -> dict[str, int]:
    """Numbered bronze lines -> silver / quarantine / duplicates as batch ``batch_id`` of query ``layer``.

    Returns the batch's counts for ``pipeline_metrics``. A table this batch adds nothing to gets no
    commit (each costs a Delta state reconstruction); a replay classifies identically, so it skips
    the same ones.
    """
    spark = lines.sparkSession
    horizon_ms = dedup_horizon_ms()
    valid = F.size("reasons") == 0
    rows = parse(lines).withColumn("_valid", valid).persist()
    try:
        low, high = rows.where("_valid").agg(F.min("event_time"), F.max("event_time")).first()
        first = Window.partitionBy("_valid", "transaction_id").orderBy("ingest_time", "source_file", "ingest_seq")
        ranked = rows.withColumn("_rank", F.row_number().over(first))
        if low is not None:
            earlier = _earlier_times(spark, lakehouse, batch_id, (low, high), horizon_ms)
            ranked = ranked.join(earlier, "transaction_id", "left")
        else:
            ranked = ranked.withColumn("_seen_ms", F.lit(None).cast("array<long>"))
        event_ms = F.unix_millis("event_time")
        seen = F.coalesce(F.exists("_seen_ms", lambda t: F.abs(t - event_ms) <= horizon_ms), F.lit(False))
        classified = ranked.withColumn(
            "_class",
            F.when(~F.col("_valid"), "quarantined")
            .when((F.col("_rank") > 1) | seen, "duplicates")
            .otherwise("accepted"),
        ).persist()
        counts = {r["_class"]: r["count"] for r in classified.groupBy("_class").count().collect()}
        batch = batch_column("silver_batch_id", batch_id)
        tables = [
            ("accepted", lakehouse.silver_transactions, "transactions",
             [*[c for c in schema.SILVER.fieldNames() if c != "silver_batch_id"], batch]),
            ("quarantined", lakehouse.silver_quarantine, "quarantine",
             ["value", F.concat_ws("; ", "reasons").alias("reason"), "source_file", "ingest_time", batch]),
            ("duplicates", lakehouse.silver_duplicates, "duplicates",
             ["transaction_id", "value", "source_file", "ingest_time", batch]),
        ]  # fmt: skip
        for name, path, sink, columns in tables:
            rows_of = classified.where(F.col("_class") == name).select(*columns)
            append_once(rows_of, path, f"rulewatch.{layer}.{sink}", batch_id, rows=counts.get(name, 0))
        classified.unpersist()
    finally:
        rows.unpersist()
    accepted, quarantined, duplicates = (counts.get(k, 0) for k in ("accepted", "quarantined", "duplicates"))
    return {
        "rows_in": accepted + quarantined + duplicates,
        "rows_out": accepted,
        "quarantined": quarantined,
        "duplicates": duplicates,
    }


def process_batch(batch: DataFrame, batch_id: int, lakehouse: Lakehouse) -> None:
    """One bronze micro-batch -> silver / quarantine / duplicates, each write idempotent."""
    started = time.time()
    counts = write_classified(batch, batch_id, lakehouse)
    record(batch.sparkSession, lakehouse, "silver", batch_id, started, **counts)


def ensure_silver_tables(spark: SparkSession, lakehouse: Lakehouse) -> None:
    ensure_metrics_table(spark, lakehouse)
    ensure_table(spark, lakehouse.silver_transactions, schema.SILVER, "Typed, validated, de-duplicated transactions")
    ensure_table(spark, lakehouse.silver_quarantine, schema.QUARANTINE, "Bronze lines that failed validation, with reasons")
    ensure_table(spark, lakehouse.silver_duplicates, schema.DUPLICATES, "Repeated transaction ids (first occurrence wins)")


def start_silver(
    spark: SparkSession, lakehouse: Lakehouse, available_now: bool = True, processing_time: str | None = None
) -> StreamingQuery:
    ensure_silver_tables(spark, lakehouse)
    writer = (
        spark.readStream.format("delta")
        .load(lakehouse.bronze_transactions)
        .writeStream.queryName("rulewatch_silver")
        .option("checkpointLocation", lakehouse.checkpoint("silver"))
        .foreachBatch(lambda df, batch_id: process_batch(df, batch_id, lakehouse))
    )
    writer = writer.trigger(availableNow=True) if available_now else writer.trigger(processingTime=processing_time or "1 second")
    return writer.start()
