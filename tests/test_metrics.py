"""pipeline_metrics: nearest-rank latency percentiles, and live batches' rows gathered into fewer commits."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from rulewatch.spark.storage.checkpoints import check_queries
from rulewatch.spark.storage.delta_log import committed_batches
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.storage.schema import PIPELINE_METRICS
from rulewatch.spark.storage.metrics import (
    PENDING, Recorder, Steps, _write_pending, ensure_metrics_table, flush_pending, latency_columns, metrics_row, percentile,
)  # fmt: skip
from rulewatch.spark.layers.pipeline import metrics_gathered
from rulewatch.spark.runtime.session import foreach_batch_runs_here
from rulewatch.spark.storage.sinks import history_batches, per_run
from rulewatch.spark.storage.tables import read


def test_steps_add_up_each_named_steps_time_and_keep_a_failed_steps():
    steps = Steps()
    with steps("parse"):
        time.sleep(0.02)
    assert steps.timed("parse", lambda: time.sleep(0.01) or "done")() == "done"
    with pytest.raises(ValueError), steps("append"):
        raise ValueError
    assert set(steps.ms) == {"parse", "append"} and steps.ms["parse"] >= 30 and steps.ms["append"] >= 0


def test_nearest_rank_percentiles_are_observed_values():
    values = [120, 80, 400, 95, 101]
    assert percentile(values, 50) == 101
    assert percentile(values, 95) == 400
    assert percentile(values, 0) == 80
    assert percentile([], 99) is None


@given(st.lists(st.integers(0, 10**6), min_size=1), st.floats(0, 100))
def test_a_percentile_has_at_least_that_share_of_values_at_or_below_it(values, q):
    p = percentile(values, q)
    assert p in values
    assert sum(v <= p for v in values) >= q / 100 * len(values)
    assert sum(v < p for v in values) < max(1, q / 100 * len(values))


def test_latencies_run_from_ingest_and_event_time_to_the_commit():
    cols = latency_columns(ingest_ms=[1_000, 1_500, 1_900], event_ms=[500, 600, 700], committed_ms=2_000)
    assert (cols["latency_p50_ms"], cols["latency_max_ms"]) == (500, 1_000)
    assert (cols["event_latency_p50_ms"], cols["event_latency_p99_ms"]) == (1_400, 1_500)
    assert latency_columns([], [], 2_000)["latency_p99_ms"] is None


def _rows(spark, lakehouse: Lakehouse, layer: str) -> list[tuple[int, int]]:
    metrics = read(spark, lakehouse.pipeline_metrics).where(F.col("layer") == layer)
    return sorted((r.batch_id, r.rows_in) for r in metrics.collect())


@pytest.mark.jvm
def test_rows_gathered_over_batches_reach_the_table_once_in_order(spark, tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    ensure_metrics_table(spark, lakehouse)
    recorder = Recorder(lakehouse, "gold", every=3600)
    started = time.time()
    commits = lambda: len(list(Path(lakehouse.pipeline_metrics, "_delta_log").glob("*.json")))  # noqa: E731
    before = commits()

    def batch(_, batch_id):  # as a live gold batch ends
        recorder.record_rows(spark, batch_id, [metrics_row("gold", batch_id, started, started + 0.5, rows_in=batch_id * 10)])

    run = per_run(batch)
    for batch_id in range(4):
        run(None, batch_id)
    assert commits() == before and _rows(spark, lakehouse, "gold") == []  # kept, not committed
    recorder.flush(spark)  # as a stop does
    assert commits() == before + 1  # four batches' rows, one commit
    assert _rows(spark, lakehouse, "gold") == [(b, b * 10) for b in range(4)]
    assert not list(Path(lakehouse.checkpoint("gold"), PENDING).iterdir())
    row = read(spark, lakehouse.pipeline_metrics).where("batch_id = 3").first()
    # The times survive the file: the same instants as written at once.
    assert (row.batch_end - row.batch_start).total_seconds() == 0.5 and row.processing_ms == 500
    assert abs(row.batch_start.timestamp() - started) < 1e-3
    # Past ``every`` seconds, the batch that ends commits what was kept.
    recorder.every = 1e-9
    run(None, 4)
    assert _rows(spark, lakehouse, "gold")[-1] == (4, 40) and commits() == before + 2


@pytest.mark.jvm
def test_rows_a_killed_run_left_kept_are_appended_once(spark, tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    ensure_metrics_table(spark, lakehouse)
    now = time.time()
    rows = {b: [metrics_row("gold", b, now, now, rows_in=b)] for b in (6, 7, 8)}
    # Batches 6 and 7 were committed together, but the kill came before their files were removed.
    for b in (6, 7):
        _write_pending(lakehouse, "gold", b, rows[b])
    flush_pending(spark, lakehouse, "gold")
    for b in (6, 7, 8):
        _write_pending(lakehouse, "gold", b, rows[b])
    flush_pending(spark, lakehouse, "gold")
    assert _rows(spark, lakehouse, "gold") == [(6, 6), (7, 7), (8, 8)]
    assert not list(Path(lakehouse.checkpoint("gold"), PENDING).iterdir())
    # The start-up checks append them first (tests/test_live_crash.py kills a run to leave them).
    _write_pending(lakehouse, "gold", 9, [metrics_row("gold", 9, now, now)])
    with pytest.raises(ValueError, match="needs a SparkSession"):
        check_queries(lakehouse, "gold")


@pytest.mark.jvm
def test_rows_an_older_release_kept_reach_its_table_without_the_columns_added_since(spark, tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    older = StructType([f for f in PIPELINE_METRICS.fields if f.name != "step_ms"])
    spark.createDataFrame([], older).write.format("delta").save(lakehouse.pipeline_metrics)
    now = time.time()
    _write_pending(lakehouse, "gold", 3, [metrics_row("gold", 3, now, now, rows_in=5)])  # as that release wrote it
    flush_pending(spark, lakehouse, "gold", at_start=True)  # as a start's checks do (check_queries), before any table is ensured
    table = spark.read.format("delta").load(lakehouse.pipeline_metrics)
    assert "step_ms" in table.columns and [(r.batch_id, r.rows_in, r.step_ms) for r in table.collect()] == [(3, 5, None)]


@pytest.mark.jvm
def test_a_job_run_appends_its_layers_rows_in_one_commit_that_each_layer_recognises(spark, tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    ensure_metrics_table(spark, lakehouse)
    log = Path(lakehouse.pipeline_metrics, "_delta_log")
    commits = lambda: len(list(log.glob("*.json")))  # noqa: E731
    now = time.time()
    batches = {"bronze": 4, "silver": 2, "gold": 7}
    rows = {q: [metrics_row(q, b, now, now, rows_in=b)] for q, b in batches.items()}
    for query, batch_id in batches.items():
        _write_pending(lakehouse, query, batch_id, rows[query])
    before = commits()
    flush_pending(spark, lakehouse, *batches)
    assert commits() == before + 1
    assert {q: _rows(spark, lakehouse, q) for q in batches} == {q: [(b, b)] for q, b in batches.items()}
    # A kill before the files were removed: each layer's start (check_queries) finds its batch in that one commit.
    for query, batch_id in batches.items():
        _write_pending(lakehouse, query, batch_id, rows[query])
    for query in batches:
        flush_pending(spark, lakehouse, query)
    assert commits() == before + 1
    assert {q: _rows(spark, lakehouse, q) for q in batches} == {q: [(b, b)] for q, b in batches.items()}
    assert committed_batches(lakehouse.pipeline_metrics, "rulewatch.metrics.") == {f"rulewatch.metrics.{q}": b for q, b in batches.items()}
    # The catalog path reads the same commit through DESCRIBE HISTORY.
    assert history_batches(spark, lakehouse.pipeline_metrics, "rulewatch.metrics.") == {f"rulewatch.metrics.{q}": b for q, b in batches.items()}


@pytest.mark.jvm
def test_a_job_gathers_its_metrics_where_its_batches_write_files_it_can_read(spark, tmp_path):
    assert foreach_batch_runs_here(spark)  # a classic session (tests/test_connect.py: a local Connect server)
    with metrics_gathered(spark, Lakehouse(str(tmp_path / "lakehouse"))) as recorders:
        assert {layer: r.every for layer, r in recorders.items()} == {"bronze": math.inf, "silver": math.inf, "gold": math.inf}
    # Checkpoints on object storage: nothing to read the files back from, so each batch commits its rows.
    with metrics_gathered(spark, Lakehouse("s3://bucket/lakehouse")) as recorders:
        assert {r.every for r in recorders.values()} == {0}
