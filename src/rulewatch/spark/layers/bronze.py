"""Bronze: every landed line (or Kafka record), untouched, plus where and when it came in."""

from __future__ import annotations

import time

from pyspark.sql import DataFrame, Observation, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from rulewatch.kafka.health import check_topic
from rulewatch.kafka.source import KafkaSource, read_kafka
from rulewatch.spark.storage import tables
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.layers.landing import check_landing, check_recorded_source, read_once
from rulewatch.spark.storage.metrics import Recorder, Steps, ensure_metrics_table
from rulewatch.spark.storage.schema import BRONZE
from rulewatch.spark.runtime.env import is_databricks
from rulewatch.spark.storage.sinks import append_once, per_run, sink_name


def read_landing(spark: SparkSession, landing: str, max_files_per_trigger: int | None = None) -> DataFrame:
    """Stream the landing folder line by line (Auto Loader on Databricks, the file source locally).

    Lines are read as text, not JSON, so a malformed line still reaches bronze and can be
    quarantined with a reason in silver instead of vanishing in a JSON reader. Subfolders are read
    too (``2026/11/23/x.jsonl``), without inferring partitions from folder names, so no layout of
    the landing folder can fail the read; names starting with ``.`` or ``_`` are skipped
    (landing.py: files still being written, by the landing contract).
    """
    if is_databricks():
        # Auto Loader lists subfolders itself and tracks files in its own state.
        reader = spark.readStream.format("cloudFiles").option("cloudFiles.format", "text")
    else:
        # maxFileAge: the file source otherwise skips, silently, a file whose modification time is a
        # week older than the newest file it has seen (a backfill copied with its old times).
        reader = spark.readStream.format("text").option("recursiveFileLookup", "true").option("maxFileAge", "36500d")
        # Hadoop's checksummed local file system opens ".<name>.crc" beside each file, and a name
        # with a colon (export_2026-12-04T13:33:00.jsonl) makes that an invalid URI: the batch fails
        # on every restart. The raw local file system has no checksum files; a reader option reaches
        # only this read, and an uncached instance, since the cache would hand back the checksummed one.
        reader = reader.option("fs.file.impl", "org.apache.hadoop.fs.RawLocalFileSystem").option("fs.file.impl.disable.cache", "true")
        # Hadoop decompresses by name (.gz, .bz2, ...): a file named .gz that is not gzip failed
        # the whole batch on every restart. Such a file is skipped here instead, and the landing
        # audit names it (landing.py: a compressed file is checked whole once).
        reader = reader.option("ignoreCorruptFiles", "true")
    if max_files_per_trigger:
        reader = reader.option("maxFilesPerTrigger", max_files_per_trigger)
    # The text source does not check UTF-8: invalid bytes would reach Parquet (which no reader then
    # opens) or decode to U+FFFD and merge different keys. Keep the text valid and the bytes exact.
    utf8 = F.expr("is_valid_utf8(value)")
    return reader.load(landing).select(
        F.when(utf8, F.col("value")).otherwise(F.expr("make_valid_utf8(value)")).alias("value"),
        F.col("_metadata.file_path").alias("source_file"),
        F.current_timestamp().alias("ingest_time"),
        F.when(~utf8, F.col("value").cast("binary")).alias("value_bytes"),
        F.col("_metadata.file_size").alias("source_file_size"),
        F.col("_metadata.file_modification_time").alias("source_file_mtime"),
    )


# A landing folder (path) or a Kafka topic.
Source = str | KafkaSource


def read_source(spark: SparkSession, source: Source) -> DataFrame:
    return read_kafka(spark, source) if isinstance(source, KafkaSource) else read_landing(spark, source)


def landed(batch: DataFrame, source: Source, checkpoint: str) -> DataFrame:
    """A micro-batch's lines as bronze takes them: none read through a symbolic link or under a
    file's second name (landing.py; ``checkpoint``: the reading query's)."""
    if isinstance(source, KafkaSource) or "://" in source:
        return batch
    return read_once(batch, source, checkpoint)


