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
    """SVG in event-time order: the key's window aggregate at each alert and at each batch's last event, against the limit."""
    points = sorted(
        [(r.event_time, "at an alert", r.aggregate_value, r.limit) for r in alerts(spark, rule_id, key).collect()]
        + [(r.event_time, "at a batch's last event", r.aggregate_value, r.limit) for r in window_metrics(spark, rule_id, key).collect()]
    )
    if not points:
        return f"<p>No alerts or window metrics for rule {rule_id}, key {key}.</p>"
    # The limit goes first so the aggregate's points are drawn over it where they touch.
    series: dict[str, list[float | None]] = {"limit": [float(limit) if limit is not None else None for *_, limit in points]}
    for kind in ("at an alert", "at a batch's last event"):
        series[kind] = [float(value) if k == kind and value is not None else None for _, k, value, _ in points]
    return lines([f"{t:%m-%d %H:%M:%S}" for t, *_ in points], series, f"Rule {rule_id}, key {key}: window aggregate in event-time order")


def rule_history(spark: SparkSession, rule_id: int) -> DataFrame:
    """Every recorded change of the rule, oldest first: which version was live when an alert fired."""
    return (
        spark.table("rule_changes").where(F.col("rule_id") == rule_id)
        .orderBy("commit_version").select("commit_version", "commit_timestamp", "change", "updated_by", "before", "after")
    )  # fmt: skip
