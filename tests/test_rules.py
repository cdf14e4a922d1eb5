"""Tests for the rule model and parser (pure Python, no Spark)."""

from __future__ import annotations

import json
import os
import pickle
import socket
import threading
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rulewatch.engine.identity import canonical
from rulewatch.engine import rules as rules_module
from rulewatch.engine.rules import (
    DURATION_FORMS,
    EVENT_FIELDS,
    MAX_RULE_ID,
    MAX_RULES_FILE_BYTES,
    NUMERIC_FIELDS,
    Aggregator,
    Operator,
    Rule,
    RuleError,
    RuleSetError,
    RuleState,
    format_duration,
    load_rules_file,
    parse_duration,
    parse_rule,
    parse_rules,
)

DROP = object()  # marks a field to remove from the base rule


def rule_json(**changes: Any) -> dict[str, Any]:
    """A valid rule (the reference SUM > 20 rule) with some fields changed or dropped."""
    base: dict[str, Any] = {
        "ruleId": 7,
        "groupingKeyNames": ["payeeId", "paymentType"],
        "aggregateFieldName": "paymentAmount",
        "aggregatorFunctionType": "SUM",
        "limitOperatorType": "GREATER",
        "limit": 20,
        "window": "24h",
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not DROP}


def rule_error(**changes: Any) -> RuleError:
    with pytest.raises(RuleError) as caught:
        parse_rule(rule_json(**changes))
    return caught.value


def test_reference_example_parses_with_defaults() -> None:
    rule = parse_rule(
        json.loads(
            '{"ruleId":2,"ruleState":"ACTIVE","groupingKeyNames":["userId"],"aggregateFieldName":"ip",'
            '"aggregatorFunctionType":"UNIQUE_COUNT","limitOperatorType":"GREATER","limit":4,"window":"3m",'
            '"filter":{"action":"login"}}'
        )
    )
    assert rule == Rule(
        rule_id=2,
        state=RuleState.ACTIVE,
        grouping_keys=("userId",),
        aggregate_field="ip",
        aggregator=Aggregator.UNIQUE_COUNT,
        operator=Operator.GREATER,
        limit=Decimal(4),
        window_ms=180_000,
        filter=(("action", "login"),),
    )
    assert parse_rule(rule_json()).state is RuleState.ACTIVE  # ruleState defaults to ACTIVE


def test_keyset_keeps_grouping_key_order() -> None:
    assert parse_rule(rule_json(groupingKeyNames=["payeeId", "beneficiaryId"])).keyset == "payeeId,beneficiaryId"
    assert parse_rule(rule_json(groupingKeyNames=["beneficiaryId", "payeeId"])).keyset == "beneficiaryId,payeeId"


@pytest.mark.parametrize(
    ("name", "spellings", "truth_at_19_20_21"),
    [
        ("GREATER", [">"], (False, False, True)),
        ("GREATER_EQUAL", [">="], (False, True, True)),
        ("LESS", ["<"], (True, False, False)),
        ("LESS_EQUAL", ["<="], (True, True, False)),
        ("EQUAL", ["=", "=="], (False, True, False)),
        ("NOT_EQUAL", ["!="], (True, False, True)),
    ],
)
def test_operator_names_symbols_and_holds(name: str, spellings: list[str], truth_at_19_20_21: tuple[bool, ...]) -> None:
    operator = Operator[name]
    assert operator.symbol == spellings[0]
    for spelling in [name, *spellings]:
        assert parse_rule(rule_json(limitOperatorType=spelling)).operator is operator
    limit = Decimal(20)
    assert tuple(operator.holds(Decimal(v), limit) for v in (19, 20, 21)) == truth_at_19_20_21


def test_count_flink_is_an_alias_of_count() -> None:
    rule = parse_rule(rule_json(aggregatorFunctionType="COUNT_FLINK"))
    assert rule.aggregator is Aggregator.COUNT
    assert rule.to_json()["aggregatorFunctionType"] == "COUNT"


def test_window_minutes_and_window_string_are_equivalent() -> None:
    by_minutes = parse_rule(rule_json(window=DROP, windowMinutes=1440))
    assert by_minutes.window_ms == 86_400_000
    assert by_minutes == parse_rule(rule_json(window="24h"))
    assert by_minutes.to_json()["window"] == "1d"


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"windowMinutes": 60}, "both given; give exactly one"),
        ({"window": DROP}, "is missing; give exactly one of 'window'"),
    ],
)
def test_exactly_one_window_field_is_required(changes: dict[str, Any], expected: str) -> None:
    error = rule_error(**changes)
    assert (error.rule_id, error.field) == (7, "window")
    assert expected in str(error)


