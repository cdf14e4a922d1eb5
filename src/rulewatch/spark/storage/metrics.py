"""gold/pipeline_metrics: one row per micro-batch of each layer, written like every other sink.

Each layer's row goes in as its own sink (``rulewatch.metrics.<query>``, sinks.append_once), so a
replayed batch neither loses nor repeats its metrics row. Latencies are measured from times
recorded in the data (bronze ingest time, event time) to the moment the gold batch has committed
its alerts.

Live queries gather their rows (``Recorder``): a batch leaves its rows in a file in the query's
checkpoint, and one commit every so often appends what the files hold. A job-mode run
(pipeline.run_all) gathers its layers' rows the same way and appends them in one commit at its end.
"""

from __future__ import annotations

import json
import math
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from pyspark.sql import SparkSession
from pyspark.sql.types import TimestampType

from rulewatch.spark.storage.lakehouse import Lakehouse, write_whole
from rulewatch.spark.storage.schema import PIPELINE_METRICS
from rulewatch.spark.storage.sinks import append_once, crash_point, newest_batch, sink_name
from rulewatch.spark.storage.tables import ensure_table

# In a query's checkpoint folder: one file per batch whose rows are not appended yet (Recorder).
PENDING = "rulewatch-metrics-pending"
_TIMESTAMPS = [f.name for f in PIPELINE_METRICS.fields if isinstance(f.dataType, TimestampType)]


