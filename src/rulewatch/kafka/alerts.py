"""Gold's alerts on a Kafka topic, for systems downstream (card blocking, case management).

Delivery is at least once: the topic is written after ``gold/alerts`` commits, in the same
micro-batch, so a crash between the two replays the batch and publishes its alerts again (the
Delta append is skipped by its transaction id, so the table still holds each alert once).
Consumers deduplicate on ``alert_id``, which is the same on every replay.

Record key: ``<rule_id>:<group_key>`` (one key's alerts stay in order on one partition); value:
the ``gold/alerts`` row as JSON.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from rulewatch.kafka.client import KafkaTopic, spark_options


def records(alerts: DataFrame) -> DataFrame:
    """Alert rows as Kafka ``key`` / ``value`` strings."""
    return alerts.select(
        F.concat_ws(":", F.col("rule_id").cast("string"), "group_key").alias("key"),
        F.to_json(F.struct(*alerts.columns)).alias("value"),
    )


def publish(alerts: DataFrame, topic: KafkaTopic) -> None:
    """Write the alert rows to ``topic`` (a batch write: the producer flushes before this returns)."""
    records(alerts).write.format("kafka").options(**spark_options(topic)).option("topic", topic.topic).save()
