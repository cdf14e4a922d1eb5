"""One alert explained from the tables: its window, the events that made its aggregate, the rule version that fired."""

from __future__ import annotations

from decimal import Decimal

import pytest
from pyspark.sql import functions as F

from rulewatch.spark.present.explore import explain_alert, pick_alert_id


def _alert_id(spark, lakehouse, transaction_id: str) -> str:
    alerts = spark.read.format("delta").load(lakehouse.alerts)
    return alerts.where(F.col("transaction_id") == transaction_id).first().alert_id


@pytest.mark.jvm
def test_a_sum_alert_is_explained_by_the_events_that_add_up_to_it(spark, fixture_run):
    lakehouse = fixture_run.lakehouse
    explained = explain_alert(spark, lakehouse, _alert_id(spark, lakehouse, "pay-a5"))

    events = explained.events.collect()
    # fixtures/README.md: a1 400 + a2 350 (its duplicate dropped) + a4 250.50 + a5 100; a6 comes after the window end.
    assert [e.transaction_id for e in events] == ["pay-a1", "pay-a2", "pay-a4", "pay-a5"]
    assert sum(e.payment_amount for e in events) == explained.alert["aggregate_value"] == Decimal("1100.50")
    assert len(events) == explained.alert["event_count"] and explained.recomputed == Decimal("1100.50")
    assert all(explained.alert["window_start"] <= e.event_time <= explained.alert["window_end"] for e in events)
    assert explained.rule["ruleId"] == 1 and explained.rule["aggregatorFunctionType"] == "SUM" and explained.rule["window"] == "1h"
    assert explained.rule_change["change"] == "inserted"
    assert explained.rule_change["commit_version"] <= explained.alert["rule_version"]
    text = "\n".join(explained.lines())
    assert "SUM(paymentAmount) = 1100.5 GREATER limit 1000 over 4 event(s)" in text
    assert "recomputed from the events below: 1100.5" in text


@pytest.mark.jvm
def test_a_filtered_unique_count_alert_counts_the_distinct_values_of_its_logins(spark, fixture_run):
    lakehouse = fixture_run.lakehouse
    explained = explain_alert(spark, lakehouse, _alert_id(spark, lakehouse, "login-l6"))
    events = explained.events.collect()
    assert {e.action for e in events} == {"login"}  # rule 3's filter
    assert len(events) == explained.alert["event_count"] == 6
    assert len({e.ip for e in events}) == explained.recomputed == explained.alert["aggregate_value"] == 5


@pytest.mark.jvm
def test_without_an_alert_id_the_newest_alert_is_explained(spark, fixture_run):
    lakehouse = fixture_run.lakehouse
    newest = spark.read.format("delta").load(lakehouse.alerts).agg(F.max("event_time")).first()[0]
    explained = explain_alert(spark, lakehouse)
    assert explained.alert["alert_id"] == pick_alert_id(spark, lakehouse) and explained.alert["event_time"] == newest
    assert explain_alert(spark, lakehouse, "no-such-alert") is None
