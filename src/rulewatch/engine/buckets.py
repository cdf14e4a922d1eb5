"""Bucketed rules: per-bucket aggregates instead of raw events, so per-event cost stays flat.

A bucketed rule's window starts on a bucket boundary (windows.window_start), so every window is
whole buckets plus the newest, still-open part. Buckets that end at or before the watermark can no
longer receive an event (anything older is late and not evaluated), so they are folded into one
summary row each: sum, count, non-null count, min, max (and the distinct values for UNIQUE_COUNT).
The window of an event is then its raw events from the fold point on plus a suffix of the folded
buckets — O(1) per event from suffix arrays, whatever the window holds. Raw events are kept only
for the open buckets (retention = one bucket), unless an exact rule of the same keyset needs more.

A summary is per (key, rule) and tied to what it aggregates (field, aggregator, filter, bucket,
clear point): a rule changed in any of those starts a new summary from the raw events retained.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rulewatch.engine.rules import Aggregator, Rule
from rulewatch.engine.windows import INT64_MAX, INT64_MIN, WindowAggregates

NOT_FOLDED = -(2**62)  # fold point of a rule with no summary: every retained raw event counts

Summary = dict[str, Any]  # keys: fp, to, start, sum, count, nonnull, min, max, values


def fingerprint(rule: Rule, cleared: int | None) -> str:
    return f"{rule.aggregate_field}|{rule.aggregator.value}|{rule.filter}|{rule.bucket_ms}|{cleared}"


def current(entry: dict | None, fp: str) -> Summary | None:
    """The summary in a key's memory entry for this rule, if it still describes the rule."""
    summary = (entry or {}).get("buckets")
    return summary if summary is not None and summary["fp"] == fp else None


def fold(
    summary: Summary | None,
    fp: str,
    rule: Rule,
    time: np.ndarray,
    values: np.ndarray,
    valid: np.ndarray,
    fold_to: int,
    keep_from: int,
) -> Summary:
    """``summary`` extended with the buckets of the raw events in [its fold point, ``fold_to``)
    (``time`` sorted, already filtered to what the rule sees), minus buckets starting before
    ``keep_from`` that no future window can reach."""
    start_at = summary["to"] if summary else NOT_FOLDED
    if summary is not None and fold_to <= start_at:
        return summary
    take = (time >= start_at) & (time < fold_to)
    t, v, ok = time[take], values[take], valid[take]
    b = rule.bucket_ms
    starts = t // b * b
    fresh = _bucket_rows(rule.aggregator, starts, v, ok)
    merged = _concat(summary, fresh) if summary else fresh
    keep = merged["start"] >= keep_from
    out: Summary = {k: merged[k][keep] for k in _NUMERIC}
    out["values"] = [v for v, kept in zip(merged["values"], keep.tolist()) if kept]
    out.update(fp=fp, to=fold_to)
    return out


_NUMERIC = ("start", "sum", "count", "nonnull", "min", "max")


def _bucket_rows(aggregator: Aggregator, starts: np.ndarray, values: np.ndarray, valid: np.ndarray) -> Summary:
    if len(starts) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return {"start": empty, "sum": empty, "count": empty, "nonnull": empty, "min": empty, "max": empty, "values": []}
    firsts = np.flatnonzero(np.r_[True, starts[1:] != starts[:-1]])
    numeric = aggregator not in (Aggregator.UNIQUE_COUNT, Aggregator.COUNT) and values.dtype != object
    ints = np.where(valid, values, 0).astype(np.int64) if numeric else np.zeros(len(starts), np.int64)
    lows = np.where(valid, values, INT64_MAX).astype(np.int64) if numeric else ints
    highs = np.where(valid, values, INT64_MIN).astype(np.int64) if numeric else ints
    bounds = np.r_[firsts, len(starts)]
    distinct = (
        [frozenset(values[a:z][valid[a:z]].tolist()) for a, z in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
        if aggregator is Aggregator.UNIQUE_COUNT
        else []
    )
    return {
        "start": starts[firsts],
        "sum": np.add.reduceat(ints, firsts),
        "count": np.diff(bounds).astype(np.int64),
        "nonnull": np.add.reduceat(valid.astype(np.int64), firsts),
        "min": np.minimum.reduceat(lows, firsts),
        "max": np.maximum.reduceat(highs, firsts),
        "values": distinct,
    }


def _concat(old: Summary, new: Summary) -> Summary:
    # Fold points are bucket boundaries, so no bucket is split between old and new rows.
    out = {k: np.concatenate([old[k], new[k]]) for k in _NUMERIC}
    out["values"] = list(old["values"]) + list(new["values"])
    return out


class Suffixes:
    """Aggregates of a summary's buckets from index i to the end, for any i, in O(1)."""

    def __init__(self, summary: Summary) -> None:
        self.start = summary["start"]
        self.sum = _suffix(summary["sum"], np.add)
        self.count = _suffix(summary["count"], np.add)
        self.nonnull = _suffix(summary["nonnull"], np.add)
        self.min = _suffix(summary["min"], np.minimum, INT64_MAX)
        self.max = _suffix(summary["max"], np.maximum, INT64_MIN)
        self._values = summary["values"]
        self._unions: dict[int, frozenset] = {}

    def first_at_or_after(self, window_start: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.start, window_start, side="left")

    def distinct(self, i: int) -> frozenset:
        if i not in self._unions:
            self._unions[i] = frozenset().union(*self._values[i:])
        return self._unions[i]


def _suffix(col: np.ndarray, fn, empty: int = 0) -> np.ndarray:
    """out[i] = fn over col[i:], out[len] = the empty value."""
    out = np.full(len(col) + 1, empty, dtype=np.int64)
    if len(col):
        out[:-1] = fn.accumulate(col[::-1])[::-1]
    return out


def add_folded(aggregator: Aggregator, agg: WindowAggregates, at: np.ndarray, suffixes: Suffixes, i: np.ndarray, raw_sets: list[set] | None) -> None:
    """Fold the buckets from index ``i`` on into the window aggregates at positions ``at``.

    ``agg.count`` and ``agg.nonnull`` must be distinct arrays (COUNT's share one: copy first)."""
    cnt, nn = suffixes.count[i], suffixes.nonnull[i]
    agg.count[at] += cnt
    if aggregator is Aggregator.COUNT:
        agg.value[at] += cnt
        agg.nonnull[at] += cnt
        return
    agg.nonnull[at] += nn
    if aggregator in (Aggregator.SUM, Aggregator.AVG):
        agg.value[at] += suffixes.sum[i]
        if aggregator is Aggregator.AVG:
            agg.valid[at] = agg.nonnull[at] > 0
    elif aggregator in (Aggregator.MIN, Aggregator.MAX):
        was = agg.valid[at]
        if aggregator is Aggregator.MIN:
            agg.value[at] = np.where(was, np.minimum(agg.value[at], suffixes.min[i]), suffixes.min[i])
        else:
            agg.value[at] = np.where(was, np.maximum(agg.value[at], suffixes.max[i]), suffixes.max[i])
        agg.valid[at] = was | (nn > 0)
    elif aggregator is Aggregator.UNIQUE_COUNT:
        assert raw_sets is not None
        agg.value[at] = [len(raw | suffixes.distinct(int(k))) for raw, k in zip(raw_sets, i.tolist())]