def test_error_message_names_rule_field_value_and_allowed_values() -> None:
    error = rule_error(aggregatorFunctionType="SUMM")
    assert str(error) == (
        "rule 7: field 'aggregatorFunctionType' has 'SUMM'; "
        "allowed: SUM, COUNT, AVG, MIN, MAX, UNIQUE_COUNT (alias COUNT_FLINK); did you mean 'SUM'?"
    )
    assert (error.rule_id, error.field) == (7, "aggregatorFunctionType")
    assert pickle.loads(pickle.dumps(error)).reason == error.reason


ALL_FIELDS = ", ".join(EVENT_FIELDS)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("ruleState", "RUNNING", "allowed: ACTIVE, PAUSE, DELETE"),
        ("ruleState", "active", "allowed: ACTIVE, PAUSE, DELETE"),
        ("aggregatorFunctionType", DROP, "is missing; allowed: SUM, COUNT"),
        ("limitOperatorType", ">>", "allowed: GREATER (>), GREATER_EQUAL (>=), LESS (<), LESS_EQUAL (<=), EQUAL (= or ==)"),
        ("aggregateFieldName", "amount", f"allowed: {ALL_FIELDS}"),
        ("aggregateFieldName", "eventTime", f"allowed: {ALL_FIELDS}"),
        ("groupingKeyNames", ["payee"], f"has 'payee'; allowed: {ALL_FIELDS}"),
        ("groupingKeyNames", [], "a non-empty list"),
        ("groupingKeyNames", "payeeId", "a non-empty list"),
        ("groupingKeyNames", ["ip", "ip"], "lists 'ip' more than once"),
        ("limit", "abc", "a finite number"),
        ("limit", "Infinity", "a finite number"),
        ("limit", float("nan"), "a finite number"),
        ("limit", "1_000", "a finite number"),
        ("limit", True, "a finite number"),
        ("limit", DROP, "is missing; allowed: a finite number"),
        ("window", "24 h", DURATION_FORMS),
        ("windowMinutes", 0, "a positive integer"),
        ("cooldown", "soon", DURATION_FORMS),
        ("bucket", "1d", "shorter than the window (1d)"),
        ("bucket", "7m", "divides it exactly"),
        ("filter", ["action"], "an object mapping event fields to values"),
        ("filter", {"country": "DE"}, f"has key 'country'; allowed: {ALL_FIELDS}"),
        ("filter", {"action": {"eq": "login"}}, "for 'action'; allowed: a string, number or boolean"),
        ("filter", {"action": None}, "for 'action'; allowed: a string, number or boolean"),
        ("reportNewValuesOnly", "yes", "allowed: true, false"),
        ("description", 5, "allowed: a string"),
    ],
)
def test_bad_field_error_names_rule_field_and_allowed(field: str, value: Any, allowed: str) -> None:
    changes = {field: value}
    if field == "windowMinutes":
        changes["window"] = DROP
    error = rule_error(**changes)
    assert (error.rule_id, error.field) == (7, field)
    assert str(error).startswith(f"rule 7: field '{field}' ")
    assert allowed in str(error)


@pytest.mark.parametrize("bad_id", [DROP, 0, -1, True, "7", 7.0, None])
def test_bad_rule_id_has_no_rule_id(bad_id: Any) -> None:
    error = rule_error(ruleId=bad_id)
    assert (error.rule_id, error.field) == (None, "ruleId")
    assert "allowed: a positive integer" in str(error)


@pytest.mark.parametrize("bad_id", [2**31, -(2**31) - 1, 10**20])
def test_rule_id_beyond_the_tables_int_column_is_rejected_with_the_range(bad_id: int) -> None:
    error = rule_error(ruleId=bad_id)
    assert (error.rule_id, error.field) == (None, "ruleId")
    assert str(error) == f"field 'ruleId' has {bad_id}; allowed: a positive integer between 1 and 2147483647 (config/rules stores ruleId as int)"
    with pytest.raises(RuleSetError, match=r"item 2: field 'ruleId' has .*between 1 and 2147483647"):
        parse_rules([rule_json(ruleId=1), rule_json(ruleId=bad_id)])


