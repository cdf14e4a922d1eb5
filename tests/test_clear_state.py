"""``rules clear-state`` refuses a clear point that would switch a rule off silently or do nothing.

The checks are pure functions (fast tier); one test runs the command end to end on Spark and Delta.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pytest

from rulewatch.cli.main import main
from rulewatch.spark.control.commands import as_utc, clear_point_problem, future_clear_point, utc_text

NOW = datetime(2026, 11, 2, 12, 0, tzinfo=timezone.utc)
OLDEST = datetime(2026, 11, 1, 10, 0, tzinfo=timezone.utc)
NEWEST = datetime(2026, 11, 1, 11, 15, tzinfo=timezone.utc)


def problem(before: datetime, newest: datetime = NEWEST, tolerance: str = "5m") -> str | None:
    return clear_point_problem(before, OLDEST, newest, NOW, tolerance)


@pytest.mark.parametrize("before", [OLDEST, OLDEST + timedelta(minutes=30), NEWEST, NEWEST + timedelta(microseconds=999)])
def test_a_clear_point_within_the_events_seen_is_accepted(before):
    """Both ends count; the evaluator compares whole milliseconds, so the newest event's millisecond is within."""
    assert problem(before) is None


def test_a_clear_point_past_the_newest_event_is_refused_naming_it():
    message = problem(NEWEST + timedelta(milliseconds=1))
    assert message == (
        "--before 2026-11-01 11:15:00.001 UTC is later than the newest event in silver (2026-11-01 11:15:00.000 UTC): "
        "the rule would also ignore events not yet seen, up to then. Omit --before to clear up to the newest event."
    )


def test_a_clear_point_before_the_oldest_event_is_refused_as_doing_nothing():
    message = problem(OLDEST - timedelta(milliseconds=1))
    assert message == (
        "--before 2026-11-01 09:59:59.999 UTC is earlier than the oldest event in silver (2026-11-01 10:00:00.000 UTC), "
        "so clearing up to then has no effect. Give a time from then to 2026-11-01 11:15:00.000 UTC, or omit --before "
        "for the newest event."
    )


def test_a_future_clear_point_is_refused_as_such_whatever_silver_holds():
    later = NOW + timedelta(minutes=5, milliseconds=1)
    expected = (
        "--before 2026-11-02 12:05:00.001 UTC is in the future (now: 2026-11-02 12:00:00.000 UTC; silver accepts event "
        "times at most 5m ahead, RULEWATCH_FUTURE_TOLERANCE): the rule would ignore every new event up to then. "
        "Omit --before to clear up to the newest event in silver."
    )
    assert future_clear_point(later, NOW, "5m") == expected == problem(later)
    assert future_clear_point(NOW + timedelta(minutes=5), NOW, "5m") is None
    assert "15m ahead" in future_clear_point(NOW + timedelta(hours=1), NOW, "15m")
    # Silver may hold events up to the tolerance ahead of now: clearing up to one of them is fine.
    assert problem(NOW + timedelta(minutes=4), newest=NOW + timedelta(minutes=4)) is None


def test_a_time_without_a_zone_is_utc_as_in_silver():
    assert as_utc(datetime(2026, 11, 1, 12, 0)) == datetime(2026, 11, 1, 12, 0, tzinfo=timezone.utc)
    two_hours_east = timezone(timedelta(hours=2))
    assert utc_text(datetime(2026, 11, 1, 14, 0, tzinfo=two_hours_east)) == "2026-11-01 12:00:00.000 UTC"
    assert problem(datetime(2026, 11, 1, 13, 0, tzinfo=two_hours_east)) is None  # 11:00 UTC, within


@pytest.mark.parametrize(
    ("before", "shown"),
    [("2999-01-01T00:00:00", "2999-01-01 00:00:00.000 UTC"), ("2999-01-01T02:00:00+02:00", "2999-01-01 00:00:00.000 UTC")],
    ids=["no zone", "offset"],
)
def test_the_command_refuses_a_future_time_before_spark_starts(tmp_path, capsys, monkeypatch, before, shown):
    import rulewatch.spark.runtime.session

    monkeypatch.setattr(rulewatch.spark.runtime.session, "get_spark", lambda *_: pytest.fail("Spark was started"))
    code = main(["rules", "clear-state", "--lakehouse", str(tmp_path / "lh"), "--rule", "1", "--before", before])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"rulewatch: --before {shown} is in the future (now: ")
    assert err.count("\n") == 1 and "Omit --before" in err and not (tmp_path / "lh").exists()


