"""Delta sinks that are idempotent per micro-batch.

``foreachBatch`` is at-least-once: after a crash the same batch id runs again. Only the first
batch of a query's run can be such a replay (a query starts with the batch its last run planned,
and a failed batch ends the run), so only that batch pays for the check (``per_run``): it skips a
(sink, batch) the table's history already holds, and writes with Delta's ``txnAppId`` +
``txnVersion`` as a second guard against another writer (``replay_check``: not where the lakehouse's
lock keeps every other run out and the table's commits answered whole). Later batches of the run append
without it — Delta answers ``txnVersion`` by reconstructing the table's state, more than half of a small
append's cost (docs/journal/benchmarks.md). Every commit names its (sink, batch) in ``userMetadata``, which is what the
check and checkpoints.py read.
"""

from __future__ import annotations

import contextvars
import gc
import os
import signal
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence, TypeVar

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from rulewatch.spark.storage import tables
from rulewatch.spark.storage.delta_log import HISTORY_DEPTH, UNREADABLE, batch_metadata, batch_told_by_commits, newest_committed_batch, newest_per_sink, sink_batches
from rulewatch.spark.storage.lakehouse import held_here

T = TypeVar("T")


# Fault injection for the crash tests (tests/test_crash.py): "<sink>:<batch>:<before|after>", e.g.
# "rulewatch.gold.alerts:1:after", SIGKILLs this process at that point of that write (metrics.py
# adds "kept": a batch's metrics rows kept in a file for a later commit). A kill is the
# harshest failure (no finally, no shutdown hook), so surviving it covers every softer one.
# "<sink>@<folder>/<table>:<batch>:<moment>" names one path table where a sink writes two: live
# ingest's bronze and silver appends are both "rulewatch.ingest.transactions", and run at once.
CRASH_AT_ENV = "RULEWATCH_CRASH_AT"


def sink_name(writer: str, name: str = "") -> str:
    """A sink's name (``append_once``'s app id, a crash point's name): ``rulewatch.<writer>.<name>``,
    e.g. what query ``gold`` appends to ``alerts``, or ``metrics`` with a query's name for its
    ``pipeline_metrics`` rows; with no name, the prefix all of the writer's sinks share."""
    return f"rulewatch.{writer}.{name}"


# The rule-history query's sink: rules_table appends with it, the start-up checks look for it.
HISTORY_SINK = sink_name("gold", "rule_history")


def crash_point(sink: str, batch_id: int, moment: str, table: str | None = None) -> None:
    wanted = os.environ.get(CRASH_AT_ENV)
    if not wanted:
        return
    points = {f"{sink}:{batch_id}:{moment}"}
    if table is not None:
        points.add(f"{sink}@{'/'.join(table.rstrip('/').split('/')[-2:])}:{batch_id}:{moment}")
    if wanted in points:
        os.kill(os.getpid(), signal.SIGKILL)


# Whether the running batch may repeat one an earlier run wrote: true unless ``per_run`` knows it
# is a later batch of its run (so writes outside a streaming query are always checked).
_MAY_REPEAT: contextvars.ContextVar[bool] = contextvars.ContextVar("rulewatch_may_repeat", default=True)

class _PerRun:
    # A class at module level, not a closure: Spark Connect pickles the foreachBatch function, and
    # a closure would carry the ContextVar by value (which cannot be pickled), a class by reference.
    def __init__(self, write: Callable[[DataFrame, int], None]) -> None:
        self.write = write
        self.first: int | None = None

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        if self.first is None:
            self.first = batch_id
        token = _MAY_REPEAT.set(batch_id == self.first)
        try:
            self.write(batch, batch_id)
        finally:
            _MAY_REPEAT.reset(token)


def per_run(write: Callable[[DataFrame, int], None]) -> Callable[[DataFrame, int], None]:
    """``write`` as a ``foreachBatch`` function whose ``append_once`` calls check for a repeat only
    in the first batch it is called with; make a new one for every query start."""
    return _PerRun(write)


class _Shifted:
    # At module level, as _PerRun, for Spark Connect's pickling.
    def __init__(self, write: Callable[[DataFrame, int], None], by: int) -> None:
        self.write, self.by = write, by

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        self.write(batch, batch_id + self.by)


def shifted(write: Callable[[DataFrame, int], None], by: int) -> Callable[[DataFrame, int], None]:
    """``write`` called with batch ids ``by`` higher: a query on a new checkpoint that goes on from an
    old one's (a rescaled gold) keeps numbering its batches in the tables from where the old one stopped,
    so the idempotent appends neither skip its batches nor take them for replays."""
    return _Shifted(write, by) if by else write


def append_once(
    df: DataFrame, table: str, sink: str, batch_id: int, rows: int | None = None, also: Mapping[str, int] | None = None
) -> bool:
    """Append ``df`` to ``table`` unless batch ``batch_id`` of ``sink`` already did; True if it appended.

    ``rows=0`` (the caller counted ``df`` empty) skips the commit: an empty append adds nothing a
    replay could repeat, and each commit costs ~0.3 s locally. The commit carries (sink, batch) as
    its ``userMetadata``, the one record every append leaves (``DESCRIBE HISTORY`` shows it).
    ``also`` (``{sink: batch}``) names other sinks' batches ``df`` holds too; the caller has checked
    that none of them committed. Only ``sink`` gets Delta's ``txn`` record.
    """
    crash_point(sink, batch_id, "before", table)
    appended = False
    if rows != 0:
        writer = df.write.format("delta").mode("append").option("userMetadata", batch_metadata(sink, batch_id, also))
        if not _MAY_REPEAT.get():
            tables.save(writer, table)
            appended = True
        else:
            newest, guarded = replay_check(df.sparkSession, table, sink)
            if newest < batch_id:
                tables.save(writer.option("txnAppId", sink).option("txnVersion", batch_id) if guarded else writer, table)
                appended = True
    crash_point(sink, batch_id, "after", table)
    return appended


