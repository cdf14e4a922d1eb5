"""Gold's alerts on a Kafka topic, for systems downstream (card blocking, case management).

Delivery is at least once: the topic is written after ``gold/alerts`` commits, in the same
micro-batch, so a crash between the two replays the batch and publishes its alerts again (the
Delta append is skipped by its transaction id, so the table still holds each alert once).
What is published is the batch's rows read back from ``gold/alerts``, not the batch's frame: the
frame's ``decision_time`` (and so ``latency_ms``) is taken anew each time it is evaluated, the
committed rows are not, so every publish of a batch, replays included, sends the table's records.
Consumers deduplicate on ``alert_id``, which is the same on every replay.

Record key: ``<rule_id>:<group_key>`` (one key's alerts stay in order on one partition); value:
the ``gold/alerts`` row as JSON, timestamps ISO 8601 in UTC with microseconds (as stored).
"""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from rulewatch.kafka.client import KafkaTopic, spark_options
from rulewatch.spark.storage import tables

# Spark's JSON default keeps milliseconds; decision_time has microseconds, and the record must equal the row.
TIMESTAMP_FORMAT = "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX"


def records(alerts: DataFrame) -> DataFrame:
    """Alert rows as Kafka ``key`` / ``value`` strings."""
    return alerts.select(
        F.concat_ws(":", F.col("rule_id").cast("string"), "group_key").alias("key"),
        F.to_json(F.struct(*alerts.columns), {"timestampFormat": TIMESTAMP_FORMAT}).alias("value"),
    )


def committed(spark: SparkSession, alerts_table: str, batch_id: int) -> DataFrame:
    """The rows gold batch ``batch_id`` committed to the alerts table at ``alerts_table``."""
    return tables.read(spark, alerts_table).where(F.col("gold_batch_id") == batch_id)


def publish(alerts: DataFrame, topic: KafkaTopic) -> None:
    """Write the alert rows to ``topic`` (a batch write: the producer flushes before this returns)."""
    records(alerts).write.format("kafka").options(**spark_options(topic)).option("topic", topic.topic).save()