def test_a_tolerance_that_is_no_duration_stops_the_command_naming_the_variable(tmp_path, capsys, monkeypatch):
    import rulewatch.spark.runtime.session

    monkeypatch.setattr(rulewatch.spark.runtime.session, "get_spark", lambda *_: pytest.fail("Spark was started"))
    monkeypatch.setenv("RULEWATCH_FUTURE_TOLERANCE", "five minutes")
    code = main(["rules", "clear-state", "--lakehouse", str(tmp_path / "lh"), "--rule", "1", "--before", "2999-01-01T00:00:00"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("rulewatch: RULEWATCH_FUTURE_TOLERANCE='five minutes' is not a duration (")
    assert err.count("\n") == 1 and "unset it for the default 5m" in err and not (tmp_path / "lh").exists()


def test_clear_state_refuses_on_spark_what_would_switch_a_rule_off(spark, tmp_path, capsys):
    from rulewatch.engine.rules import parse_rule
    from rulewatch.spark.storage import schema, tables
    from rulewatch.spark.control.commands import _aggregated_range, _logged_range, event_time_range
    from rulewatch.spark.storage.lakehouse import Lakehouse, table_ref
    from rulewatch.spark.control.rules_table import apply_rules
    from rulewatch.spark.layers.silver import ensure_silver_tables

    lakehouse = Lakehouse(str(tmp_path / "lh"))

    def clear(*flags: str) -> tuple[int, str]:
        """Exit code and stderr without the progress lines; stdout is kept in ``out``."""
        code = main(["rules", "clear-state", "--lakehouse", lakehouse.root, *flags])
        captured = capsys.readouterr()
        out.append(captured.out)
        return code, "".join(line for line in captured.err.splitlines(True) if not line.startswith("rulewatch rules: "))

    out: list[str] = []

    rule = {"ruleId": 1, "groupingKeyNames": ["payeeId"], "aggregateFieldName": "paymentAmount",
            "aggregatorFunctionType": "SUM", "limitOperatorType": "GREATER", "limit": 100, "windowMinutes": 10}  # fmt: skip
    apply_rules(spark, lakehouse, [parse_rule(rule), parse_rule({**rule, "ruleId": 2})])
    assert clear("--rule", "1")[1] == f"rulewatch: no events in {lakehouse.silver_transactions} yet, so there is no window state to clear\n"
    assert clear("--rule", "1", "--before", "2026-11-01T10:00:00")[0] == 2  # nothing to clear yet, whatever the time

    ensure_silver_tables(spark, lakehouse)
    row = ("t", None, "p", None, Decimal("1.00"), "CRD", None, None, None, "f.jsonl", OLDEST, 0)
    rows = [(f"t{i}", OLDEST + timedelta(minutes=i), *row[2:]) for i in (0, 30)] + [("t75", NEWEST, *row[2:])]
    tables.save(spark.createDataFrame(rows[:2], schema.SILVER).write.format("delta").mode("append"), lakehouse.silver_transactions)
    tables.save(spark.createDataFrame(rows[2:], schema.SILVER).write.format("delta").mode("append"), lakehouse.silver_transactions)
    # Read from the log's per-file statistics without a Spark job; the aggregate agrees.
    assert _logged_range(lakehouse.silver_transactions) is not None
    assert event_time_range(spark, lakehouse) == (OLDEST, NEWEST) == _aggregated_range(spark, lakehouse.silver_transactions)

    later = clear("--rule", "1", "--before", "2026-11-01T12:00:00Z")
    assert later == (2, "rulewatch: --before 2026-11-01 12:00:00.000 UTC is later than the newest event in silver "
                        "(2026-11-01 11:15:00.000 UTC): the rule would also ignore events not yet seen, up to then. "
                        "Omit --before to clear up to the newest event.\n")  # fmt: skip
    earlier = clear("--all", "--before", "2026-11-01T09:00:00")
    assert earlier[0] == 2 and "is earlier than the oldest event in silver (2026-11-01 10:00:00.000 UTC), so clearing" in earlier[1]
    spark.sql(f"UPDATE {table_ref(lakehouse.rules)} SET ruleState = 'DELETE' WHERE ruleId = 2")
    assert clear("--rule", "2")[1] == "rulewatch: rule 2 is deleted (ruleState DELETE), so the evaluator holds no state of it to clear\n"
    assert "Traceback" not in earlier[1] + later[1]
    assert not Path(lakehouse.rule_commands).exists()  # nothing was requested

    assert clear("--rule", "1", "--before", "2026-11-01T10:30:00") == (0, "")
    assert out[-1] == "clear-state requested: rule 1 will only see events after 2026-11-01 10:30:00.000 UTC (from the evaluator's next micro-batch)\n"
    written = tables.read(spark, lakehouse.rule_commands).collect()
    assert [(r.rule_id, r.clear_before.astimezone(timezone.utc)) for r in written] == [(1, OLDEST + timedelta(minutes=30))]

    spark.sql(f"DELETE FROM {table_ref(lakehouse.rules)} WHERE ruleId = 1")
    assert clear("--all")[1] == (
        f"rulewatch: no rule in {lakehouse.rules} to clear: --all clears the rules there when the evaluator applies it, "
        "not rules added later; apply a rules file first\n"
    )
    assert [r.rule_id for r in tables.read(spark, lakehouse.rule_commands).collect()] == [1]