def test_the_largest_int_is_a_valid_rule_id() -> None:
    assert MAX_RULE_ID == 2**31 - 1  # Spark's IntegerType.MaxValue
    assert parse_rule(rule_json(ruleId=MAX_RULE_ID)).rule_id == MAX_RULE_ID


@pytest.mark.parametrize("minutes", [-5, 1.5, True, "60"])
def test_window_minutes_must_be_a_positive_integer(minutes: Any) -> None:
    assert rule_error(window=DROP, windowMinutes=minutes).field == "windowMinutes"


@pytest.mark.parametrize("unknown", ["windowSize", "RuleId", "limitOperator", "sql"])
def test_unknown_field_is_rejected_with_the_accepted_fields(unknown: str) -> None:
    error = rule_error(**{unknown: 1})
    assert (error.rule_id, error.field) == (7, unknown)
    assert "is not a rule field; allowed: ruleId, ruleState, groupingKeyNames" in str(error)


def test_non_object_rule_is_rejected() -> None:
    with pytest.raises(RuleError, match="expected a JSON object"):
        parse_rule(["ruleId", 7])  # type: ignore[arg-type]


@pytest.mark.parametrize("aggregator", ["SUM", "AVG", "MIN", "MAX"])
def test_numeric_aggregators_need_a_numeric_field(aggregator: str) -> None:
    error = rule_error(aggregatorFunctionType=aggregator, aggregateFieldName="userId")
    assert error.field == "aggregateFieldName"
    assert f"{aggregator} needs a numeric field; allowed: paymentAmount" in str(error)


@pytest.mark.parametrize("aggregator", ["COUNT", "UNIQUE_COUNT"])
def test_counting_aggregators_accept_any_field(aggregator: str) -> None:
    assert parse_rule(rule_json(aggregatorFunctionType=aggregator, aggregateFieldName="userId")).aggregate_field == "userId"


def test_report_new_values_only_needs_unique_count() -> None:
    assert rule_error(reportNewValuesOnly=True).field == "reportNewValuesOnly"
    rule = parse_rule(rule_json(aggregatorFunctionType="UNIQUE_COUNT", reportNewValuesOnly=True))
    assert rule.report_new_values_only


def test_optional_durations() -> None:
    rule = parse_rule(rule_json(window="1h", bucket="1m", cooldown="10s"))
    assert (rule.window_ms, rule.bucket_ms, rule.cooldown_ms) == (3_600_000, 60_000, 10_000)
    assert (parse_rule(rule_json()).bucket_ms, parse_rule(rule_json()).cooldown_ms) == (0, 0)


def test_limit_is_an_exact_decimal() -> None:
    assert parse_rule(rule_json(limit=0.1)).limit == Decimal("0.1")
    assert parse_rule(rule_json(limit="-2.50")).limit == Decimal("-2.5")
    many_digits = "12.345678901234567890123"
    [rule] = parse_rules(json.dumps([rule_json(limit="LIMIT")]).replace('"LIMIT"', many_digits))
    assert rule.limit == Decimal(many_digits)  # JSON text is read without a detour through float
    assert parse_rule(json.loads(json.dumps(rule.to_json()))) == rule


def test_filter_passes_only_when_every_condition_matches() -> None:
    rule = parse_rule(rule_json(filter={"paymentType": "CSH", "action": "pay"}))
    assert rule.filter == (("action", "pay"), ("paymentType", "CSH"))  # sorted by field
    assert rule.passes_filter({"action": "pay", "paymentType": "CSH", "payeeId": "p1"})
    assert not rule.passes_filter({"action": "pay", "paymentType": "CRD"})
    assert not rule.passes_filter({"action": "pay"})
    assert not rule.passes_filter({"action": "pay", "paymentType": None})
    assert parse_rule(rule_json()).passes_filter({})  # no filter: every event passes


def test_filter_scalars_are_stored_as_text() -> None:
    rule = parse_rule(rule_json(filter={"payeeId": 42, "action": True, "ip": "10.0.0.1"}))
    assert rule.filter == (("action", "true"), ("ip", "10.0.0.1"), ("payeeId", "42"))
    assert rule.passes_filter({"payeeId": 42, "action": "true", "ip": "10.0.0.1"})
    assert rule.passes_filter({"payeeId": "42", "action": "true", "ip": "10.0.0.1"})


