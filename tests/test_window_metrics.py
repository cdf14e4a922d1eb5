"""Which keys gold gives a gold/window_metrics row, and what each rule's summary row counts
(gold.write_batch on evaluator output rows made by hand, so each edge of the near-the-limit test is one row)."""

from __future__ import annotations

import pytest
from pyspark.sql import functions as F

from rulewatch.engine.engine import OUTPUT_SCHEMA
from rulewatch.spark import gold
from rulewatch.spark.lakehouse import Lakehouse
from rulewatch.spark.metrics import Recorder

# (rule_id, operator, limit, key, peak): the key's batch peak against the rule's limit.
METRICS = [
    (1, "GREATER", "1000", "over", "1200"),
    (1, "GREATER", "1000", "at-80%", "800"),
    (1, "GREATER", "1000", "below-80%", "799.99"),
    (1, "GREATER", "1000", "no-value", None),
    (2, "GREATER_EQUAL", "5", "four", "4"),
    (2, "GREATER_EQUAL", "5", "three", "3"),
    (3, "LESS", "10", "any", "500"),  # no upper limit: every key stays
    (4, "NOT_EQUAL", "0", "any", "1"),
    (5, "GREATER", "0", "zero-limit", "-3"),  # a limit of 0 has no share: kept
]
NEAR = {(1, "over"), (1, "at-80%"), (2, "four"), (3, "any"), (4, "any"), (5, "zero-limit")}


def _out(spark):
    rows = [
        ("metric", rid, 7, "payeeId", key, None, 1_000, peak, limit, op, "SUM", 0, 1_000, 1, peak, *(None,) * 8)
        for rid, op, limit, key, peak in METRICS
    ]
    rows.append(("alert", 1, 7, "payeeId", "over", "t1", 1_000, "1200", "1000", "GREATER", "SUM", 0, 1_000, 1, None, None, None, ["over"], 900, *(None,) * 4))
    return spark.createDataFrame(rows, OUTPUT_SCHEMA)


@pytest.mark.parametrize("keys", ["near", "all"])
def test_window_metrics_keep_near_keys_by_default_and_a_summary_row_counts_every_key(spark, tmp_path, keys):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    gold.ensure_gold_tables(spark, lakehouse)
    gold.write_batch(_out(spark), 0, lakehouse, Recorder(lakehouse, "gold"), window_metrics=keys)

    table = spark.read.format("delta").load(lakehouse.window_metrics)
    per_key = {(r.rule_id, r.group_key) for r in table.where("keys_sketch IS NULL").collect()}
    assert per_key == (NEAR if keys == "near" else {(rid, key) for rid, _, _, key, _ in METRICS})

    summaries = table.where("keys_sketch IS NOT NULL")
    counted = {r.rule_id: (r.group_key, r.rule_version, r.keys_evaluated, r.gold_batch_id) for r in summaries.collect()}
    evaluated = {rid: sum(m[0] == rid for m in METRICS) for rid, *_ in METRICS}
    assert counted == {rid: (None, 7, n, 0) for rid, n in evaluated.items()}
    estimates = summaries.groupBy("rule_id").agg(F.hll_sketch_estimate(F.hll_union_agg("keys_sketch")).alias("n")).collect()
    assert {r.rule_id: r.n for r in estimates} == evaluated

    row = spark.read.format("delta").load(lakehouse.pipeline_metrics).where("layer = 'gold'").first()
    assert row.rows_written["gold/window_metrics"] == len(per_key) + len(evaluated)


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
