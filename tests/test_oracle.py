"""Tests of the brute-force oracle itself against the brief's worked examples (§3, §4)."""

from __future__ import annotations

import random
import sys
from decimal import Decimal
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle import oracle, parse_duration_ms  # noqa: E402

MIN = 60_000
T0 = 1_793_527_200_000  # 2026-11-01T10:00:00Z


def pay(tid, t, amount, payee="p1", ptype="CSH", **kw):
    e = {"transactionId": tid, "eventTime": t, "payeeId": payee, "paymentType": ptype}
    e["paymentAmount"] = None if amount is None else Decimal(str(amount))
    e.update(kw)
    return e


def rule(**kw):
    r = {
        "ruleId": 1,
        "ruleState": "ACTIVE",
        "groupingKeyNames": ["payeeId", "paymentType"],
        "aggregateFieldName": "paymentAmount",
        "aggregatorFunctionType": "SUM",
        "limitOperatorType": "GREATER",
        "limit": 20,
        "windowMinutes": 1440,
    }
    r.update(kw)
    return r


def brief(alerts):
    return [(a["transaction_id"], a["aggregate_value"]) for a in alerts]


# --- §4 reference test vectors: SUM(paymentAmount) > 20 grouped by payeeId, paymentType ----------


def test_reference_vector_sequence():
    events = [
        pay("t1", T0, 22, ptype="CSH"),
        pay("t2", T0 + 1000, 19, ptype="CRD"),
        pay("t3", T0 + 2000, 2, ptype="CRD"),
    ]
    alerts = oracle(events, [rule()])
    assert brief(alerts) == [("t1", Decimal(22)), ("t3", Decimal(21))]
    a1, a3 = alerts
    assert a1["group_key"] == "p1|CSH" and a1["event_count"] == 1
    assert a3["group_key"] == "p1|CRD" and a3["event_count"] == 2
    assert a3["window_start"] == T0 + 2000 - 1440 * MIN and a3["window_end"] == T0 + 2000
    assert a3["values"] is None and a3["rule_id"] == 1 and a3["event_time"] == T0 + 2000


def test_same_timestamp_ordered_by_id():
    # 19 then 2 at the same timestamp: the second (by id) alerts with 21, whatever the list order
    events = [pay("a-19", T0, 19, ptype="CRD"), pay("b-02", T0, 2, ptype="CRD")]
    assert brief(oracle(events, [rule()])) == [("b-02", Decimal(21))]
    assert brief(oracle(events[::-1], [rule()])) == [("b-02", Decimal(21))]
    # swap the ids: now the 19 comes second in (time, id) order and is the one that alerts
    events = [pay("b-19", T0, 19, ptype="CRD"), pay("a-02", T0, 2, ptype="CRD")]
    assert brief(oracle(events, [rule()])) == [("b-19", Decimal(21))]


def test_late_event_sees_earlier_events_of_its_window():
    arrival_order = [
        pay("t1", T0, 19),
        pay("t3", T0 + 3 * MIN, 1),
        pay("t2", T0 + 1 * MIN, 2),  # late: arrives after t3 but is older
    ]
    alerts = oracle(arrival_order, [rule()])
    # t2 sees t1 (19 + 2 = 21); t3 sees t1, t2 and itself (22)
    assert brief(alerts) == [("t2", Decimal(21)), ("t3", Decimal(22))]
    for _ in range(5):
        shuffled = arrival_order[:]
        random.shuffle(shuffled)
        assert oracle(shuffled, [rule()]) == alerts


def test_window_bounds_inclusive():
    r = rule(windowMinutes=None, window="10m", groupingKeyNames=["payeeId"])
    events = [pay("t1", T0, 15), pay("t2", T0 + 10 * MIN, 6), pay("t3", T0 + 10 * MIN + 1, 15)]
    # t2: window [T0, T0+10m] includes t1 → 21; t3: window starts at T0+1ms → 6 + 15 = 21
    alerts = oracle(events, [r])
    assert brief(alerts) == [("t2", Decimal(21)), ("t3", Decimal(21))]
    assert alerts[1]["window_start"] == T0 + 1 and alerts[1]["event_count"] == 2
    # one more ms and t2 no longer sees t1
    events[1]["eventTime"] += 1
    assert brief(oracle(events, [r])) == [("t3", Decimal(21))]


# --- §4 malicious login: UNIQUE_COUNT(userId) per ip >= 5 in 1h, report new accounts only ---------