@pytest.mark.parametrize("hostile", ["x' OR 1=1 --", "'; DROP TABLE rules; --", "__import__('os').system('x')", "`id`"])
def test_injection_looking_strings_are_kept_as_plain_values(hostile: str) -> None:
    rule = parse_rule(rule_json(filter={"payeeId": hostile}, description=hostile))
    assert rule.filter == (("payeeId", hostile),)
    assert rule.description == hostile
    assert rule.passes_filter({"payeeId": hostile})
    assert not rule.passes_filter({"payeeId": "x"})
    assert parse_rule(rule.to_json()) == rule


@pytest.mark.parametrize(
    ("text", "ms"),
    [("1ms", 1), ("250ms", 250), ("10s", 10_000), ("3m", 180_000), ("24h", 86_400_000), ("90d", 7_776_000_000)],
)
def test_parse_duration_accepts_integer_and_unit(text: str, ms: int) -> None:
    assert parse_duration(text) == ms


@pytest.mark.parametrize(
    "text",
    ["", "10", "s", "0s", "0ms", "-3m", "+3m", "1.5h", "10 s", " 10s", "10s ", "10S", "10sec", "1w", "010s",
     "١٠s", "99999999999999999d", None, 10],
)
def test_parse_duration_rejects_everything_else(text: Any) -> None:
    with pytest.raises(ValueError) as caught:
        parse_duration(text)
    assert repr(text) in str(caught.value)
    assert "ms, s, m, h or d" in str(caught.value)


@pytest.mark.parametrize(
    ("ms", "text"),
    [(7_776_000_000, "90d"), (86_400_000, "1d"), (90_000_000, "25h"), (180_000, "3m"), (90_000, "90s"), (1500, "1500ms")],
)
def test_format_duration_is_the_most_compact_exact_form(ms: int, text: str) -> None:
    assert format_duration(ms) == text
    assert parse_duration(text) == ms


def test_format_duration_rejects_non_positive() -> None:
    with pytest.raises(ValueError):
        format_duration(0)


def test_to_json_omits_defaults_and_emits_numbers() -> None:
    assert parse_rule(rule_json(window=DROP, windowMinutes=90)).to_json() == {
        "ruleId": 7,
        "ruleState": "ACTIVE",
        "groupingKeyNames": ["payeeId", "paymentType"],
        "aggregateFieldName": "paymentAmount",
        "aggregatorFunctionType": "SUM",
        "limitOperatorType": "GREATER",
        "limit": 20,
        "window": "90m",
    }
    full = parse_rule(
        rule_json(limit="20.5", ruleState="PAUSE", filter={"action": "pay"}, cooldown="1m", bucket="1h", description="d")
    ).to_json()
    assert json.loads(json.dumps(full)) == rule_json(
        limit=20.5, ruleState="PAUSE", filter={"action": "pay"}, cooldown="1m", bucket="1h", description="d", window="1d"
    )


# What a parsed filter holds: values already in the identity rule's form, never blank.
FILTER_VALUES = st.text().map(canonical).filter(bool)


@st.composite
def valid_rules(draw: st.DrawFn) -> Rule:
    aggregator = draw(st.sampled_from(Aggregator))
    numeric_only = aggregator not in (Aggregator.COUNT, Aggregator.UNIQUE_COUNT)
    bucket_ms = draw(st.integers(0, 10**9))
    window_ms = bucket_ms * draw(st.integers(2, 1000)) if bucket_ms else draw(st.integers(1, 10**13))
    return Rule(
        rule_id=draw(st.integers(1, MAX_RULE_ID)),
        state=draw(st.sampled_from(RuleState)),
        grouping_keys=tuple(draw(st.lists(st.sampled_from(list(EVENT_FIELDS)), min_size=1, unique=True))),
        aggregate_field=draw(st.sampled_from(sorted(NUMERIC_FIELDS) if numeric_only else list(EVENT_FIELDS))),
        aggregator=aggregator,
        operator=draw(st.sampled_from(Operator)),
        limit=draw(st.decimals(allow_nan=False, allow_infinity=False)),
        window_ms=window_ms,
        filter=tuple(sorted(draw(st.dictionaries(st.sampled_from(list(EVENT_FIELDS)), FILTER_VALUES, max_size=3)).items())),
        cooldown_ms=draw(st.integers(0, 10**13)),
        report_new_values_only=aggregator is Aggregator.UNIQUE_COUNT and draw(st.booleans()),
        bucket_ms=bucket_ms,
        description=draw(st.text()),
    )


