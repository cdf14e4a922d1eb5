"""Helpers for the notebooks: one rule or key at a time, and one alert explained.

The per-rule helpers read the dashboard views: call :func:`rulewatch.spark.present.views.register_views` first,
so the notebook shows the same numbers (and the same masking) as the dashboard and the report.
:func:`explain_alert` reads the tables themselves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.window import Window

from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.present.report import lines
from rulewatch.engine.rules import Aggregator, Rule, parse_rule
from rulewatch.spark.storage.schema import FIELD_COLUMNS
from rulewatch.spark.storage import tables


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


# --- silver's quarantine, by reason code ---------------------------------------------------------------


def _quarantine_codes(spark: SparkSession, lakehouse: Lakehouse) -> DataFrame:
    # A line failing several checks carries several codes ("a; b"): it belongs under each of them.
    return tables.read(spark, lakehouse.silver_quarantine).withColumn(
        "code", F.explode(F.split(F.coalesce("reason_code", F.lit("other")), "; "))
    )


def quarantine_by_code(spark: SparkSession, lakehouse: Lakehouse) -> DataFrame:
    """Quarantined lines per reason code (``silver.REASON_CODES``), most frequent first.

    A line that failed several checks counts under each of its codes, so the counts can add up to
    more than the quarantined lines.
    """
    return (
        _quarantine_codes(spark, lakehouse).groupBy(F.col("code").alias("reason_code")).count()
        .orderBy(F.col("count").desc(), "reason_code")
    )  # fmt: skip


def quarantine_samples(spark: SparkSession, lakehouse: Lakehouse, per_code: int = 2) -> DataFrame:
    """Up to ``per_code`` quarantined lines for each reason code, the earliest ingested first, with every reason."""
    first = Window.partitionBy("code").orderBy("ingest_time", "source_file", "value")
    return (
        _quarantine_codes(spark, lakehouse).withColumn("n", F.row_number().over(first)).where(F.col("n") <= per_code)
        .orderBy("code", "n").select(F.col("code").alias("reason_code"), "value", "reason", "source_file")
    )  # fmt: skip


# --- one alert, explained from the tables -------------------------------------------------------------


@dataclass
class AlertExplanation:
    """Why an alert fired: the alert row, the rule as it was at that version, and the events in its window.

    ``events`` are the key's silver events that the evaluator had in the window when it decided:
    event time within ``[window_start, window_end]`` (an event at ``window_end`` counts up to the
    triggering transaction, ties ordered by transaction id), the rule's filter passed, and bronze
    ingest no later than the decision. ``recomputed`` is the rule's aggregate over them, a check a
    reader can make by eye; it can differ from ``alert["aggregate_value"]`` when ``rulewatch rules
    clear-state`` restarted the rule's windows or an event reached gold only in a later micro-batch.
    """

    alert: dict[str, Any]
    rule: dict[str, Any] | None  # the rule JSON at ``alert["rule_version"]``; None if gold/rule_history lacks it
    rule_change: dict[str, Any] | None  # the rule_history row that made that version: change, commit, who
    events: DataFrame
    recomputed: Decimal | None

    def lines(self) -> list[str]:
        """The explanation as text, for a notebook or a terminal."""
        a = self.alert
        field = self.rule.get("aggregateFieldName", "?") if self.rule else "?"
        out = [
            f"alert {a['alert_id']}",
            f"  rule {a['rule_id']} (version {a['rule_version']}): {a['rule_description']}",
            f"  key {a['group_key']}  ({', '.join(f'{k}={v}' for k, v in sorted(a['key_parts'].items()))})",
            f"  triggered by {a['transaction_id']} at {a['event_time']:%Y-%m-%d %H:%M:%S} UTC",
            f"  window {a['window_start']:%Y-%m-%d %H:%M:%S} .. {a['window_end']:%Y-%m-%d %H:%M:%S} UTC (both ends inclusive)",
            f"  {a['aggregator']}({field}) = {a['aggregate_value'].normalize():f} {a['operator']} limit {a['limit'].normalize():f}"
            f" over {a['event_count']} event(s)",
            f"  recomputed from the events below: "
            + (f"{self.recomputed.normalize():f}" if self.recomputed is not None else "n/a (rule version not in gold/rule_history)"),
        ]
        if self.rule_change:
            c = self.rule_change
            out.append(f"  that version: {c['change']} at commit {c['commit_version']}, {c['commit_timestamp']:%Y-%m-%d %H:%M:%S} UTC"
                       f" by {c['updated_by'] or 'unknown'}")  # fmt: skip
        else:
            out.append(f"  rule version {a['rule_version']} is not in gold/rule_history yet (`rulewatch rules history` records it)")
        return out


def pick_alert_id(spark: SparkSession, lakehouse: Lakehouse) -> str | None:
    """The newest alert's id (latest event time; ties: highest rule id, then transaction id), None if there is none."""
    row = (
        tables.read(spark, lakehouse.alerts)
        .orderBy(F.col("event_time").desc(), F.col("rule_id").desc(), F.col("transaction_id").desc())
        .select("alert_id").first()
    )  # fmt: skip
    return row.alert_id if row else None