LOGIN_RULE = {
    "ruleId": 7,
    "ruleState": "ACTIVE",
    "groupingKeyNames": ["ip"],
    "aggregateFieldName": "userId",
    "aggregatorFunctionType": "UNIQUE_COUNT",
    "limitOperatorType": "GREATER_EQUAL",
    "limit": 5,
    "window": "1h",
    "filter": {"action": "login"},
    "reportNewValuesOnly": True,
}

# (minute, account, distinct accounts in last hour, reported accounts or None)
LOGIN_TABLE = [
    (0, "user1", 1, None),
    (1, "user2", 2, None),
    (2, "user3", 3, None),
    (3, "user4", 4, None),
    (4, "user4", 4, None),  # duplicate does not count
    (5, "user5", 5, ["user1", "user2", "user3", "user4", "user5"]),
    (6, "user6", 6, ["user6"]),  # already-reported accounts are not repeated
    (7, "user3", 6, None),  # rule holds, nothing new to report
    # more than an hour with no new account from the ip: its state is gone, it is "normal" again
    (68, "user7", 1, None),
    (69, "user1", 2, None),
    (70, "user2", 3, None),
    (71, "user3", 4, None),
    (72, "user4", 5, ["user1", "user2", "user3", "user4", "user7"]),  # reported again: > 1h ago
]


def login(tid, t, user, ip="10.9.8.7", action="login"):
    return {"transactionId": tid, "eventTime": t, "userId": user, "ip": ip, "action": action}


def login_events() -> list[dict]:
    """The table's logins (ids l00, l01, ...) plus noise that must not change anything."""
    events = [login(f"l{i:02d}", T0 + m * MIN, u) for i, (m, u, _, _) in enumerate(LOGIN_TABLE)]
    # other ip, non-login action, login without ip
    events += [
        login("x1", T0 + 5 * MIN, "user9", ip="10.0.0.1"),
        login("x2", T0 + 5 * MIN, "user9", action="logout"),
        {"transactionId": "x3", "eventTime": T0 + 5 * MIN, "userId": "user8", "action": "login"},
    ]
    return events


def test_malicious_login_table_row_by_row():
    events = login_events()
    alerts = {a["transaction_id"]: a for a in oracle(events, [LOGIN_RULE])}
    for i, (m, user, distinct, reported) in enumerate(LOGIN_TABLE):
        tid = f"l{i:02d}"
        if reported is None:
            assert tid not in alerts, (m, user)
        else:
            a = alerts.pop(tid)
            assert a["values"] == reported, (m, user)
            assert a["aggregate_value"] == distinct, (m, user)
            assert a["group_key"] == "10.9.8.7" and a["rule_id"] == 7
    assert not alerts


def test_login_table_without_new_values_only_alerts_every_time():
    r = dict(LOGIN_RULE, reportNewValuesOnly=False)
    events = [login(f"l{i:02d}", T0 + m * MIN, u) for i, (m, u, _, _) in enumerate(LOGIN_TABLE)]
    alerts = oracle(events, [r])
    assert [a["transaction_id"] for a in alerts] == ["l05", "l06", "l07", "l12"]
    assert alerts[2]["values"] == ["user1", "user2", "user3", "user4", "user5", "user6"]
    assert alerts[2]["event_count"] == 8


def test_brief_rule_example_distinct_ips_per_account():
    r = {"ruleId": 2, "ruleState": "ACTIVE", "groupingKeyNames": ["userId"], "aggregateFieldName": "ip",
         "aggregatorFunctionType": "UNIQUE_COUNT", "limitOperatorType": "GREATER", "limit": 4,
         "window": "3m", "filter": {"action": "login"}}
    events = [login(f"e{i}", T0 + i * 30_000, "u1", ip=f"1.1.1.{i}") for i in range(5)]
    alerts = oracle(events, [r])
    assert [(a["transaction_id"], a["aggregate_value"]) for a in alerts] == [("e4", 5)]
    assert alerts[0]["values"] == [f"1.1.1.{i}" for i in range(5)]


# --- cooldown ----------------------------------------------------------------------------------------


def test_cooldown_suppresses_and_does_not_extend():
    r = rule(aggregatorFunctionType="COUNT", limitOperatorType=">=", limit=2, windowMinutes=None,
             window="10m", cooldown="5m", groupingKeyNames=["payeeId"])
    events = [pay(f"c{m}", T0 + m * MIN, 1) for m in (0, 1, 2, 3, 6, 7)]
    alerts = oracle(events, [r])
    # candidates at 1,2,3,6,7; alert at 1; 2,3 suppressed (< 1+5); 6 alerts (6 >= 6); 7 suppressed
    assert [a["transaction_id"] for a in alerts] == ["c1", "c6"]
    assert [a["aggregate_value"] for a in alerts] == [2, 5]
    # without cooldown every candidate alerts
    r.pop("cooldown")
    assert len(oracle(events, [r])) == 5


