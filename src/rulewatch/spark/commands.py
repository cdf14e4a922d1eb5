"""Control operations on the running evaluator, as data: ``config/rule_commands``.

Clearing a rule's window state is a row appended here; the gold stream reads the table as a stream
and hands each command to every shard, like a rule change. A cleared rule then sees only events
later than the command's ``clear_before`` (by default the newest event time in silver, i.e. all it
has seen so far): its windows, cooldown and reported values start over, while rules sharing the same
per-key history keep theirs. Nothing is deleted, so a clear can never lose an event another rule needs.
"""

from __future__ import annotations

import getpass
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from rulewatch.spark import schema, tables
from rulewatch.spark.lakehouse import Lakehouse

CLEAR_STATE = "clear_state"


class CommandError(ValueError):
    """A control command that cannot be carried out as asked."""


@dataclass(frozen=True)
class ClearRequest:
    rule_id: int | None
    clear_before: datetime

    def __str__(self) -> str:
        who = f"rule {self.rule_id}" if self.rule_id is not None else "every rule"
        when = self.clear_before.isoformat(sep=" ", timespec="milliseconds")
        return f"{who} will only see events after {when} (from the evaluator's next micro-batch)"


def ensure_commands_table(spark: SparkSession, lakehouse: Lakehouse) -> None:
    tables.ensure_table(spark, lakehouse.rule_commands, schema.RULE_COMMANDS, "Control operations for the running evaluator")


def _newest_event_time(spark: SparkSession, lakehouse: Lakehouse) -> datetime | None:
    try:
        return tables.read(spark, lakehouse.silver_transactions).agg(F.max("event_time")).first()[0]
    except AnalysisException:  # no silver table yet: nothing has been evaluated
        return None


def request_clear_state(
    spark: SparkSession,
    lakehouse: Lakehouse,
    rule_id: int | None = None,
    clear_before: datetime | None = None,
    requested_by: str | None = None,
) -> ClearRequest:
    """Ask the evaluator to clear the window state of ``rule_id`` (every rule if None).

    The running stream applies it from its next micro-batch; a stopped one when it next starts.
    """
    if rule_id is not None:
        known = tables.read(spark, lakehouse.rules).where(F.col("ruleId") == rule_id).count()
        if not known:
            raise CommandError(f"no rule {rule_id} in {lakehouse.rules}; `rulewatch rules export` lists the rules")
    if clear_before is None:
        clear_before = _newest_event_time(spark, lakehouse)
        if clear_before is None:
            raise CommandError(f"no events in {lakehouse.silver_transactions} yet, so there is no window state to clear")
    ensure_commands_table(spark, lakehouse)
    row = (str(uuid.uuid4()), CLEAR_STATE, rule_id, clear_before, datetime.now(timezone.utc), requested_by or getpass.getuser())
    tables.save(spark.createDataFrame([row], schema.RULE_COMMANDS).write.format("delta").mode("append"), lakehouse.rule_commands)
    return ClearRequest(rule_id, clear_before)


def command_stream(spark: SparkSession, lakehouse: Lakehouse) -> DataFrame:
    """Every command ever requested, then each new one, in the evaluator's column names."""
    return (
        tables.read_stream(spark.readStream.format("delta"), lakehouse.rule_commands)
        .select(
            "command",
            F.col("rule_id").alias("command_rule_id"),
            F.unix_millis("clear_before").alias("clear_before_ms"),
        )
    )
