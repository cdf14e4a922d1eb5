"""gold/pipeline_metrics: one row per micro-batch of each layer, written like every other sink.

Each layer's row goes in as its own sink (``rulewatch.metrics.<query>``, sinks.append_once), so a
replayed batch neither loses nor repeats its metrics row. Latencies are measured from times
recorded in the data (bronze ingest time, event time) to the moment the gold batch has committed
its alerts.

Live queries write their rows behind their batches (``Recorder``): a batch leaves its rows in a
file in the query's checkpoint and returns, and a thread appends them while the next batch runs.
"""

from __future__ import annotations

import contextvars
import json
import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from pyspark.sql import SparkSession
from pyspark.sql.types import TimestampType

from rulewatch.spark.lakehouse import Lakehouse
from rulewatch.spark.schema import PIPELINE_METRICS
from rulewatch.spark.sinks import append_once
from rulewatch.spark.tables import ensure_table

# In a query's checkpoint folder: one file per batch whose rows are not appended yet (Recorder).
PENDING = "rulewatch-metrics-pending"
_TIMESTAMPS = [f.name for f in PIPELINE_METRICS.fields if isinstance(f.dataType, TimestampType)]


def percentile(values: Sequence[int], q: float) -> int | None:
    """Nearest-rank percentile (an observed value, never an interpolation); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


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


def record_rows(spark: SparkSession, lakehouse: Lakehouse, query: str, batch_id: int, rows: list[dict[str, Any]]) -> None:
    """Append the metrics rows of query ``query``'s batch ``batch_id`` in one commit."""
    names = PIPELINE_METRICS.fieldNames()
    frame = spark.createDataFrame([tuple(row.get(f) for f in names) for row in rows], PIPELINE_METRICS)
    append_once(frame, lakehouse.pipeline_metrics, f"rulewatch.metrics.{query}", batch_id)


def record(spark: SparkSession, lakehouse: Lakehouse, layer: str, batch_id: int, started: float, **values: Any) -> None:
    """Append the metrics row of ``layer``'s batch ``batch_id``; ``started`` is its ``time.time()``."""
    record_rows(spark, lakehouse, layer, batch_id, [metrics_row(layer, batch_id, started, time.time(), **values)])


class Recorder:
    """Writes one query's ``pipeline_metrics`` rows: at once, or behind its batches.

    Behind (live mode): a batch's rows go to a file in the query's checkpoint, and one thread
    appends them while the next batch runs. The append is off the path from landing to alert: it
    cost each live batch 0.7-1.5 s (docs/benchmarks.md). A failed append fails the next batch, so
    the query stops; ``drain``, once the query has stopped, waits for the last one. A crash leaves the
    file, and the next start appends it before its checks (``flush_pending``, called by
    checkpoints.check_queries): the rows describe committed writes, so they must reach the table.
    """

    def __init__(self, lakehouse: Lakehouse, query: str, behind: bool = False) -> None:
        self.lakehouse, self.query, self.behind = lakehouse, query, behind
        self._pool: ThreadPoolExecutor | None = None
        self._last: Future | None = None

    @classmethod
    def for_live(cls, spark: SparkSession, lakehouse: Lakehouse, query: str) -> "Recorder":
        """Behind where ``drain`` can reach the thread and the file: a classic session (under Spark
        Connect a batch runs in a worker on the server) and a checkpoint on a local or mounted path."""
        classic = not type(spark).__module__.startswith("pyspark.sql.connect")
        return cls(lakehouse, query, behind=classic and "://" not in lakehouse.checkpoint(query))

    def __getstate__(self) -> dict[str, Any]:
        # Spark Connect pickles the foreachBatch function; a worker starts without the thread.
        return {**self.__dict__, "_pool": None, "_last": None}

    def record_rows(self, spark: SparkSession, batch_id: int, rows: list[dict[str, Any]]) -> None:
        """Append the metrics rows of batch ``batch_id`` now, or behind it."""
        if not self.behind:
            record_rows(spark, self.lakehouse, self.query, batch_id, rows)
            return
        self._wait()  # for the batch before: its failure fails this one, and rows stay in order
        pending = _write_pending(self.lakehouse, self.query, batch_id, rows)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rulewatch-metrics-{self.query}")
        # In this batch's context: a write must know whether its batch may repeat (sinks.per_run).
        self._last = self._pool.submit(contextvars.copy_context().run, _append_pending, spark, self.lakehouse, self.query, pending)

    def drain(self) -> None:
        """After the query has stopped: wait for the last rows, end the thread, raise what the append raised."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._wait()

    def _wait(self) -> None:
        last, self._last = self._last, None
        if last is not None:
            last.result()


def _pending_folder(lakehouse: Lakehouse, query: str) -> Path:
    return Path(lakehouse.checkpoint(query), PENDING)


def _write_pending(lakehouse: Lakehouse, query: str, batch_id: int, rows: list[dict[str, Any]]) -> Path:
    folder = _pending_folder(lakehouse, query)
    folder.mkdir(parents=True, exist_ok=True)
    path, partial = folder / f"{batch_id}.json", folder / f".{batch_id}.json.tmp"
    stored = [{k: v.isoformat() if k in _TIMESTAMPS and v is not None else v for k, v in row.items()} for row in rows]
    partial.write_text(json.dumps(stored), encoding="utf-8")
    os.replace(partial, path)  # a crash leaves the whole file or none
    return path


def _append_pending(spark: SparkSession, lakehouse: Lakehouse, query: str, path: Path) -> None:
    stored = json.loads(path.read_text(encoding="utf-8"))
    rows = [{k: datetime.fromisoformat(v) if k in _TIMESTAMPS and v is not None else v for k, v in row.items()} for row in stored]
    record_rows(spark, lakehouse, query, int(path.stem), rows)
    path.unlink()


def flush_pending(spark: SparkSession | None, lakehouse: Lakehouse, query: str) -> None:
    """Append the rows a stopped or crashed run of ``query`` left behind, oldest batch first.

    Each append is checked against the table's history (outside a query, ``append_once`` always
    checks), so a file whose rows reached the table before the crash is not appended twice."""
    folder = _pending_folder(lakehouse, query)
    files = sorted(folder.glob("*.json"), key=lambda p: int(p.stem)) if folder.is_dir() else []
    if files and spark is None:
        raise ValueError(f"{folder} holds metrics rows to append first; that needs a SparkSession (spark=...)")
    for path in files:
        _append_pending(spark, lakehouse, query, path)