def test_cooldown_is_per_key():
    r = rule(aggregatorFunctionType="COUNT", limitOperatorType=">=", limit=1, cooldown="1h",
             groupingKeyNames=["payeeId"])
    events = [pay("a1", T0, 1, payee="A"), pay("b1", T0 + 1, 1, payee="B"), pay("a2", T0 + 2, 1, payee="A")]
    assert [a["transaction_id"] for a in oracle(events, [r])] == ["a1", "b1"]


def test_suppressed_candidate_reports_no_values():
    r = dict(LOGIN_RULE, limit=2, cooldown="10m")
    events = [login("a", T0, "ua"), login("b", T0 + MIN, "ub"), login("c", T0 + 2 * MIN, "uc"),
              login("d", T0 + 12 * MIN, "ud"), login("e", T0 + 13 * MIN, "ue")]
    alerts = oracle(events, [r])
    # a+b → alert [ua, ub] at 1m; c suppressed (2 < 11) so uc is not reported; d at 12m → [uc, ud];
    # e at 13m suppressed (13 < 22)
    assert [(a["transaction_id"], a["values"]) for a in alerts] == [("b", ["ua", "ub"]), ("d", ["uc", "ud"])]


# --- bucket mode ---------------------------------------------------------------------------------------


def test_bucket_mode_can_add_an_alert():
    exact = rule(groupingKeyNames=["payeeId"], windowMinutes=None, window="1m")
    bucketed = dict(exact, bucket="1m")
    events = [pay("b1", T0 + 30_000, 15), pay("b2", T0 + 100_000, 10)]
    assert oracle(events, [exact]) == []  # window [T0+40s, T0+100s] → 10
    alerts = oracle(events, [bucketed])
    assert brief(alerts) == [("b2", Decimal(25))]  # window starts at bucket boundary T0 → 25
    assert alerts[0]["window_start"] == T0 and alerts[0]["window_end"] == T0 + 100_000
    assert alerts[0]["event_count"] == 2


def test_bucket_start_on_boundary_is_unchanged():
    r = rule(groupingKeyNames=["payeeId"], windowMinutes=None, window="1m", bucket="1m")
    events = [pay("b1", T0 - 1, 15), pay("b2", T0 + MIN, 10)]
    # t - W = T0 is already a boundary: the event at T0-1ms stays outside
    assert oracle(events, [r]) == []


# --- aggregators, operators, rule fields -------------------------------------------------------------


def test_count_and_alias_count_flink():
    base = dict(groupingKeyNames=["payeeId"], limitOperatorType=">=", limit=3)
    events = [pay("t1", T0, None), pay("t2", T0 + 1, 5), pay("t3", T0 + 2, None)]
    for agg, field in [("COUNT", "paymentAmount"), ("COUNT_FLINK", "paymentAmount"),
                       ("SUM", "COUNT_FLINK"), ("COUNT_FLINK", "COUNT_FLINK")]:
        alerts = oracle(events, [rule(aggregatorFunctionType=agg, aggregateFieldName=field, **base)])
        assert [(a["transaction_id"], a["aggregate_value"]) for a in alerts] == [("t3", 3)], (agg, field)
        assert type(alerts[0]["aggregate_value"]) is int


def test_sum_ignores_nulls_and_is_decimal():
    events = [pay("t1", T0, "0.10"), pay("t2", T0 + 1, None), pay("t3", T0 + 2, "0.20")]
    alerts = oracle(events, [rule(groupingKeyNames=["payeeId"], limitOperatorType="EQUAL", limit="0.3")])
    assert brief(alerts) == [("t3", Decimal("0.30"))]
    assert alerts[0]["event_count"] == 3
    # SUM over no non-null values is 0 (and may alert); MIN/MAX/AVG over none is None and never alerts
    only_null = [pay("n1", T0, None)]
    assert brief(oracle(only_null, [rule(limitOperatorType="<", limit=1)])) == [("n1", Decimal(0))]
    for agg in ("MIN", "MAX", "AVG"):
        for opn in ("<", "!=", ">="):
            assert oracle(only_null, [rule(aggregatorFunctionType=agg, limitOperatorType=opn, limit=1)]) == []


