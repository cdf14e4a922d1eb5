"""Gold's alerts on a Kafka topic, for systems downstream (card blocking, case management).

Delivery is at least once, and first: a gold batch publishes its alerts as soon as the evaluator
has decided them, before its Delta appends, so a consumer waits for no commit. A crash before the
batch's commit replays it: the evaluator decides the same alerts again (same ``alert_id``) and
publishes them again with the replay's ``decision_time``. Every ``gold/alerts`` row is on the topic
exactly as it is (the attempt that committed it published it first, with the same decision time);
a repeat differs from it only in ``decision_time`` and ``latency_ms``. Consumers deduplicate on
``alert_id``. A consumer may see an alert a few seconds before ``gold/alerts`` holds it.

Record key: ``<rule_id>:<group_key>`` (one key's alerts stay in order on one partition); value:
the ``gold/alerts`` row as JSON, timestamps ISO 8601 in UTC with microseconds (as stored).
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from rulewatch.kafka.client import KafkaTopic, spark_options

# Spark's JSON default keeps milliseconds; decision_time has microseconds, and the record must equal the row.
TIMESTAMP_FORMAT = "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX"


def records(alerts: DataFrame) -> DataFrame:
    """Alert rows as Kafka ``key`` / ``value`` strings."""
    return alerts.select(
        F.concat_ws(":", F.col("rule_id").cast("string"), "group_key").alias("key"),
        F.to_json(F.struct(*alerts.columns), {"timestampFormat": TIMESTAMP_FORMAT}).alias("value"),
    )


def publish(alerts: DataFrame, topic: KafkaTopic) -> None:
    """Write the alert rows to ``topic`` (a batch write: the producer flushes before this returns)."""
    records(alerts).write.format("kafka").options(**spark_options(topic)).option("topic", topic.topic).save()
