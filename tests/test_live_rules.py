"""One gold query keeps running while rules change; every micro-batch uses exactly the rules current then."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

import pytest
from pyspark.sql import functions as F

from rulewatch.spark.storage import schema
from rulewatch.cli.main import main
from rulewatch.spark.layers.gold import GoldSettings, start_gold
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.engine.rules import parse_rule
from rulewatch.spark.control.rules_table import apply_rules
from rulewatch.spark.layers.silver import ensure_silver_tables
from rulewatch.spark.storage.tables import table_ref

T0 = datetime(2026, 11, 1, 10, 0, 0)
RULE = {"ruleId": 1, "groupingKeyNames": ["payeeId"], "aggregateFieldName": "paymentAmount",
        "aggregatorFunctionType": "SUM", "limitOperatorType": "GREATER", "limit": 100, "window": "1h"}  # fmt: skip


def land(spark, lakehouse: Lakehouse, *events: tuple[str, int, str]) -> None:
    """Append (transaction id, minutes after T0, amount) payments of payee p1 straight to silver."""
    rows = [(tid, T0 + timedelta(minutes=m), "p1", Decimal(amount)) for tid, m, amount in events]
    df = spark.createDataFrame(rows, "transaction_id string, event_time timestamp, payee_id string, payment_amount decimal(18,2)")
    schema.conform(df, schema.SILVER).write.format("delta").mode("append").save(lakehouse.silver_transactions)


def rules_version(spark, lakehouse: Lakehouse) -> int:
    return spark.sql(f"DESCRIBE HISTORY {table_ref(lakehouse.rules)}").agg(F.max("version")).first()[0]


@pytest.mark.slow
def test_rule_changes_reach_the_running_stream(spark, tmp_path, capsys):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    ensure_silver_tables(spark, lakehouse)
    apply_rules(spark, lakehouse, [parse_rule(RULE)])
    query = start_gold(spark, lakehouse, GoldSettings(shards=4), available_now=False, processing_time="200 milliseconds")
    try:
        fired: list[tuple[str, int]] = []

        def step(*events):
            land(spark, lakehouse, *events)
            query.processAllAvailable()
            alerts = spark.read.format("delta").load(lakehouse.alerts)
            new = alerts.where(~F.col("transaction_id").isin([t for t, _ in fired] or ["-"])).orderBy("transaction_id")
            rows = [(r.transaction_id, r.rule_version, r.aggregate_value) for r in new.collect()]
            fired.extend((t, v) for t, v, _ in rows)
            return rows

        v1 = rules_version(spark, lakehouse)
        assert step(("e1", 0, "150")) == [("e1", v1, Decimal("150"))]

        apply_rules(spark, lakehouse, [parse_rule({**RULE, "limit": 1000})])  # raise the limit
        # The change alone makes a batch; its metrics row says the evaluator now runs that commit.
        query.processAllAvailable()
        gold = spark.read.format("delta").load(lakehouse.pipeline_metrics).where("layer = 'gold'")
        newest = gold.orderBy(F.desc("batch_id")).first()
        assert (newest.rows_in, newest.rules_version) == (0, rules_version(spark, lakehouse))
        assert step(("e2", 1, "200")) == []  # 350 is no longer above the limit

        apply_rules(spark, lakehouse, [parse_rule({**RULE, "limit": 1000, "ruleState": "PAUSE"})])
        assert step(("e3", 2, "5000")) == []  # paused: no alert

        apply_rules(spark, lakehouse, [parse_rule({**RULE, "limit": 1000})])  # resume; history was kept
        v_resumed = rules_version(spark, lakehouse)
        assert step(("e4", 3, "1")) == [("e4", v_resumed, Decimal("5351"))]

        # Plain SQL edits take the same path as rule files.
        spark.sql(f"UPDATE {table_ref(lakehouse.rules)} SET limit = 6000 WHERE ruleId = 1")
        assert step(("e5", 4, "500")) == []  # 5851 is not above 6000
        spark.sql(f"UPDATE {table_ref(lakehouse.rules)} SET aggregatorFunctionType = 'SUMM' WHERE ruleId = 1")
        bad_version = rules_version(spark, lakehouse)
        # The invalid row is quarantined; the last valid rule (limit 6000) keeps running.
        assert step(("e6", 5, "200")) == [("e6", bad_version - 1, Decimal("6051"))]
        errors = spark.read.format("delta").load(lakehouse.rule_errors).collect()
        assert [(e.rule_id, e.commit_version, e.field) for e in errors] == [(1, bad_version, "aggregatorFunctionType")]
        assert "SUMM" in errors[0].reason and query.isActive

        # Renumbering a rule by SQL removes the old id: the repaired rule now fires only as rule 2.
        spark.sql(
            f"UPDATE {table_ref(lakehouse.rules)} SET ruleId = 2, aggregatorFunctionType = 'SUM', limit = 100 WHERE ruleId = 1"
        )
        renumbered = rules_version(spark, lakehouse)
        assert step(("e7", 6, "1")) == [("e7", renumbered, Decimal("6052"))]
        alerts = spark.read.format("delta").load(lakehouse.alerts).where("transaction_id = 'e7'").collect()
        assert [a.rule_id for a in alerts] == [2]

        spark.sql(f"DELETE FROM {table_ref(lakehouse.rules)} WHERE ruleId = 2")
        assert step(("e8", 7, "9999")) == []
        assert query.isActive and query.exception() is None

        # Restart safety: a rule added while the stream is down is the only one in force after it
        # restarts; the deleted ones stay deleted. e8 arrived while no rule grouped by payeeId, so
        # it was never keyed or kept: the new rule sees the history that was retained (no e8).
        query.stop()
        apply_rules(spark, lakehouse, [parse_rule({**RULE, "ruleId": 3, "limit": 6000})])
        v3 = rules_version(spark, lakehouse)
        query = start_gold(spark, lakehouse, GoldSettings(shards=4), available_now=False, processing_time="200 milliseconds")
        assert step(("e9", 8, "1")) == [("e9", v3, Decimal("6053"))]
        alerts = spark.read.format("delta").load(lakehouse.alerts).where("transaction_id = 'e9'").collect()
        assert [a.rule_id for a in alerts] == [3]

        # Clearing rule 3's state (here from the command line) makes its window start after e9.
        assert main(["rules", "clear-state", "--lakehouse", lakehouse.root, "--rule", "3"]) == 0
        assert "rule 3 will only see events after 2026-11-01 10:08:00.000" in capsys.readouterr().out
        assert step(("e10", 9, "1")) == []  # 1, not 6054
        assert step(("e11", 10, "6000")) == [("e11", v3, Decimal("6001"))]
        assert main(["rules", "clear-state", "--lakehouse", lakehouse.root, "--rule", "99"]) == 2
        assert "no rule 99" in capsys.readouterr().err
    finally:
        query.stop()
