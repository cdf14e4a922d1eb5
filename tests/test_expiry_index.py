"""The expiry index: keys are re-checked at or after their expiry, never before, in a bounded number of entries."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rulewatch.engine.engine import KEY_SEPARATOR
from rulewatch.spark.evaluator import expiry_buckets, settle_expiry

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


def _key(name: str, keyset: str = "payeeId") -> str:
    return f"{keyset}{KEY_SEPARATOR}{name}"


def _settled_one_timer_at_a_time(entries, due, watermark, span_of):
    """The same decision taken the way the timers fire: in time order, each entry removed once
    settled, a key skipped while a later entry (due or not) still holds it."""
    remaining = dict(entries)
    unread, read = set(), set()
    for time in sorted(due):
        spans, keys = remaining.pop(time)
        later = set().union(*(k for t, (_, k) in remaining.items() if t > time))
        for key in keys - later:
            keyset = key.split(KEY_SEPARATOR, 1)[0]
            if spans is not None and watermark > time and span_of(keyset) <= spans.get(keyset, -1):
                unread.add(key)
            else:
                read.add(key)
    return unread, read


index_entries = st.dictionaries(
    st.integers(0, 20),
    st.tuples(
        st.one_of(st.none(), st.fixed_dictionaries({}, optional={ks: st.sampled_from([60_000, 900_000]) for ks in KEYSETS})),
        st.sets(st.builds(_key, st.text("abc", min_size=1, max_size=2), st.sampled_from(sorted(KEYSETS))), max_size=8),
    ),
    min_size=1,
    max_size=8,
)


@given(index_entries, st.integers(0, 22), st.data())
def test_settling_every_due_entry_at_once_decides_like_one_timer_at_a_time(entries, watermark, data):
    # The firing timer is one of the entries; every entry before the watermark fires in the same batch.
    at = data.draw(st.sampled_from(sorted(entries)))
    due = [t for t in entries if t < watermark or t == at]
    unread, read = settle_expiry(entries, due, watermark, KEYSETS.__getitem__)
    assert (unread, read) == _settled_one_timer_at_a_time(entries, due, watermark, KEYSETS.__getitem__)
    assert not unread & read


def test_a_key_indexed_again_later_is_settled_by_its_newest_entry():
    a, b, c = _key("a"), _key("b"), _key("c")
    spans = {"payeeId": 60_000}
    entries = {10: (spans, {a, b, c}), 20: (spans, {b}), 30: (None, {c})}
    # b's newer entry is due too: purged unread there. c's newer entry is not due: left to it.
    assert settle_expiry(entries, [10, 20], watermark=25, span_of=KEYSETS.__getitem__) == ({a, b}, set())
    # When 30 fires, its entry has no recorded spans: c is read.
    assert settle_expiry(entries, [10, 20, 30], watermark=40, span_of=KEYSETS.__getitem__) == ({a, b}, {c})
    # A wider rule since: every key is read, none purged unread.
    assert settle_expiry(entries, [10, 20], watermark=25, span_of=lambda _: 7_200_000) == (set(), {a, b})