def percentile(values: Sequence[int], q: float) -> int | None:
    """Nearest-rank percentile (an observed value, never an interpolation); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


class Steps:
    """Wall milliseconds of a micro-batch's steps, for its ``pipeline_metrics`` row (``step_ms``):
    where a batch's seconds go, which Spark's progress report shows only as one ``addBatch``.

    Steps run at once (sinks.together) overlap, so they may add up to more than the batch."""

    def __init__(self) -> None:
        self.ms: dict[str, int] = {}
        self._adding = threading.Lock()  # steps end in sinks.together's threads

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            with self._adding:
                self.ms[name] = self.ms.get(name, 0) + round((time.perf_counter() - started) * 1000)

    def timed(self, name: str, step: Callable[[], Any]) -> Callable[[], Any]:
        """``step`` timed as ``name`` when called (for sinks.together's lists)."""

        def run() -> Any:
            with self(name):
                return step()

        return run


def latency_columns(ingest_ms: Sequence[int], event_ms: Sequence[int], committed_ms: int) -> dict[str, int | None]:
    """Alert latencies of one gold batch: bronze ingest -> commit, and event time -> commit."""
    from_ingest = [committed_ms - t for t in ingest_ms]
    from_event = [committed_ms - t for t in event_ms]
    return {
        "latency_p50_ms": percentile(from_ingest, 50),
        "latency_p95_ms": percentile(from_ingest, 95),
        "latency_p99_ms": percentile(from_ingest, 99),
        "latency_max_ms": max(from_ingest, default=None),
        "event_latency_p50_ms": percentile(from_event, 50),
        "event_latency_p99_ms": percentile(from_event, 99),
    }


def ensure_metrics_table(spark: SparkSession, lakehouse: Lakehouse) -> None:
    ensure_table(spark, lakehouse.pipeline_metrics, PIPELINE_METRICS, "One row per micro-batch of each layer")


def metrics_row(layer: str, batch_id: int, started: float, ended: float, **values: Any) -> dict[str, Any]:
    """One ``pipeline_metrics`` row; ``started`` and ``ended`` are ``time.time()`` values."""
    row = {
        "layer": layer,
        "batch_id": batch_id,
        "batch_start": datetime.fromtimestamp(started, timezone.utc),
        "batch_end": datetime.fromtimestamp(ended, timezone.utc),
        "processing_ms": round((ended - started) * 1000),
        **values,
    }
    unknown = set(row) - set(PIPELINE_METRICS.fieldNames())
    if unknown:
        raise ValueError(f"not pipeline_metrics columns: {sorted(unknown)}")
    return row


def metrics_sink(query: str) -> str:
    """The sink (append_once's app id) under which ``query``'s rows enter ``pipeline_metrics``."""
    return sink_name("metrics", query)


def record_rows(
    spark: SparkSession, lakehouse: Lakehouse, query: str, batch_id: int, rows: list[dict[str, Any]], also: dict[str, int] | None = None
) -> None:
    """Append the metrics rows of query ``query``'s batch ``batch_id`` in one commit; ``also``
    (``{query: batch}``): other queries' batches whose rows are among ``rows``."""
    names = PIPELINE_METRICS.fieldNames()
    frame = spark.createDataFrame([tuple(row.get(f) for f in names) for row in rows], PIPELINE_METRICS)
    append_once(frame, lakehouse.pipeline_metrics, metrics_sink(query), batch_id, also={metrics_sink(q): b for q, b in (also or {}).items()})


class Recorder:
    """Writes one query's ``pipeline_metrics`` rows: each batch's in its own commit, or gathered.

    Gathered (``every`` > 0): a batch leaves its rows in a file in the query's checkpoint, and the
    first batch ending ``every`` seconds after the last commit appends every file's rows in one
    commit (live mode; a one-row commit cost a live batch 0.7-1.5 s of two busy cores,
    docs/journal/benchmarks.md). ``flush`` (after the query stops) appends the rest; a job-mode run
    (``every`` infinite) appends all its layers' at its end (``flush_pending``). A crash leaves the
    files, and the next start appends them before its checks (called by checkpoints.check_queries):
    the rows describe committed writes, so they must reach the table.
    """

    def __init__(self, lakehouse: Lakehouse, query: str, every: float = 0.0) -> None:
        self.lakehouse, self.query, self.every = lakehouse, query, every
        self._committed = time.time()  # wall clock: under Spark Connect a copy runs on the server

    @classmethod
    def gathered(cls, lakehouse: Lakehouse, query: str, every: float = math.inf) -> "Recorder":
        """Gathered where the files can be read back (a checkpoint on a local or mounted path), else each batch's rows at once."""
        return cls(lakehouse, query, every=every if "://" not in lakehouse.checkpoint(query) else 0.0)

    def record_rows(self, spark: SparkSession, batch_id: int, rows: list[dict[str, Any]]) -> None:
        """Append the metrics rows of batch ``batch_id``, or keep them for the next commit."""
        if not self.every:
            record_rows(spark, self.lakehouse, self.query, batch_id, rows)
            return
        _write_pending(self.lakehouse, self.query, batch_id, rows)
        crash_point(metrics_sink(self.query), batch_id, "kept")
        if time.time() - self._committed >= self.every:
            self.flush(spark)

    def record(self, spark: SparkSession, batch_id: int, started: float, **values: Any) -> None:
        """Record the metrics row of batch ``batch_id``; ``started`` is its ``time.time()``."""
        self.record_rows(spark, batch_id, [metrics_row(self.query, batch_id, started, time.time(), **values)])

    def flush(self, spark: SparkSession) -> None:
        """Append the rows kept so far."""
        flush_pending(spark, self.lakehouse, self.query)
        self._committed = time.time()


def _pending_folder(lakehouse: Lakehouse, query: str) -> Path:
    return Path(lakehouse.checkpoint(query), PENDING)


def _write_pending(lakehouse: Lakehouse, query: str, batch_id: int, rows: list[dict[str, Any]]) -> None:
    folder = _pending_folder(lakehouse, query)
    folder.mkdir(parents=True, exist_ok=True)
    stored = [{k: v.isoformat() if k in _TIMESTAMPS and v is not None else v for k, v in row.items()} for row in rows]
    write_whole(folder / f"{batch_id}.json", json.dumps(stored))


def _read_pending(path: Path) -> list[dict[str, Any]]:
    stored = json.loads(path.read_text(encoding="utf-8"))
    return [{k: datetime.fromisoformat(v) if k in _TIMESTAMPS and v is not None else v for k, v in row.items()} for row in stored]


def kept_rows(lakehouse: Lakehouse, query: str) -> list[dict[str, Any]]:
    """The rows ``query`` keeps for its next metrics commit (none once they are in the table).

    Read these before the table: a file is removed only after its rows committed."""
    rows = []
    folder = _pending_folder(lakehouse, query)
    for path in folder.glob("*.json") if folder.is_dir() else ():
        try:
            rows += _read_pending(path)
        except FileNotFoundError:  # committed and removed since the listing
            pass
    return rows


def flush_pending(spark: SparkSession | None, lakehouse: Lakehouse, *queries: str, at_start: bool = False) -> None:
    """Append the rows kept in files by ``queries`` (this run's, or a stopped or crashed run's) in one commit.

    The commit names each query's newest batch among them, so a repeat is recognised like any other
    (``append_once``); files a crash left after their commit are dropped, not appended again.
    ``at_start``: called by a start's checks, before any table is ensured. The rows may then be an older
    release's run's, whose table lacks the columns added since (Delta refuses an append that has them),
    so the table gets them first; a running query's flushes need not check."""
    rows: list[dict[str, Any]] = []
    newest: dict[str, int] = {}
    files: list[Path] = []
    for query in queries:
        folder = _pending_folder(lakehouse, query)
        kept = sorted(folder.glob("*.json"), key=lambda p: int(p.stem)) if folder.is_dir() else []
        if not kept:
            continue
        if spark is None:
            raise ValueError(f"{folder} holds metrics rows to append first; that needs a SparkSession (spark=...)")
        committed = newest_batch(spark, lakehouse.pipeline_metrics, metrics_sink(query))
        new = [path for path in kept if int(path.stem) > committed]
        rows += [row for path in new for row in _read_pending(path)]
        if new:
            newest[query] = int(kept[-1].stem)
        files += kept
    if rows:
        if at_start:
            ensure_metrics_table(spark, lakehouse)
        (query, batch_id), *others = newest.items()
        record_rows(spark, lakehouse, query, batch_id, rows, also=dict(others))
    for path in files:
        path.unlink()
