"""Control operations on the running evaluator, as data: ``config/rule_commands``.

Clearing a rule's window state is a row appended here; the gold stream reads the table as a stream
and hands each command to every shard, like a rule change. A cleared rule then sees only events
later than the command's ``clear_before`` (by default the newest event time in silver, i.e. all it
has seen so far): its windows, cooldown and reported values start over, while rules sharing the same
per-key history keep theirs. Nothing is deleted, so a clear can never lose an event another rule needs.

A clear point is the one switch here that can turn detection off without a word: one past the newest
event would make the rule ignore events still to come, one before the oldest would do nothing. So a
request is checked against silver's oldest and newest event time (``clear_point_problem``) and
refused with the reason, as is a clear of a deleted rule or of ``--all`` when no rule is there.
"""

from __future__ import annotations

import getpass
import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from rulewatch.engine.rules import RuleState, parse_duration
from rulewatch.spark.storage import schema, tables
from rulewatch.spark.storage.delta_log import live_files
from rulewatch.spark.storage.lakehouse import Lakehouse, is_table_name
from rulewatch.spark.runtime.env import FUTURE_TOLERANCE_ENV, future_tolerance

CLEAR_STATE = "clear_state"
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


class CommandError(ValueError):
    """A control command that cannot be carried out as asked."""


def as_utc(moment: datetime) -> datetime:
    """``moment`` with its zone; one given without a zone is UTC, as silver reads an eventTime without one."""
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment


def utc_text(moment: datetime) -> str:
    """``moment`` as messages show it: in UTC, to the millisecond (``2026-11-01 12:00:00.000 UTC``)."""
    return as_utc(moment).astimezone(timezone.utc).isoformat(sep=" ", timespec="milliseconds").replace("+00:00", " UTC")


def _millis(moment: datetime) -> int:
    """Whole milliseconds since the epoch: the evaluator compares event times and clear points in these."""
    return (as_utc(moment) - _EPOCH) // timedelta(milliseconds=1)


@dataclass(frozen=True)
class ClearRequest:
    rule_id: int | None
    clear_before: datetime

    def __str__(self) -> str:
        who = f"rule {self.rule_id}" if self.rule_id is not None else "every rule"
        return f"{who} will only see events after {utc_text(self.clear_before)} (from the evaluator's next micro-batch)"


def future_clear_point(before: datetime, now: datetime, tolerance: str) -> str | None:
    """Why ``before`` is too far ahead to be a clear point, whatever silver holds (None: it is not).

    Silver accepts an event time up to ``tolerance`` past its ingest time, so nothing ingested by ``now``
    is later than now + tolerance: a clear point past that can only hide events still to come.
    """
    if before <= now + timedelta(milliseconds=parse_duration(tolerance)):
        return None
    return (
        f"--before {utc_text(before)} is in the future (now: {utc_text(now)}; silver accepts event times at most "
        f"{tolerance} ahead, {FUTURE_TOLERANCE_ENV}): the rule would ignore every new event up to then. "
        "Omit --before to clear up to the newest event in silver."
    )


def clear_point_problem(before: datetime, oldest: datetime, newest: datetime, now: datetime, tolerance: str) -> str | None:
    """Why clearing up to ``before`` would switch detection off or do nothing, given the oldest and
    newest event time in silver; None when it is a clear point within the events seen."""
    future = future_clear_point(before, now, tolerance)
    if future is not None:
        return future
    if _millis(before) > _millis(newest):
        return (
            f"--before {utc_text(before)} is later than the newest event in silver ({utc_text(newest)}): the rule "
            "would also ignore events not yet seen, up to then. Omit --before to clear up to the newest event."
        )
    if _millis(before) < _millis(oldest):
        return (
            f"--before {utc_text(before)} is earlier than the oldest event in silver ({utc_text(oldest)}), so clearing "
            f"up to then has no effect. Give a time from then to {utc_text(newest)}, or omit --before for the newest event."
        )
    return None


def ensure_commands_table(spark: SparkSession, lakehouse: Lakehouse) -> None:
    tables.ensure_table(spark, lakehouse.rule_commands, schema.RULE_COMMANDS, "Control operations for the running evaluator")


def _logged_range(table: str) -> list[tuple[datetime, datetime]] | None:
    """Each live file's oldest and newest event time, from the Delta log's statistics (to the millisecond,
    as Delta keeps them); None when the log cannot tell (no log here, or a file without them)."""
    files = live_files(table)
    if files is None:
        return None
    ranges = []
    for add in files:
        stats = json.loads(add.get("stats") or "{}")
        low, high = stats.get("minValues", {}).get("event_time"), stats.get("maxValues", {}).get("event_time")
        if low is None or high is None:
            return None
        ranges.append((datetime.fromisoformat(low), datetime.fromisoformat(high)))
    return ranges