def check_source(lakehouse: Lakehouse, source: Source) -> None:
    """Refuse a source this lakehouse cannot ingest (landing.py says which and why)."""
    if isinstance(source, KafkaSource):
        check_topic(source.topic)  # before the lakehouse records it: a mistyped topic must not bind it
        check_recorded_source(lakehouse, source.identity)
    else:
        check_landing(lakehouse, source)


def numbered(batch: DataFrame) -> DataFrame:
    """Number the lines of a landing micro-batch (``ingest_seq``); Kafka records keep their offset.

    Numbered in batch context (streams cannot), so "first occurrence wins" follows the order of
    lines within a file.
    """
    if "ingest_seq" in batch.columns:
        return batch
    return batch.withColumn("ingest_seq", F.monotonically_increasing_id())


def append(lines: DataFrame, lakehouse: Lakehouse, batch_id: int, layer: str = "bronze") -> bool:
    """Append numbered lines to ``bronze/transactions`` as batch ``batch_id`` of query ``layer``;
    False if an earlier run already did."""
    return append_once(lines, lakehouse.bronze_transactions, sink_name(layer, "transactions"), batch_id)


def landed_counts(lakehouse: Lakehouse, lines: int) -> dict:
    """The bronze ``pipeline_metrics`` values of a batch of ``lines`` landed lines."""
    return {"rows_in": lines, "rows_out": lines, "rows_written": {lakehouse.name_of(lakehouse.bronze_transactions): lines}}


def ensure_bronze_table(spark: SparkSession, lakehouse: Lakehouse) -> None:
    # Statistics only for what reads filter on; the lines themselves are long text (tables.ensure_table).
    tables.ensure_table(
        spark, lakehouse.bronze_transactions, BRONZE, "Landed lines, untouched, with ingestion metadata",
        stats_columns=["ingest_time", "source_file", "kafka_partition", "kafka_offset"],
    )  # fmt: skip


def write_batch(batch: DataFrame, batch_id: int, lakehouse: Lakehouse, recorder: Recorder, source: Source) -> None:
    started = time.time()
    steps = Steps()
    with steps("landing"):
        batch = landed(batch, source, lakehouse.checkpoint("bronze"))
    # The append counts the lines as it writes them: a count of its own read the whole batch once
    # more, through a cache (1M lines: ~1.5 s of bronze's ~5 s, docs/journal/benchmarks.md).
    counted = Observation()
    with steps("append"):
        appended = append(numbered(batch).observe(counted, F.count(F.lit(1)).alias("lines")), lakehouse, batch_id)
    # None after a replay of a batch whose append committed, and under Spark Connect when the server
    # answered before the observation completed (it then sends no values: 4.2's ExecuteThreadRunner
    # does not wait for them). The count is only needed for the metrics row: read the batch again.
    count = counted.get.get("lines") if appended else None
    if count is None:
        count = batch.count()
    recorder.record(batch.sparkSession, batch_id, started, step_ms=steps.ms, **landed_counts(lakehouse, count))


def start_bronze(
    spark: SparkSession,
    source: Source,
    lakehouse: Lakehouse,
    available_now: bool = True,
    processing_time: str | None = None,
    recorder: Recorder | None = None,
) -> StreamingQuery:
    """Append landed lines (or Kafka records) to ``bronze/transactions``, idempotently per micro-batch;
    each batch's metrics row is committed at once unless ``recorder`` gathers them."""
    ensure_metrics_table(spark, lakehouse)
    recorder = recorder or Recorder(lakehouse, "bronze")
    writer = (
        read_source(spark, source)
        .writeStream.queryName("rulewatch_bronze")
        .option("checkpointLocation", lakehouse.checkpoint("bronze"))
        .foreachBatch(per_run(lambda df, batch_id: write_batch(df, batch_id, lakehouse, recorder, source)))
    )
    writer = writer.trigger(availableNow=True) if available_now else writer.trigger(processingTime=processing_time or "1 second")
    return writer.start()