def test_avg_exact_comparison_and_half_even_report():
    events = [pay("t1", T0, 10), pay("t2", T0 + 1, 10), pay("t3", T0 + 2, 11)]
    r = rule(aggregatorFunctionType="AVG", limit="10.3333333", groupingKeyNames=["payeeId"])
    alerts = oracle(events, [r])
    # exact mean 10.3333333333… > 10.3333333 although the reported (rounded) 10.333333 is not
    assert [a["transaction_id"] for a in alerts] == ["t3"]
    assert alerts[0]["aggregate_value"] == Decimal("10.333333")
    assert str(alerts[0]["aggregate_value"]) == "10.333333"
    r = rule(aggregatorFunctionType="AVG", limitOperatorType=">=", limit=0, groupingKeyNames=["payeeId"])
    half_down = oracle([pay("h1", T0, "0.000001"), pay("h2", T0 + 1, 0)], [r])
    assert half_down[-1]["aggregate_value"] == Decimal("0.000000")  # 0.0000005 → even 0
    half_up = oracle([pay("h1", T0, "0.000003"), pay("h2", T0 + 1, 0)], [r])
    assert half_up[-1]["aggregate_value"] == Decimal("0.000002")  # 0.0000015 → even 2


def test_min_max():
    events = [pay("t1", T0, 5), pay("t2", T0 + 1, None), pay("t3", T0 + 2, 30)]
    mx = oracle(events, [rule(aggregatorFunctionType="MAX", limitOperatorType=">=", limit=5)])
    assert brief(mx) == [("t1", Decimal(5)), ("t2", Decimal(5)), ("t3", Decimal(30))]
    mn = oracle(events, [rule(aggregatorFunctionType="MIN", limitOperatorType="<=", limit=5)])
    assert brief(mn) == [("t1", Decimal(5)), ("t2", Decimal(5)), ("t3", Decimal(5))]


@pytest.mark.parametrize(
    "op,expected",
    [
        ("GREATER", ["t3"]), (">", ["t3"]),
        ("GREATER_EQUAL", ["t2", "t3"]), (">=", ["t2", "t3"]),
        ("LESS", ["t1"]), ("<", ["t1"]),
        ("LESS_EQUAL", ["t1", "t2"]), ("<=", ["t1", "t2"]),
        ("EQUAL", ["t2"]), ("=", ["t2"]), ("==", ["t2"]),
        ("NOT_EQUAL", ["t1", "t3"]), ("!=", ["t1", "t3"]),
    ],
)
def test_operators(op, expected):
    events = [pay("t1", T0, 10), pay("t2", T0 + 1, 10), pay("t3", T0 + 2, 10)]  # sums 10, 20, 30
    alerts = oracle(events, [rule(limitOperatorType=op, limit="20.00")])
    assert [a["transaction_id"] for a in alerts] == expected


def test_rule_state_filter_and_missing_keys():
    events = [
        pay("t1", T0, 25, channel="web"),
        pay("t2", T0 + 1, 25, channel="app"),
        pay("t3", T0 + 2, 25, payee=None, channel="web"),  # missing grouping key → not evaluated
        pay("t4", T0 + 3, 25),  # no channel → fails the filter
        pay("t5", T0 + 4, 25, flagged=True),
    ]
    assert oracle(events, [rule(ruleState="PAUSE")]) == []
    assert oracle(events, [rule(ruleState="DELETE")]) == []
    no_state = rule()
    no_state.pop("ruleState")
    assert len(oracle(events, [no_state])) == 4
    alerts = oracle(events, [rule(filter={"channel": "web"})])
    assert [(a["transaction_id"], a["event_count"]) for a in alerts] == [("t1", 1)]
    alerts = oracle(events, [rule(filter={"flagged": True})])
    assert [a["transaction_id"] for a in alerts] == ["t5"]


def test_output_sorted_by_rule_time_id():
    r1, r2 = rule(ruleId=2, limit=0), rule(ruleId=1, limit=0)
    events = [pay("b", T0, 1), pay("a", T0, 1), pay("c", T0 - 1, 1)]
    keys = [(a["rule_id"], a["event_time"], a["transaction_id"]) for a in oracle(events, [r1, r2])]
    assert keys == sorted(keys) and len(keys) == 6


def test_parse_duration():
    assert parse_duration_ms("250ms") == 250
    assert parse_duration_ms("10s") == 10_000
    assert parse_duration_ms("3m") == 180_000
    assert parse_duration_ms("24h") == 86_400_000
    assert parse_duration_ms("90d") == 90 * 86_400_000
    with pytest.raises(ValueError):
        parse_duration_ms("3 minutes")
