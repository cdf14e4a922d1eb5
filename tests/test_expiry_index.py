"""The expiry index: keys are re-checked at or after their expiry, never before, in a bounded number of entries."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rulewatch.engine.engine import KEY_SEPARATOR
from rulewatch.spark.evaluator import expiry_buckets

KEYSETS = {"payeeId": 60_000, "userId": 900_000}

expiries = st.dictionaries(
    st.tuples(st.sampled_from(sorted(KEYSETS)), st.text("abc", min_size=1, max_size=4)).map(
        lambda k: f"{k[0]}{KEY_SEPARATOR}{k[1]}"
    ),
    st.integers(0, 48 * 3_600_000),
    max_size=60,
)


@given(expiries, st.integers(2, 20))
def test_every_key_is_indexed_once_at_or_after_its_expiry(expiry_ms, max_entries):
    buckets = expiry_buckets(expiry_ms, KEYSETS, max_entries)
    assert len(buckets) <= max_entries
    indexed = [(key, at) for at, keys in buckets.items() for key in keys]
    assert sorted(k for k, _ in indexed) == sorted(expiry_ms)
    assert all(at >= expiry_ms[key] for key, at in indexed)


def test_a_narrow_batch_keeps_the_configured_steps():
    minute = 60_000
    expiry_ms = {f"payeeId{KEY_SEPARATOR}p{i}": 10 * minute + i * 1000 for i in range(30)}  # within one minute
    first = f"payeeId{KEY_SEPARATOR}p0"  # expires exactly on the minute
    assert expiry_buckets(expiry_ms, KEYSETS) == {10 * minute: {first}, 11 * minute: set(expiry_ms) - {first}}


def test_a_wide_batch_is_indexed_under_coarser_times_not_hundreds():
    hour = 3_600_000
    expiry_ms = {f"payeeId{KEY_SEPARATOR}p{i}": i * 60_000 + 1 for i in range(12 * 60)}  # 12 h of expiries, 1 min apart
    buckets = expiry_buckets(expiry_ms, KEYSETS, max_entries=16)
    assert 8 <= len(buckets) <= 16  # doubled steps until they fit, not one huge step
    assert max(at - expiry_ms[k] for at, keys in buckets.items() for k in keys) < 2 * hour
