"""Latency figures of pipeline_metrics: nearest-rank percentiles over alert latencies."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rulewatch.spark.metrics import latency_columns, percentile


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