def _aggregated_range(spark: SparkSession, table: str) -> tuple[datetime, datetime] | None:
    try:
        row = tables.read(spark, table).agg(F.unix_millis(F.min("event_time")), F.unix_millis(F.max("event_time"))).first()
    except AnalysisException:  # no silver table yet: nothing has been evaluated
        return None
    # As epoch milliseconds: a collected timestamp would come back naive, in this machine's zone.
    return None if row[0] is None else (_EPOCH + timedelta(milliseconds=row[0]), _EPOCH + timedelta(milliseconds=row[1]))


def event_time_range(spark: SparkSession, lakehouse: Lakehouse) -> tuple[datetime, datetime] | None:
    """The oldest and newest event time in silver; None when it holds no events.

    A path table answers from its log's per-file statistics (silver keeps them for event_time) without
    a Spark job; a catalog table, or a log that cannot tell, with one aggregate.
    """
    table = lakehouse.silver_transactions
    ranges = None if is_table_name(table) else _logged_range(table)
    if ranges is None:
        return _aggregated_range(spark, table)
    return (min(low for low, _ in ranges), max(high for _, high in ranges)) if ranges else None


def _rule_problem(spark: SparkSession, lakehouse: Lakehouse, rule_id: int | None) -> str | None:
    """Why clearing ``rule_id`` (every rule if None) would do nothing: the evaluator clears only the
    rules it holds when the command reaches it, and it holds no deleted one."""
    rules = tables.read(spark, lakehouse.rules)
    if rule_id is None:
        if not rules.where(~F.col("ruleState").eqNullSafe(RuleState.DELETE.value)).limit(1).count():
            return (
                f"no rule in {lakehouse.rules} to clear: --all clears the rules there when the evaluator applies it, "
                "not rules added later; apply a rules file first"
            )
        return None
    states = [row.ruleState for row in rules.where(F.col("ruleId") == rule_id).select("ruleState").collect()]
    if not states:
        return f"no rule {rule_id} in {lakehouse.rules}; `rulewatch rules export` lists the rules"
    if RuleState.DELETE.value in states:
        return f"rule {rule_id} is deleted (ruleState {RuleState.DELETE.value}), so the evaluator holds no state of it to clear"
    return None


def request_clear_state(
    spark: SparkSession,
    lakehouse: Lakehouse,
    rule_id: int | None = None,
    clear_before: datetime | None = None,
    requested_by: str | None = None,
) -> ClearRequest:
    """Ask the evaluator to clear the window state of ``rule_id`` (every rule if None) up to
    ``clear_before`` (default: the newest event time in silver; without a zone: UTC).

    The running stream applies it from its next micro-batch; a stopped one when it next starts.
    Raises CommandError, writing nothing, for a request that would switch detection off or do nothing.
    """
    problem = _rule_problem(spark, lakehouse, rule_id)
    if problem is not None:
        raise CommandError(problem)
    seen = event_time_range(spark, lakehouse)
    if seen is None:
        raise CommandError(f"no events in {lakehouse.silver_transactions} yet, so there is no window state to clear")
    if clear_before is None:
        clear_before = seen[1]
    else:
        clear_before = as_utc(clear_before)
        problem = clear_point_problem(clear_before, *seen, datetime.now(timezone.utc), future_tolerance())
        if problem is not None:
            raise CommandError(problem)
    _append(spark, lakehouse, CLEAR_STATE, rule_id, clear_before, requested_by)
    return ClearRequest(rule_id, clear_before)


def record_command(spark: SparkSession, lakehouse: Lakehouse, command: str, requested_by: str | None = None) -> None:
    """Append a command the evaluator does nothing with but read (a rescale's first batch needs input)."""
    _append(spark, lakehouse, command, None, datetime.now(timezone.utc), requested_by)


def _append(
    spark: SparkSession, lakehouse: Lakehouse, command: str, rule_id: int | None, clear_before: datetime, requested_by: str | None
) -> None:
    ensure_commands_table(spark, lakehouse)
    row = (str(uuid.uuid4()), command, rule_id, clear_before, datetime.now(timezone.utc), requested_by or getpass.getuser())
    tables.save(spark.createDataFrame([row], schema.RULE_COMMANDS).write.format("delta").mode("append"), lakehouse.rule_commands)


def command_stream(spark: SparkSession, lakehouse: Lakehouse, starting_version: int | None = None) -> DataFrame:
    """Every command ever requested (or those from ``starting_version``), then each new one, in the evaluator's column names."""
    return (
        tables.read_stream(spark.readStream.format("delta"), lakehouse.rule_commands, starting_version)
        .select(
            "command",
            F.col("rule_id").alias("command_rule_id"),
            F.unix_millis("clear_before").alias("clear_before_ms"),
        )
    )
