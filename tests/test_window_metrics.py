"""Which keys gold gives a gold/window_metrics row, what each rule's summary row counts, and the
batch totals gold records beside them (gold.write_batch on evaluator output rows made by hand, so
each edge of the near-the-limit test is one row)."""

from __future__ import annotations

from collections import Counter

import pytest
from pyspark.sql import functions as F

from rulewatch.engine.engine import OUTPUT_SCHEMA
from rulewatch.engine.rules import parse_rule
from rulewatch.spark.layers import gold
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.storage.metrics import Recorder
from rulewatch.spark.control.rules_table import apply_rules
from rulewatch.spark.present.views import register_views

# (rule_id, operator, limit, key, peak): the key's batch peak against the rule's limit.
METRICS = [
    (1, "GREATER", "1000", "over", "1200"),
    (1, "GREATER", "1000", "at-80%", "800"),
    (1, "GREATER", "1000", "below-80%", "799.99"),
    (1, "GREATER", "1000", "no-value", None),
    (2, "GREATER_EQUAL", "3", "two-point-four", "2.4"),  # exactly 80 %: 2.4 / 3 is 0.7999... as doubles
    (2, "GREATER_EQUAL", "3", "two", "2"),
    (3, "LESS", "10", "any", "500"),  # no upper limit: every key stays
    (4, "NOT_EQUAL", "0", "any", "1"),
    (5, "GREATER", "0", "zero-limit", "-3"),  # a limit of 0 has no share: kept
    (6, "GREATER", "1000", "far", "10"),  # a rule with no key near its limit
]
NEAR = {(1, "over"), (1, "at-80%"), (2, "two-point-four"), (3, "any"), (4, "any"), (5, "zero-limit")}
NONE = (None,) * 4


def _out(spark):
    rows = [
        ("metric", rid, 7, "payeeId", key, None, 1_000, peak, limit, op, "SUM", 0, 1_000, 1, peak, None, None, None, None, *NONE)
        for rid, op, limit, key, peak in METRICS
    ]
    rows += [
        ("alert", 1, 7, "payeeId", "over", "t1", 1_000, "1200", "1000", "GREATER", "SUM", 0, 1_000, 1, None, None, None, ["over"], 900, *NONE),
        ("stats", None, 3, None, None, None, None, None, None, None, None, None, None, 42, None, None, None, None, None, 10, 5, 500, 2),
        ("late", None, None, "payeeId", "old", "t0", 5, None, None, None, None, None, None, None, None, None, "too late", None, None, *NONE),
        ("rule_error", 9, 11, None, None, None, None, None, None, None, "limit", None, None, None, None, None, "bad limit", None, None, *NONE),
    ]
    return spark.createDataFrame(rows, OUTPUT_SCHEMA)


@pytest.mark.parametrize("keys", ["near", "all"])
def test_window_metrics_keep_near_keys_by_default_and_a_summary_row_counts_every_key(spark, tmp_path, keys):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    gold.ensure_gold_tables(spark, lakehouse)
    told = []
    gold.write_batch(_out(spark), 0, lakehouse, Recorder(lakehouse, "gold"), on_alerts=lambda *a: told.append(a), window_metrics=keys)

    table = spark.read.format("delta").load(lakehouse.window_metrics)
    per_key = Counter((r.rule_id, r.group_key) for r in table.where("keys_sketch IS NULL").collect())
    assert per_key == Counter(NEAR if keys == "near" else [(rid, key) for rid, _, _, key, _ in METRICS])

    summaries = table.where("keys_sketch IS NOT NULL")
    counted = Counter((r.rule_id, r.group_key, r.rule_version, r.keys_evaluated, r.gold_batch_id) for r in summaries.collect())
    evaluated = Counter(rid for rid, *_ in METRICS)
    assert counted == Counter((rid, None, 7, n, 0) for rid, n in evaluated.items())
    estimates = summaries.groupBy("rule_id").agg(F.hll_sketch_estimate(F.hll_union_agg("keys_sketch")).alias("n")).collect()
    assert {r.rule_id: r.n for r in estimates} == dict(evaluated)

    # The totals of the one pass grouped by rule, as the global count gave them.
    row = spark.read.format("delta").load(lakehouse.pipeline_metrics).where("layer = 'gold'").first()
    assert row.rows_written["gold/window_metrics"] == table.count() == sum(per_key.values()) + len(evaluated)
    assert (row.rows_in, row.keys_touched, row.state_rows_written, row.state_bytes_written) == (42, 10, 5, 500)
    assert (row.alerts, row.late_events, row.active_rules, row.rules_version) == (1, 1, 2, 3)
    assert row.rows_written["config/rule_errors"] == 1
    assert [(batch, [a.transaction_id for a in fired]) for batch, _, fired in told] == [(0, ["t1"])]

    # The views: a key's window over time has no summary rows; effectiveness counts the same either way.
    apply_rules(spark, lakehouse, [parse_rule(_rule(rid, op, limit)) for rid, op, limit in {(m[0], m[1], m[2]) for m in METRICS}])
    register_views(spark, lakehouse, viewer_in_pii_group=True)
    assert spark.table("key_window_metrics").count() == sum(per_key.values())
    rows = {r.rule_id: r for r in spark.table("rule_effectiveness").collect()}
    assert (rows[1].keys_evaluated, rows[1].keys_alerted, rows[1].keys_near_limit, rows[1].share_near_limit) == (4, 1, 1, 0.25)
    assert (rows[2].keys_near_limit, rows[6].keys_evaluated, rows[6].keys_near_limit, rows[6].share_near_limit) == (1, 1, 0, 0)


def _rule(rule_id: int, operator: str, limit: str) -> dict:
    return {"ruleId": rule_id, "groupingKeyNames": ["payeeId"], "aggregateFieldName": "paymentAmount",
            "aggregatorFunctionType": "SUM", "limitOperatorType": operator, "limit": float(limit), "window": "1h"}  # fmt: skip


def test_a_batch_without_metrics_commits_nothing_to_window_metrics(spark, tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    gold.ensure_gold_tables(spark, lakehouse)
    history = f"DESCRIBE HISTORY delta.`{lakehouse.window_metrics}`"
    versions = spark.sql(history).count()
    gold.write_batch(_out(spark).where("kind = 'alert'"), 0, lakehouse, Recorder(lakehouse, "gold"))
    assert spark.sql(history).count() == versions
    assert spark.read.format("delta").load(lakehouse.alerts).count() == 1


def test_an_unknown_window_metrics_setting_is_refused():
    with pytest.raises(ValueError, match="window_metrics must be one of near, all, got 'some'"):
        gold.GoldSettings(window_metrics="some")