@given(valid_rules())
def test_to_json_round_trips_through_parse(rule: Rule) -> None:
    assert parse_rule(rule.to_json()) == rule
    as_line = json.dumps(rule.to_json(), ensure_ascii=False)
    assert parse_rules(as_line) == [rule]
    assert parse_rules(f"[{as_line}]") == [rule]


def test_array_lines_list_and_bytes_inputs_agree() -> None:
    objects = [rule_json(ruleId=1), rule_json(ruleId=2, aggregatorFunctionType="COUNT_FLINK")]
    expected = parse_rules(objects)
    assert [r.rule_id for r in expected] == [1, 2]
    lines = "\n".join(json.dumps(o) for o in objects)
    assert parse_rules(json.dumps(objects, indent=2)) == expected
    assert parse_rules("\n" + lines.replace("\n", "\n\n  \r\n") + "\n") == expected
    assert parse_rules(("\ufeff" + lines).encode()) == expected
    assert parse_rules("") == parse_rules("[]") == []


def test_all_errors_in_a_source_are_listed_with_their_location() -> None:
    text = "\n".join(
        [
            json.dumps(rule_json(ruleId=1)),
            json.dumps(rule_json(ruleId=2, aggregatorFunctionType="SUMM")),
            json.dumps(rule_json(ruleId=1)),
            "{not json",
            json.dumps(rule_json(ruleId=5, limit="lots")),
        ]
    )
    with pytest.raises(RuleSetError) as caught:
        parse_rules(text)
    error = caught.value
    assert [(e.rule_id, e.field) for e in error.errors] == [(2, "aggregatorFunctionType"), (1, "ruleId"), (None, ""), (5, "limit")]
    assert error.locations == ["line 2", "line 3", "line 4", "line 5"]
    message = str(error)
    assert message.startswith("4 invalid rule(s):")
    assert "line 3: rule 1: field 'ruleId' repeats the ruleId of line 1" in message
    assert "line 4: not valid JSON" in message
    assert all(str(e) in message for e in error.errors)


def test_every_wrong_field_of_a_rule_is_reported_at_once_with_the_closest_name() -> None:
    bad = rule_json(ruleId=3, groupingKeyNames=["payeId"], aggregateFieldName="paymentAmont",
                    aggregatorFunctionType="sum", limit="lots", windowMinuts=10)  # fmt: skip
    with pytest.raises(RuleSetError) as caught:
        parse_rules([bad, rule_json(ruleId=4, ruleState="ACTIV", limitOperatorType="GREATER", filter={"acton": "login"})])
    error = caught.value
    found = {(e.rule_id, e.field): e.reason for e in error.errors}
    assert set(found) == {(3, "windowMinuts"), (3, "groupingKeyNames"), (3, "aggregateFieldName"),
                          (3, "aggregatorFunctionType"), (3, "limit"), (4, "ruleState"), (4, "filter")}  # fmt: skip
    assert found[(3, "windowMinuts")].endswith("did you mean 'windowMinutes'?")
    assert found[(3, "groupingKeyNames")].endswith("did you mean 'payeeId'?")
    assert found[(3, "aggregateFieldName")].endswith("did you mean 'paymentAmount'?")
    assert found[(3, "aggregatorFunctionType")].endswith("did you mean 'SUM'?")  # case differs only
    assert "did you mean" not in found[(3, "limit")]  # nothing close to a number
    assert found[(4, "ruleState")].endswith("did you mean 'ACTIVE'?") and found[(4, "filter")].endswith("did you mean 'action'?")
    assert error.locations == ["item 1"] * 5 + ["item 2"] * 2
    assert str(error).startswith("2 invalid rule(s), 7 problems:")


def test_a_field_that_depends_on_a_wrong_one_is_not_blamed_too() -> None:
    # The numeric-field check needs a valid aggregator; with the aggregator wrong, only it is reported.
    error = rule_error(aggregatorFunctionType="AVERAGE", aggregateFieldName="payeeId")
    assert (error.field, type(error)) == ("aggregatorFunctionType", RuleError)


def test_broken_json_array_is_one_error() -> None:
    with pytest.raises(RuleSetError, match="not valid JSON") as caught:
        parse_rules('[{"ruleId": 1},')
    assert len(caught.value.errors) == 1


