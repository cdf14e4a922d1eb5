"""The hand-checked fixture set (fixtures/) agrees with the brute-force oracle.

Uses its own small JSON-lines parser (not rulewatch's) so that the fixture expectations are independent of the
implementation: epoch ms or ISO-8601 (with Z) → ms, paymentAmount → Decimal, invalid lines are quarantined with a
reason, later duplicates of a transactionId are dropped (first occurrence wins; files read in name order).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from datetime import datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from oracle import oracle  # noqa: E402

FIXTURES = HERE.parent / "fixtures"

EXPECTED_COUNTS = {
    "files": 3,
    "total_lines": 50,
    "quarantined": 6,
    "quarantined_by_reason": {
        "malformed_json": 1,
        "missing_transaction_id": 1,
        "missing_event_time": 1,
        "unparsable_event_time": 1,
        "non_numeric_amount": 1,
        "negative_amount": 1,
    },
    "duplicates": 2,
    "valid_events": 42,
}
EXPECTED_ALERTS_PER_RULE = {1: 3, 2: 4, 3: 3}


class Quarantined(Exception):
    pass


def _event_time_ms(value) -> int:
    if isinstance(value, bool):
        raise Quarantined("unparsable_event_time")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            dt = datetime.fromisoformat(value)
        except ValueError:
            raise Quarantined("unparsable_event_time") from None
        if dt.tzinfo is None:
            raise Quarantined("unparsable_event_time")
        return int(dt.timestamp() * 1000)  # fixtures use at most ms precision
    raise Quarantined("unparsable_event_time")


def _amount(value) -> Decimal | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise Quarantined("non_numeric_amount")
    try:
        amount = Decimal(str(value))
    except InvalidOperation:
        raise Quarantined("non_numeric_amount") from None
    if not amount.is_finite():
        raise Quarantined("non_numeric_amount")
    if amount < 0:
        raise Quarantined("negative_amount")
    return amount


def parse_line(line: str) -> dict:
    try:
        raw = json.loads(line, parse_float=Decimal)
    except json.JSONDecodeError:
        raise Quarantined("malformed_json") from None
    if not isinstance(raw, dict):
        raise Quarantined("malformed_json")
    if not raw.get("transactionId"):
        raise Quarantined("missing_transaction_id")
    if raw.get("eventTime") is None:
        raise Quarantined("missing_event_time")
    event = {"transactionId": str(raw["transactionId"]), "eventTime": _event_time_ms(raw["eventTime"])}
    for field in ("payeeId", "beneficiaryId", "paymentType", "userId", "ip", "action"):
        v = raw.get(field)
        event[field] = None if v is None else str(v)
    event["paymentAmount"] = _amount(raw.get("paymentAmount"))
    return event


def load_fixture_events(keep_duplicates: bool = False):
    counts = Counter()
    reasons = Counter()
    events, seen_ids = [], set()
    files = sorted((FIXTURES / "transactions").glob("*.jsonl"))
    counts["files"] = len(files)
    for path in files:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            counts["total_lines"] += 1
            try:
                event = parse_line(line)
            except Quarantined as q:
                reasons[str(q)] += 1
                continue
            if event["transactionId"] in seen_ids:
                counts["duplicates"] += 1
                if not keep_duplicates:
                    continue
            seen_ids.add(event["transactionId"])
            events.append(event)
    counts["quarantined"] = sum(reasons.values())
    counts["valid_events"] = len(events) - (counts["duplicates"] if keep_duplicates else 0)
    counts["quarantined_by_reason"] = dict(reasons)
    return events, dict(counts)


def load_rules():
    return json.loads((FIXTURES / "rules.json").read_text())


def load_expected():
    return json.loads((FIXTURES / "expected_alerts.json").read_text())


def _comparable(alert: dict) -> tuple:
    v = alert["aggregate_value"]
    v = Decimal(v) if isinstance(v, str) else v
    return (alert["rule_id"], alert["transaction_id"], alert["group_key"], v, alert["event_count"])


def test_fixture_counts():
    _, counts = load_fixture_events()
    assert counts == EXPECTED_COUNTS


def test_fixture_parser_formats():
    events = {e["transactionId"]: e for e in load_fixture_events()[0]}
    assert events["pay-d1"]["eventTime"] == 1_793_527_200_000  # ISO "2026-11-01T10:00:00Z"
    assert events["pay-a1"]["eventTime"] == 1_793_527_200_000  # epoch ms
    assert events["pay-d5"]["eventTime"] == 1_793_527_801_500  # ISO with .500
    assert events["pay-a4"]["paymentAmount"] == Decimal("250.50")  # numeric string
    assert events["pay-d4"]["paymentAmount"] == Decimal("9.99")  # JSON number, not float
    assert events["login-l1"]["paymentAmount"] is None


def test_fixture_rules_are_reference_format():
    rules = load_rules()
    assert [r["ruleId"] for r in rules] == [1, 2, 3, 4]
    assert all(r.get("description") for r in rules)
    assert [r["ruleState"] for r in rules] == ["ACTIVE", "ACTIVE", "ACTIVE", "PAUSE"]
    assert rules[1]["aggregatorFunctionType"] == "COUNT_FLINK"


def test_fixture_alerts_match_oracle():
    events, _ = load_fixture_events()
    got = oracle(events, load_rules())
    expected = load_expected()
    assert [_comparable(a) for a in got] == [_comparable(a) for a in expected]
    per_rule = Counter(a["rule_id"] for a in expected)
    assert dict(per_rule) == EXPECTED_ALERTS_PER_RULE


def test_expected_alerts_file_shape():
    for a in load_expected():
        assert set(a) == {"rule_id", "transaction_id", "group_key", "aggregate_value", "event_count"}
        if a["rule_id"] == 1:
            assert isinstance(a["aggregate_value"], str)
        else:
            assert isinstance(a["aggregate_value"], int)


# --- the fixtures are sensitive: each trap changes the alerts if mishandled ----------------------------


def _ids(alerts, rule_id=None):
    return [a["transaction_id"] for a in alerts if rule_id is None or a["rule_id"] == rule_id]


def test_keeping_duplicates_would_add_alerts():
    events, counts = load_fixture_events(keep_duplicates=True)
    assert len(events) == EXPECTED_COUNTS["valid_events"] + EXPECTED_COUNTS["duplicates"]
    got = oracle(events, load_rules())
    extra = sorted(set(_ids(got)) - set(_ids(load_expected())))
    assert extra == ["pay-a2", "pay-d4", "pay-d5"]  # 350 counted twice; pay-d3 counted twice


def test_accepting_negative_or_abc_amounts_would_change_alerts():
    events, _ = load_fixture_events()
    neg = {"transactionId": "bad-neg-1", "eventTime": 1_793_529_300_000, "payeeId": "payee-B",
           "beneficiaryId": "ben-2", "paymentType": "CRD", "paymentAmount": Decimal(-100)}
    assert "pay-b3" not in _ids(oracle(events + [neg], load_rules()), 1)  # 901 instead of 1001
    abc = {"transactionId": "bad-abc-1", "eventTime": 1_793_530_440_000, "payeeId": "payee-C",
           "beneficiaryId": "ben-5", "paymentType": "CRD", "paymentAmount": None}
    assert "pay-c8" in _ids(oracle(events + [abc], load_rules()), 2)  # 5 in [10:54, 11:04]


def test_ignoring_the_login_filter_would_add_alerts():
    events, _ = load_fixture_events()
    rules = load_rules()
    del rules[2]["filter"]
    assert _ids(oracle(events, rules), 3) == ["login-l5", "login-l6", "login-l7", "logout-m5", "login-m6", "login-m7"]


def test_paused_rule_would_fire_if_active():
    events, _ = load_fixture_events()
    rules = load_rules()
    rules[3]["ruleState"] = "ACTIVE"
    assert _ids(oracle(events, rules), 4) == ["pay-b1", "pay-a3", "pay-a4", "pay-b2", "pay-a5", "pay-b3"]


@pytest.mark.parametrize("ids_reversed", [False, True])
def test_same_timestamp_tie_is_broken_by_id(ids_reversed):
    events, _ = load_fixture_events()
    if ids_reversed:  # swap the ids of the two 10:53:00 payments: the other one becomes 5th
        for e in events:
            if e["transactionId"] in ("pay-c4a", "pay-c4b"):
                e["transactionId"] = {"pay-c4a": "pay-c4b", "pay-c4b": "pay-c4a"}[e["transactionId"]]
    got = [a for a in oracle(events, load_rules()) if a["event_count"] == 5 and a["rule_id"] == 2]
    assert got[0]["transaction_id"] == "pay-c4b"
