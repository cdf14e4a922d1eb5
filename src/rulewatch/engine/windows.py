"""Per-event look-back window math over many keys at once (plain numpy, no Spark).

Every function takes columnar arrays already sorted by ``(group, time, id)``, where ``group`` is a
dense integer per key. Position ``i`` is one event; its window is the positions ``lo[i]..i`` of
the same group whose time is at or after the window start (brief §3: both ends inclusive, ties
ordered by id, the event itself included). Working on all keys of a micro-batch in one call is what
makes the evaluator fast: per-key Python work costs milliseconds, one vectorised call microseconds.

Numbers are exact: money arrives as int64 in minor units (cents), limits as Decimal, and every
comparison is done in integers, never in floats.
"""

from __future__ import annotations

import math
from collections import Counter
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pyarrow as pa

from rulewatch.engine.rules import Aggregator, Operator

INT64_MAX = np.iinfo(np.int64).max
INT64_MIN = np.iinfo(np.int64).min
MAX_SPAN_MS = 2**62


def window_start(time: np.ndarray, window_ms: int, bucket_ms: int = 0) -> np.ndarray:
    """Inclusive start of each event's window; bucketed windows start on a bucket boundary."""
    # Rules may ask for windows up to the largest duration we parse; saturate instead of wrapping.
    start = time - min(window_ms, MAX_SPAN_MS)
    if bucket_ms:
        start = (start // bucket_ms) * bucket_ms
    return start


def window_lo(group: np.ndarray, time: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Index of the first event of each event's window (same group, time >= start)."""
    if len(time) == 0:
        return np.zeros(0, dtype=np.int64)
    base = int(min(start.min(), time.min()))
    span = int(time.max()) - base + 1
    if int(group.max()) * span < 2**62:
        # One composite key turns "same group and time >= start" into a single binary search.
        composite = group * span + (time - base)
        return np.searchsorted(composite, group * span + (start - base), side="left").astype(np.int64)
    lo = np.empty(len(time), dtype=np.int64)
    bounds = np.flatnonzero(np.diff(group)) + 1
    for first, last in zip(np.r_[0, bounds], np.r_[bounds, len(group)]):
        lo[first:last] = first + np.searchsorted(time[first:last], start[first:last], side="left")
    return lo


def _prefix(values: np.ndarray) -> np.ndarray:
    out = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(values, out=out[1:])
    return out


def _sparse_table(values: np.ndarray, fn) -> list[np.ndarray]:
    table = [values]
    width = 1
    while width * 2 <= len(values):
        prev = table[-1]
        table.append(fn(prev[:-width], prev[width:]))
        width *= 2
    return table


def _range_query(table: list[np.ndarray], lo: np.ndarray, hi: np.ndarray, fn) -> np.ndarray:
    """fn over values[lo..hi] inclusive for every (lo, hi) pair, O(1) each via a sparse table."""
    length = hi - lo + 1
    level = np.floor(np.log2(length)).astype(np.int64)
    out = np.empty(len(lo), dtype=np.int64)
    for k in np.unique(level):
        sel = level == k
        row = table[k]
        out[sel] = fn(row[lo[sel]], row[hi[sel] - (1 << k) + 1])
    return out


class WindowAggregates:
    """Aggregates of one rule's field over the windows of the positions ``pos``.

    ``value`` is int64 (minor units for money, counts for COUNT/UNIQUE_COUNT) with ``valid`` False
    where the aggregate is null (MIN/MAX/AVG over no non-null value); for AVG, ``value`` holds the
    window SUM and ``nonnull`` the divisor, so comparisons stay exact.
    """

    def __init__(self, value: np.ndarray, valid: np.ndarray, count: np.ndarray, nonnull: np.ndarray):
        self.value = value
        self.valid = valid
        self.count = count
        self.nonnull = nonnull


def aggregate(
    aggregator: Aggregator,
    values: np.ndarray,
    valid: np.ndarray,
    lo: np.ndarray,
    pos: np.ndarray,
) -> WindowAggregates:
    """Aggregate ``values`` (int64, or object for strings; ``valid`` marks non-null) over lo..pos."""
    count = pos - lo[pos] + 1
    lo_p = lo[pos]
    if aggregator is Aggregator.COUNT:
        return WindowAggregates(count.astype(np.int64), np.ones(len(pos), bool), count, count)
    nonnull_prefix = _prefix(valid.astype(np.int64))
    nonnull = nonnull_prefix[pos + 1] - nonnull_prefix[lo_p]
    if aggregator in (Aggregator.SUM, Aggregator.AVG):
        sums = _prefix(np.where(valid, values, 0).astype(np.int64))
        total = sums[pos + 1] - sums[lo_p]
        has = np.ones(len(pos), bool) if aggregator is Aggregator.SUM else nonnull > 0
        return WindowAggregates(total, has, count, nonnull)
    if aggregator in (Aggregator.MIN, Aggregator.MAX):
        fn = np.minimum if aggregator is Aggregator.MIN else np.maximum
        sentinel = INT64_MAX if aggregator is Aggregator.MIN else INT64_MIN
        table = _sparse_table(np.where(valid, values, sentinel).astype(np.int64), fn)
        out = _range_query(table, lo_p, pos, fn) if len(pos) else np.zeros(0, np.int64)
        return WindowAggregates(out, nonnull > 0, count, nonnull)
    if aggregator is Aggregator.UNIQUE_COUNT:
        distinct = distinct_counts(values, valid, lo, pos)
        return WindowAggregates(distinct, np.ones(len(pos), bool), count, nonnull)
    raise ValueError(f"unsupported aggregator {aggregator}")


def distinct_counts(values: np.ndarray, valid: np.ndarray, lo: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Distinct non-null values in each window, with one sliding multiset over the sorted arrays."""
    out = np.zeros(len(pos), dtype=np.int64)
    if len(pos) == 0:
        return out
    wanted = np.zeros(len(values), dtype=np.int64) - 1
    wanted[pos] = np.arange(len(pos))
    window: Counter = Counter()
    left = 0
    py_values = values.tolist()
    py_valid = valid.tolist()
    lo_list = lo.tolist()
    last = int(pos.max())
    # lo is non-decreasing over the whole sorted array (a new group starts past the old one), so
    # one left pointer that only moves forward keeps the multiset equal to the current window.
    for i in range(last + 1):
        start = lo_list[i]
        while left < start:
            if py_valid[left]:
                v = py_values[left]
                window[v] -= 1
                if not window[v]:
                    del window[v]
            left += 1
        if py_valid[i]:
            window[py_values[i]] += 1
        slot = wanted[i]
        if slot >= 0:
            out[slot] = len(window)
    return out


def _limit_fraction(limit: Decimal, scale: int) -> Fraction:
    return Fraction(limit) * (10**scale)


def compare(operator: Operator, agg: WindowAggregates, limit: Decimal, scale: int, aggregator: Aggregator) -> np.ndarray:
    """Exact ``aggregate <op> limit`` per position; null aggregates never hold.

    ``scale`` is the number of decimal places the aggregate's integers carry (2 for money, 0 for
    counts). Integers are compared with floor/ceil of the scaled limit, which is exact; AVG compares
    SUM against limit × count with Python integers instead of dividing.
    """
    target = _limit_fraction(limit, scale)
    if aggregator is Aggregator.AVG:
        lhs = agg.value.astype(object) * target.denominator
        rhs = agg.nonnull.astype(object) * target.numerator
        holds = np.array([operator.holds(Decimal(a), Decimal(b)) for a, b in zip(lhs, rhs)], dtype=bool)
        return holds & agg.valid
    x = agg.value
    floor_t, ceil_t = math.floor(target), math.ceil(target)
    is_int = floor_t == ceil_t
    if operator is Operator.GREATER:
        holds = x > floor_t if floor_t <= INT64_MAX else np.zeros(len(x), bool)
    elif operator is Operator.GREATER_EQUAL:
        holds = x >= ceil_t if ceil_t <= INT64_MAX else np.zeros(len(x), bool)
    elif operator is Operator.LESS:
        holds = x < ceil_t if ceil_t >= INT64_MIN else np.zeros(len(x), bool)
    elif operator is Operator.LESS_EQUAL:
        holds = x <= floor_t if floor_t >= INT64_MIN else np.zeros(len(x), bool)
    elif operator is Operator.EQUAL:
        holds = (x == floor_t) if is_int and INT64_MIN <= floor_t <= INT64_MAX else np.zeros(len(x), bool)
    else:
        holds = (x != floor_t) if is_int and INT64_MIN <= floor_t <= INT64_MAX else np.ones(len(x), bool)
    return np.asarray(holds, dtype=bool) & agg.valid


def to_decimal(aggregator: Aggregator, agg: WindowAggregates, i: int, scale: int) -> Decimal:
    """The reported value of position ``i``: Decimal money, AVG to 6 places, integer counts."""
    if aggregator in (Aggregator.COUNT, Aggregator.UNIQUE_COUNT):
        return Decimal(int(agg.value[i]))
    units = Decimal(int(agg.value[i])).scaleb(-scale)
    if aggregator is Aggregator.AVG:
        return (units / Decimal(int(agg.nonnull[i]))).quantize(Decimal("0.000001"))
    return units


def decimal_texts(aggregator: Aggregator, agg: WindowAggregates, idx: np.ndarray, scale: int) -> pa.StringArray:
    """``str(to_decimal(...))`` of many positions at once, null where the aggregate is null.

    An Arrow array: with many keys a batch reports one value per key touched, and Arrow prints
    them without a Python string each (the output goes to Spark as Arrow anyway)."""
    valid = agg.valid[idx]
    if aggregator is Aggregator.AVG:  # divides: one by one
        texts = [str(to_decimal(aggregator, agg, i, scale)) if ok else None for i, ok in zip(idx.tolist(), valid.tolist())]
        return pa.array(texts, pa.string())
    units = agg.value[idx]
    if aggregator in (Aggregator.COUNT, Aggregator.UNIQUE_COUNT) or scale == 0:
        return pa.array(units, mask=~valid).cast(pa.string())
    # Minor units are the unscaled values of a decimal with ``scale`` places: sign-extended to
    # Arrow's 128-bit little-endian layout, Arrow prints them exactly ("-0.05", "123.40").
    wide = np.empty((len(units), 2), dtype=np.int64)
    wide[:, 0] = units
    wide[:, 1] = units >> 63
    validity = pa.array(valid, pa.bool_()).buffers()[1]
    return pa.Array.from_buffers(pa.decimal128(38, scale), len(units), [validity, pa.py_buffer(wide)]).cast(pa.string())
