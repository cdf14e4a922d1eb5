"""Idle keys leave the RocksDB state once the watermark passes their retention (event-time timers)."""

from __future__ import annotations

import pickle
from datetime import datetime, timedelta
from decimal import Decimal

import pytest

from rulewatch.engine.engine import KEY_SEPARATOR
from rulewatch.spark.storage import schema
from rulewatch.spark.layers.gold import GoldSettings, start_gold
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.engine.rules import parse_rule
from rulewatch.spark.control.rules_table import apply_rules
from rulewatch.spark.layers.silver import ensure_silver_tables

T0 = datetime(2026, 11, 1, 10)
RULE = {"ruleId": 1, "groupingKeyNames": ["payeeId"], "aggregateFieldName": "paymentAmount",
        "aggregatorFunctionType": "SUM", "limitOperatorType": ">", "limit": 10**9, "window": "1h"}  # fmt: skip


def _land(spark, lakehouse: Lakehouse, rows: list[tuple[str, int, str]]) -> None:
    df = spark.createDataFrame(
        [(tid, T0 + timedelta(minutes=m), payee, Decimal(1)) for tid, m, payee in rows],
        "transaction_id string, event_time timestamp, payee_id string, payment_amount decimal(18,2)",
    )
    schema.conform(df, schema.SILVER).write.format("delta").mode("append").save(lakehouse.silver_transactions)


def _state_rows(spark, lakehouse: Lakehouse) -> tuple[int, int]:
    """(state rows at the end, rows removed over the run) of the evaluator's stateful operator."""
    query = start_gold(spark, lakehouse, GoldSettings(shards=2))
    query.awaitTermination()
    operators = [p["stateOperators"][0] for p in query.recentProgress]
    return operators[-1]["numRowsTotal"], sum(op["numRowsRemoved"] for op in operators)


def _group_keys(spark, lakehouse: Lakehouse) -> set[str]:
    """The group keys whose history the shards hold: entries of their own, and those a shard's
    record (history.py) places in a generation."""
    entries = spark.read.format("statestore").option("stateVarName", "history").load(lakehouse.checkpoint("gold"))
    keys: set[str] = set()
    for row in entries.collect():
        name, blob = row["user_map_key"]["key"], row["user_map_value"]["blob"]
        if name == "#where":
            keys |= set(pickle.loads(blob)[0])
        elif not name.startswith("#"):
            keys.add(name)
    return {key.split(KEY_SEPARATOR)[-1] for key in keys}


@pytest.mark.jvm
def test_idle_keys_are_purged_and_active_keys_kept(spark, tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    ensure_silver_tables(spark, lakehouse)
    apply_rules(spark, lakehouse, [parse_rule(RULE)])
    _land(spark, lakehouse, [(f"a{i}", 0, f"k{i}") for i in range(100)])
    _state_rows(spark, lakehouse)
    assert _group_keys(spark, lakehouse) == {f"k{i}" for i in range(100)}
    # Three hours later one other key is active: with a 1 h window and 1 h lateness the 100 old
    # keys hold nothing any event can still need, so their timers delete them.
    _land(spark, lakehouse, [("z1", 180, "z")])
    _, removed_first = _state_rows(spark, lakehouse)
    _land(spark, lakehouse, [("z2", 181, "z")])
    remaining, removed_then = _state_rows(spark, lakehouse)
    assert removed_first + removed_then > 0 and remaining < 10
    assert _group_keys(spark, lakehouse) == {"z"}


@pytest.mark.jvm
def test_a_key_indexed_under_a_narrow_rule_is_kept_for_a_wider_rule_added_later(spark, tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    ensure_silver_tables(spark, lakehouse)
    apply_rules(spark, lakehouse, [parse_rule(RULE)])
    _land(spark, lakehouse, [("a1", 0, "k")])
    _state_rows(spark, lakehouse)  # k indexed to expire an hour after its event
    # A 5 h rule arrives; then the watermark passes k's first expiry while its 5 h window still needs it.
    wide = {**RULE, "ruleId": 2, "limit": 1.5, "window": "5h"}
    apply_rules(spark, lakehouse, [parse_rule(RULE), parse_rule(wide)])
    for tid, minute in [("z1", 180), ("z2", 181)]:
        _land(spark, lakehouse, [(tid, minute, f"other-{tid}")])
        _state_rows(spark, lakehouse)
    _land(spark, lakehouse, [("a2", 200, "k")])
    _state_rows(spark, lakehouse)
    alerts = spark.read.format("delta").load(lakehouse.alerts).where("rule_id = 2").collect()
    # a1 (minute 0) is inside a2's 5 h window: 1 + 1 > 1.5.
    assert [(a.transaction_id, a.group_key) for a in alerts] == [("a2", "k")]


@pytest.mark.jvm
def test_a_batch_settling_many_index_entries_purges_idle_keys_and_keeps_a_key_touched_since(spark, tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    ensure_silver_tables(spark, lakehouse)
    apply_rules(spark, lakehouse, [parse_rule({**RULE, "limit": 1.5})])
    # Three hours of keys in one batch: their expiries (an hour after each event) are indexed under
    # 16-minute steps, 64 to 240 minutes; k59's (minute 177) under 240.
    _land(spark, lakehouse, [(f"a{i}", 3 * i, f"k{i}") for i in range(60)])
    _state_rows(spark, lakehouse)
    # Stored: at least every key whose hour outlasts the next watermark (minute 177 - 1 h lateness).
    assert {f"k{i}" for i in range(20, 60)} <= _group_keys(spark, lakehouse)
    _land(spark, lakehouse, [("b", 200, "k59")])  # k59 indexed again, under 264
    _state_rows(spark, lakehouse)
    _land(spark, lakehouse, [("z1", 310, "z")])
    _, removed_before = _state_rows(spark, lakehouse)
    # This batch's watermark (minute 250) passes the first batch's entries the last one left (the
    # last of them k59's, under 240) at once, but not k59's newer one: k59 must not be purged by its old entry.
    _land(spark, lakehouse, [("z2", 311, "z")])
    remaining, removed_now = _state_rows(spark, lakehouse)
    assert removed_before + removed_now > 0 and remaining < 15
    assert _group_keys(spark, lakehouse) == {"k59", "z"}  # every k but k59 purged
    _land(spark, lakehouse, [("c", 255, "k59")])  # within the hour of b, not behind the watermark (251)
    _state_rows(spark, lakehouse)
    alerts = {(a.transaction_id, a.group_key) for a in spark.read.format("delta").load(lakehouse.alerts).collect()}
    # b fires with a59 (1 + 1 > 1.5 within the hour); c fires only if b was kept.
    assert alerts == {("b", "k59"), ("z2", "z"), ("c", "k59")}
