"""Helpers for the explore notebook: one rule or key at a time, read through the dashboard views.

Call :func:`rulewatch.views.register_views` first; everything here reads those views, so the
notebook shows the same numbers (and the same masking) as the dashboard and the report.
"""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from rulewatch.report import lines


def top_key(spark: SparkSession, rule_id: int) -> str | None:
    """The key with the most alerts for ``rule_id`` (ties: the smallest key), or None if it never alerted."""
    row = (
        spark.table("top_alerting_keys").where(F.col("rule_id") == rule_id)
        .orderBy(F.col("alerts").desc(), "group_key").select("group_key").first()
    )  # fmt: skip
    return row.group_key if row else None


def alerts(spark: SparkSession, rule_id: int, key: str | None = None) -> DataFrame:
    """The rule's alerts (for one key if given), oldest first, with the columns that explain them."""
    frame = spark.table("alerts_masked").where(F.col("rule_id") == rule_id)
    if key:
        frame = frame.where(F.col("group_key") == key)
    return frame.orderBy("event_time", "transaction_id").select(
        "event_time", "group_key", "transaction_id", "rule_version", "aggregator", "aggregate_value", "operator", "limit",
        "window_start", "window_end", "event_count", "distinct_values", "latency_ms",
    )  # fmt: skip


def window_metrics(spark: SparkSession, rule_id: int, key: str) -> DataFrame:
    """The key's window aggregate per micro-batch for the rule, in event-time order."""
    return (
        spark.table("key_window_metrics").where((F.col("rule_id") == rule_id) & (F.col("group_key") == key))
        .orderBy("event_time", "gold_batch_id")
        .select("event_time", "gold_batch_id", "rule_version", "aggregate_value", "max_aggregate", "limit", "event_count")
    )  # fmt: skip


def window_chart(spark: SparkSession, rule_id: int, key: str) -> str:
    """SVG: the key's aggregate at its last event per batch, the batch's peak, and the limit it is held against."""
    rows = window_metrics(spark, rule_id, key).collect()
    if not rows:
        return f"<p>No window metrics for rule {rule_id}, key {key}.</p>"
    series = {
        name: [float(r[column]) if r[column] is not None else None for r in rows]
        for name, column in (("aggregate at last event", "aggregate_value"), ("batch peak", "max_aggregate"), ("limit", "limit"))
    }
    return lines([f"{r.event_time:%m-%d %H:%M}" for r in rows], series, f"Rule {rule_id}, key {key}: window aggregate per batch")


def rule_history(spark: SparkSession, rule_id: int) -> DataFrame:
    """Every recorded change of the rule, oldest first: which version was live when an alert fired."""
    return (
        spark.table("rule_changes").where(F.col("rule_id") == rule_id)
        .orderBy("commit_version").select("commit_version", "commit_timestamp", "change", "updated_by", "before", "after")
    )  # fmt: skip