def _rule_at(spark: SparkSession, lakehouse: Lakehouse, rule_id: int, version: int) -> dict[str, Any] | None:
    """The rule_history row that produced ``version`` of the rule: its last change at or before that commit."""
    row = (
        tables.read(spark, lakehouse.rule_history)
        .where((F.col("rule_id") == rule_id) & (F.col("commit_version") <= version) & F.col("after").isNotNull())
        .orderBy(F.col("commit_version").desc()).first()
    )  # fmt: skip
    return row.asDict() if row else None


def _column(field: str) -> str:
    # key_parts and filters name rule fields (payeeId); silver names columns (payee_id).
    return FIELD_COLUMNS.get(field, field)


def _recompute(rule: Rule, events: DataFrame) -> Decimal | None:
    value = F.col(_column(rule.aggregate_field))
    aggregate = {
        Aggregator.SUM: F.sum(value),
        Aggregator.COUNT: F.count(F.lit(1)),
        Aggregator.AVG: F.avg(value),
        Aggregator.MIN: F.min(value),
        Aggregator.MAX: F.max(value),
        Aggregator.UNIQUE_COUNT: F.count_distinct(value),
    }[rule.aggregator]
    result = events.agg(aggregate.cast("decimal(38,6)")).first()[0]
    return Decimal(result) if result is not None else None


def explain_alert(spark: SparkSession, lakehouse: Lakehouse, alert_id: str | None = None) -> AlertExplanation | None:
    """Explain ``alert_id`` (default: the newest alert, :func:`pick_alert_id`); None when there is no such alert.

    Reads ``gold/alerts``, ``gold/rule_history`` and ``silver/transactions`` directly (no views):
    the explanation needs identifiers unmasked to find the key's events.
    """
    alert_id = alert_id or pick_alert_id(spark, lakehouse)
    found = tables.read(spark, lakehouse.alerts).where(F.col("alert_id") == alert_id).first() if alert_id else None
    if found is None:
        return None
    alert = found.asDict()
    change = _rule_at(spark, lakehouse, alert["rule_id"], alert["rule_version"])
    rule_json = json.loads(change["after"]) if change else None
    rule = parse_rule(rule_json) if rule_json else None

    in_window = (
        (F.col("event_time") >= F.lit(alert["window_start"])) & (F.col("event_time") <= F.lit(alert["window_end"]))
        # The evaluator orders ties by transaction id: later ids at the trigger's time came after it.
        & ((F.col("event_time") < F.lit(alert["window_end"])) | (F.col("transaction_id") <= F.lit(alert["transaction_id"])))
        & (F.col("ingest_time") <= F.lit(alert["decision_time"]))
    )
    for field, value in alert["key_parts"].items():
        in_window &= F.col(_column(field)) == F.lit(value)
    for field, value in rule.filter if rule else ():
        in_window &= F.col(_column(field)).cast("string") == F.lit(value)
    events = (
        tables.read(spark, lakehouse.silver_transactions).where(in_window)
        .orderBy("event_time", "transaction_id")
        .select("transaction_id", "event_time", "payee_id", "beneficiary_id", "payment_amount", "payment_type",
                "user_id", "ip", "action", "source_file", "ingest_time")
    )  # fmt: skip
    change_info = {k: change[k] for k in ("change", "commit_version", "commit_timestamp", "updated_by")} if change else None
    return AlertExplanation(alert, rule_json, change_info, events, _recompute(rule, events) if rule else None)