def replay_check(spark: SparkSession, table: str, sink: str) -> tuple[int, bool]:
    """The newest batch ``sink`` appended to ``table``, and whether the append must carry Delta's
    ``txnAppId`` + ``txnVersion`` as well.

    It need not in a local lakehouse this process holds (``lakehouse.exclusive``: no other run commits
    there meanwhile) when the table's commit files tell the answer whole: then Delta's ``txn`` check,
    which reconstructs the table's state with a Spark job (~0.4-0.5 s an append, most of a small run's
    appends), would only repeat it (docs/design.md, "Sinks")."""
    if held_here(table):
        with suppress(*UNREADABLE):
            told = batch_told_by_commits(table, sink)
            if told is not None:
                return told, False
    return newest_batch(spark, table, sink), True


def newest_batch(spark: SparkSession, table: str, sink: str) -> int:
    """The newest batch ``sink`` appended to ``table`` (-1: none).

    A path table whose log this process sees is read as files (~1 ms against 0.2-0.5 s for a
    ``DESCRIBE HISTORY``, 5 s for the first one in a process); otherwise the history is read a
    few commits first. Either way a sink's newest commit is almost always among the newest few."""
    if Path(table, "_delta_log").is_dir():
        return newest_committed_batch(table, sink)
    for depth in (20, HISTORY_DEPTH):
        found = history_batches(spark, table, sink, depth)
        if sink in found:
            return found[sink]
    return -1


def history_batches(spark: SparkSession, table: str, app_id_prefix: str, depth: int = HISTORY_DEPTH) -> dict[str, int]:
    """``{sink: newest batch}`` of the sinks whose name starts with the prefix, from the newest
    ``depth`` commits' ``userMetadata`` (``DESCRIBE HISTORY``: path and catalog tables alike)."""
    history = spark.sql(f"DESCRIBE HISTORY {tables.table_ref(table)} LIMIT {depth}")
    rows = history.where("userMetadata IS NOT NULL").select("userMetadata").collect()
    return newest_per_sink((pair for row in rows for pair in sink_batches(row.userMetadata)), app_id_prefix)


def batch_column(name: str, batch_id: int) -> Column:
    """The micro-batch id as a ``long`` column (a bare literal would be an int and not merge)."""
    return F.lit(batch_id).cast("long").alias(name)


@contextmanager
def beside(work: Callable[[], T], pause_collector: bool = True) -> Iterator[Future[T]]:
    """Run ``work`` in another thread while the block runs in this one, and wait for it when the block
    ends (its outcome: the yielded future's ``result()``). For work sharing no table with the block's,
    as ``together``. The block keeps this thread, so Ctrl-C interrupts it at once (the work beside is
    still waited for). If both fail, the block's error is raised with the work's as a note.

    ``pause_collector``: as ``together``, for a Spark Connect session (SPARK-55020); a classic one
    needs no pause, which over a long block would let reference cycles pile up."""
    with _collector_paused() if pause_collector else nullcontext(), ThreadPoolExecutor(1, thread_name_prefix="rulewatch-beside") as pool:
        future = pool.submit(contextvars.copy_context().run, work)
        try:
            yield future
        except BaseException as err:
            if (other := future.exception()) is not None:
                err.add_note(f"meanwhile, beside it: {other!r}")
            raise


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's garbage collector off until the block ends, then back as it was.

    pyspark's Spark Connect client turns the collector off around each call to the server (a
    collection in mid-call can run finalizers that call the server again: a deadlock) and back on
    afterwards, if it was on: with calls in several threads, the first to finish turns it on under
    the others (SPARK-55020). Off for the whole block, every call finds it off and leaves it so."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def together(writes: Sequence[Callable[[], None]]) -> None:
    """Run independent writes to different tables (one batch's appends, a layer's table creations)
    at the same time, and return when all have ended.

    Each Delta append or creation is mostly fixed cost on the driver (planning, the log, the
    commit: ~1-2 s locally for an append whatever its size), so writes to different tables overlap
    well even on two cores. Every write is idempotent on its own (``append_once``, ``CREATE TABLE
    IF NOT EXISTS``), so a crash with some committed and some not leaves a batch its replay
    completes. The first failure is raised after the others have ended: a replay must not race a
    write still running. The garbage collector waits until they have all ended (``_collector_paused``).
    """
    if len(writes) <= 1:
        for write in writes:
            write()
        return
    with _collector_paused(), ThreadPoolExecutor(max_workers=len(writes), thread_name_prefix="rulewatch-sink") as pool:
        # Each in a copy of this thread's context: a write must know whether its batch may repeat (per_run).
        futures = [pool.submit(contextvars.copy_context().run, write) for write in writes]
    for future in futures:  # the pool has waited for every one
        future.result()
