"""Delta sinks that are idempotent per micro-batch.

``foreachBatch`` is at-least-once: after a crash the same batch id runs again. Every table write
carries Delta's ``txnAppId`` + ``txnVersion``, so Delta skips a write it has already committed
for that (sink, batch) and a replayed batch neither loses nor duplicates a row.
"""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from rulewatch.spark import tables


# Fault injection for the crash tests (tests/test_crash.py): "<sink>:<batch>:<before|after>", e.g.
# "rulewatch.gold.alerts:1:after", SIGKILLs this process at that point of that write. A kill is the
# harshest failure (no finally, no shutdown hook), so surviving it covers every softer one.
CRASH_AT_ENV = "RULEWATCH_CRASH_AT"


def crash_point(sink: str, batch_id: int, moment: str) -> None:
    if os.environ.get(CRASH_AT_ENV) == f"{sink}:{batch_id}:{moment}":
        os.kill(os.getpid(), signal.SIGKILL)


def append_once(df: DataFrame, table: str, sink: str, batch_id: int, rows: int | None = None) -> None:
    """Append ``df`` to ``table`` unless batch ``batch_id`` of ``sink`` already did.

    ``rows=0`` (the caller counted ``df`` empty) skips the commit: with ``txnAppId`` each append pays
    a Delta state reconstruction (~0.5 s locally), and an empty one adds nothing a replay could repeat.
    The commit also carries (sink, batch) as its ``userMetadata``: the one place ``DESCRIBE HISTORY``
    shows it, for catalog tables whose log cannot be read as files (checkpoints.py).
    """
    crash_point(sink, batch_id, "before")
    if rows != 0:
        writer = df.write.format("delta").mode("append").option("txnAppId", sink).option("txnVersion", batch_id)
        tables.save(writer.option("userMetadata", batch_metadata(sink, batch_id)), table)
    crash_point(sink, batch_id, "after")


def batch_metadata(sink: str, batch_id: int) -> str:
    return json.dumps({"txnAppId": sink, "txnVersion": batch_id})


def batch_column(name: str, batch_id: int) -> Column:
    """The micro-batch id as a ``long`` column (a bare literal would be an int and not merge)."""
    return F.lit(batch_id).cast("long").alias(name)


def together(writes: Sequence[Callable[[], None]]) -> None:
    """Run one batch's independent table writes at the same time, and return when all have ended.

    Each Delta append is mostly fixed cost on the driver (planning, the log, the commit: ~1-2 s
    locally whatever its size), so appends to different tables overlap well even on two cores.
    Every write is idempotent on its own (``append_once``), so a crash with some committed and some
    not leaves a batch its replay completes. The first failure is raised after the others have
    ended: a replay must not race a write still running.
    """
    if len(writes) <= 1:
        for write in writes:
            write()
        return
    with ThreadPoolExecutor(max_workers=len(writes), thread_name_prefix="rulewatch-sink") as pool:
        futures = [pool.submit(write) for write in writes]
    for future in futures:  # the pool has waited for every one
        future.result()
