"""A Kafka topic as the transaction source: each record one transaction, into bronze like a landed line.

Bronze keeps the record's value untouched plus where it came from (topic, partition, offset, key,
Kafka timestamp). ``source_file`` reads ``kafka:<topic>/<partition>`` and ``ingest_seq`` is the
offset, so silver's "first occurrence wins" follows the order of each partition.

Nothing is skipped silently: the offsets live in the query's checkpoint, and ``failOnDataLoss``
stays on, so records deleted by retention before they were read stop the query with Spark's
message instead of vanishing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from rulewatch.kafka.client import KafkaConfigError, KafkaTopic, spark_options


@dataclass(frozen=True)
class KafkaSource:
    """Where transactions are read from, and how much a micro-batch takes."""

    topic: KafkaTopic
    starting_offsets: str = "earliest"  # where a new checkpoint starts; afterwards the checkpoint decides
    max_offsets_per_trigger: int | None = None  # None: everything available per micro-batch

    def __post_init__(self) -> None:
        if self.starting_offsets not in ("earliest", "latest") and not self.starting_offsets.startswith("{"):
            raise KafkaConfigError(
                f"starting offsets {self.starting_offsets!r}: use earliest, latest or Spark's JSON per partition"
            )
        if self.max_offsets_per_trigger is not None and self.max_offsets_per_trigger < 1:
            raise KafkaConfigError(f"max offsets per trigger must be at least 1, got {self.max_offsets_per_trigger}")

    def pinned(self) -> "KafkaSource":
        """The same source starting at each partition's end offset now, instead of Spark's ``latest``,
        which each query resolves when it starts: two queries then begin at one place."""
        from rulewatch.kafka.consume import end_offsets

        ends = end_offsets(self.topic)
        return replace(self, starting_offsets=json.dumps({self.topic.topic: {str(p): end for p, end in sorted(ends.items())}}))

    @property
    def identity(self) -> str:
        """What the lakehouse records as its source: the topic (brokers may move, the offsets do not)."""
        return f"kafka:{self.topic.topic}"


def read_kafka(spark: SparkSession, source: KafkaSource) -> DataFrame:
    """Stream the topic as bronze rows (the landing reader's columns plus the record's coordinates)."""
    reader = (
        spark.readStream.format("kafka")
        .options(**spark_options(source.topic))
        .option("subscribe", source.topic.topic)
        .option("startingOffsets", source.starting_offsets)
        .option("failOnDataLoss", "true")
        .option("includeHeaders", "false")
    )
    if source.max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", source.max_offsets_per_trigger)
    text = F.col("value").cast("string")
    utf8 = F.coalesce(F.expr("is_valid_utf8(CAST(value AS STRING))"), F.lit(True))
    return reader.load().select(
        F.when(utf8, text).otherwise(F.expr("make_valid_utf8(CAST(value AS STRING))")).alias("value"),
        F.format_string("kafka:%s/%d", "topic", "partition").alias("source_file"),
        F.current_timestamp().alias("ingest_time"),
        F.when(~utf8, F.col("value")).alias("value_bytes"),
        F.col("offset").alias("ingest_seq"),
        F.col("topic").alias("kafka_topic"),
        F.col("partition").alias("kafka_partition"),
        F.col("offset").alias("kafka_offset"),
        F.col("key").alias("kafka_key"),
        F.col("timestamp").alias("kafka_timestamp"),
    )
