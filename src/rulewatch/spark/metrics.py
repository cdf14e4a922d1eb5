"""gold/pipeline_metrics: one row per micro-batch of each layer, written like every other sink.

Each layer's row goes in as its own sink (``rulewatch.metrics.<query>``, sinks.append_once), so a
replayed batch neither loses nor repeats its metrics row. Latencies are measured from times
recorded in the data (bronze ingest time, event time) to the moment the gold batch has committed
its alerts.
"""

from __future__ import annotations

import math
import time
from datetime import datetime, timezone
from typing import Any, Sequence

from pyspark.sql import SparkSession

from rulewatch.spark.lakehouse import Lakehouse
from rulewatch.spark.schema import PIPELINE_METRICS
from rulewatch.spark.sinks import append_once
from rulewatch.spark.tables import ensure_table


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
