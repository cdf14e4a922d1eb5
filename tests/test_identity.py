"""The identity rule for ids and keys (engine/identity.py), and rule filters held to it. No JVM."""

from __future__ import annotations

import pytest

from rulewatch.engine.identity import canonical, composed
from rulewatch.engine.rules import RuleError, parse_rule

RULE = {"ruleId": 1, "ruleState": "ACTIVE", "groupingKeyNames": ["payeeId"], "aggregateFieldName": "paymentAmount",
        "aggregatorFunctionType": "SUM", "limitOperatorType": "GREATER", "limit": 20, "windowMinutes": 60}  # fmt: skip


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("g", "g"),
        ("g ", "g"),
        ("\u00a0\u3000g\t\u200b\ufeff", "g"),
        ("cafe\u0301", "caf\u00e9"),  # NFD -> NFC
        (" caf\u00e9\u2003", "caf\u00e9"),
        ("caf e", "caf e"),  # inner white space is part of the id
        ("G", "G"),  # so is case
        ("\ufb01", "\ufb01"),  # NFC, not NFKC: the ligature stays
    ],
)
def test_ids_compare_trimmed_then_composed(raw, expected):
    assert canonical(raw) == expected


def test_composed_leaves_ascii_and_none_alone():
    assert composed(None) is None and composed("abc ") == "abc "


def test_a_rule_filter_is_held_to_the_same_rule():
    rule = parse_rule(RULE | {"filter": {"paymentType": " CSH\u00a0", "payeeId": "cafe\u0301"}})
    assert rule.filter == (("payeeId", "caf\u00e9"), ("paymentType", "CSH"))
    assert rule.passes_filter({"paymentType": "CSH", "payeeId": "caf\u00e9"})


def test_a_blank_filter_value_is_refused():
    with pytest.raises(RuleError, match="has a blank value for 'payeeId'"):
        parse_rule(RULE | {"filter": {"payeeId": " \u200b"}})