def test_load_rules_file_names_the_file(tmp_path: Any) -> None:
    good = tmp_path / "rules.json"
    good.write_text(json.dumps([rule_json()]))
    assert [r.rule_id for r in load_rules_file(good)] == [7]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rule_json(limitOperatorType="~")))
    with pytest.raises(RuleSetError) as caught:
        load_rules_file(bad)
    assert str(caught.value).startswith(f"1 invalid rule(s) in {bad}:")
    assert "line 1: rule 7: field 'limitOperatorType'" in str(caught.value)

    with pytest.raises(RuleSetError, match="missing.json"):
        load_rules_file(tmp_path / "missing.json")


def refusal(path: Any, seconds: float = 5.0) -> str:
    """The RuleSetError text load_rules_file(path) raises, read in a thread so that a load which
    blocks (on a FIFO without a writer) fails the test instead of hanging the suite."""
    outcome: list[BaseException | object] = []

    def load() -> None:
        try:
            outcome.append(load_rules_file(path))
        except BaseException as err:  # noqa: BLE001 - handed to the test thread
            outcome.append(err)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # a writer that ends at once: the blocked read sees EOF
        pytest.fail(f"load_rules_file({path}) still running after {seconds} s")
    assert len(outcome) == 1 and isinstance(outcome[0], RuleSetError), outcome
    return str(outcome[0])


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Any) -> None:
    fifo = tmp_path / "rules.json"
    os.mkfifo(fifo)
    assert refusal(fifo) == f"1 invalid rule(s) in {fifo}:\n  is a named pipe (FIFO), not a regular file; give the path of a rules file"


def test_a_folder_a_device_or_a_socket_is_refused(tmp_path: Any) -> None:
    assert "is a folder, not a regular file" in refusal(tmp_path)
    # /dev/null rather than /dev/zero: should the check regress, the endless read would not stop at the timeout.
    assert refusal("/dev/null").startswith("1 invalid rule(s) in /dev/null:\n  is a character device, not a regular file")
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(tmp_path / "rules.sock"))
        assert "is a socket, not a regular file" in refusal(tmp_path / "rules.sock")


def test_a_rules_file_over_the_size_limit_is_refused_unread(tmp_path: Any) -> None:
    huge = tmp_path / "rules.json"
    with open(huge, "wb") as handle:
        handle.truncate(MAX_RULES_FILE_BYTES + 1)  # sparse: no disk used
    assert f"is larger than 10 MiB, the most a rules file may hold ({MAX_RULES_FILE_BYTES + 1} bytes)" in refusal(huge)


def test_a_file_whose_size_stat_does_not_tell_is_read_only_up_to_the_limit(monkeypatch: Any) -> None:
    """/proc files are regular files of size 0 whatever they hold: the bounded read still stops them."""
    monkeypatch.setattr(rules_module, "MAX_RULES_FILE_BYTES", 64)
    assert os.stat("/proc/self/status").st_size == 0
    refused = refusal("/proc/self/status")
    assert "is larger than" in refused and refused.endswith("the most a rules file may hold")


@pytest.mark.parametrize("aggregator", ["SUM", "COUNT", "COUNT_FLINK"])
def test_count_flink_field_name_counts_events(aggregator):
    """The reference spelled 'count events' as SUM over the magic field COUNT_FLINK."""
    rule = parse_rule({"ruleId": 9, "groupingKeyNames": ["payeeId"], "aggregateFieldName": "COUNT_FLINK",
                       "aggregatorFunctionType": aggregator, "limitOperatorType": ">", "limit": 3, "windowMinutes": 5})
    assert rule.aggregator is Aggregator.COUNT
    assert parse_rule(rule.to_json()) == rule


def test_count_flink_field_with_max_is_rejected():
    with pytest.raises(RuleError, match="aggregatorFunctionType"):
        parse_rule({"ruleId": 9, "groupingKeyNames": ["payeeId"], "aggregateFieldName": "COUNT_FLINK",
                    "aggregatorFunctionType": "MAX", "limitOperatorType": ">", "limit": 3, "windowMinutes": 5})


def test_a_deletion_only_needs_the_rule_id():
    rules = parse_rules('[{"ruleId": 9, "ruleState": "DELETE"}]')
    assert [(r.rule_id, r.state) for r in rules] == [(9, RuleState.DELETE)]
    assert rules[0].to_json() == {"ruleId": 9, "ruleState": "DELETE"}
    with pytest.raises(RuleError, match="groupingKeyNames"):
        parse_rule({"ruleId": 9, "ruleState": "PAUSE"})  # only deletions may omit the rule body
