"""The expiry index: keys are re-checked at or after their expiry, never before, in a bounded number of entries."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rulewatch.engine.engine import KEY_SEPARATOR
from rulewatch.engine.windows import MAX_SPAN_MS
from rulewatch.spark.evaluator.shard import expiry_buckets, settle_expiry

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


def _buckets_by_definition(expiry_ms: dict[str, int], steps: dict[str, int], max_entries: int) -> dict[int, set[str]]:
    """Each key's expiry rounded up to its keyset's step (capped at MAX_SPAN_MS), one key at a time,
    every step doubled while that gives more than ``max_entries`` times."""
    factor = 1
    while True:
        buckets: dict[int, set[str]] = {}
        for key, at in expiry_ms.items():
            step = steps[key.split(KEY_SEPARATOR, 1)[0]] * factor
            buckets.setdefault(min(-(-at // step) * step, MAX_SPAN_MS), set()).add(key)
        if len(buckets) <= max_entries:
            return buckets
        factor *= 2


times = st.one_of(
    st.integers(-(2**61), 2**61),
    st.integers(0, 48 * 3_600_000),
    st.integers(MAX_SPAN_MS - 10**6, MAX_SPAN_MS),  # saturated expiries (a key that never expires)
)


@settings(max_examples=300)
@given(
    st.dictionaries(st.tuples(st.sampled_from(["payeeId", "userId", "ip"]), st.text("ab", min_size=1, max_size=5)), times, max_size=80),
    st.fixed_dictionaries({ks: st.one_of(st.integers(1, 10**7), st.integers(2**40, 2**62)) for ks in ("payeeId", "userId", "ip")}),
    st.integers(2, 20),  # two entries always suffice (times round to 0 or MAX_SPAN_MS at the latest)
)
def test_the_index_is_the_rounding_by_definition(keyed, steps, max_entries):
    # The index rounds whole arrays and tries coarser steps on rounded times; it must give exactly
    # what rounding each key's expiry on its own gives, saturated times and huge steps included.
    expiry_ms = {f"{ks}{KEY_SEPARATOR}{name}": at for (ks, name), at in keyed.items()}
    assert expiry_buckets(expiry_ms, steps, max_entries) == _buckets_by_definition(expiry_ms, steps, max_entries)


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


# Touches of a shard's keys in time order: (key, event time, the key's span then). Each touch indexes
# the key under its expiry (event time + span, rounded up to 2), as ``_index_expiry`` does.
touches = st.lists(
    st.tuples(st.sampled_from([_key("a"), _key("b"), _key("a", "userId")]), st.integers(0, 8), st.sampled_from([1, 5])),
    min_size=1,
    max_size=12,
).map(lambda ts: sorted(ts, key=lambda t: t[1]))


@settings(max_examples=500)
@given(touches, st.sets(st.integers(0, 14), max_size=2), st.sampled_from([1, 3, 5]), st.integers(0, 14), st.data())
def test_no_key_is_purged_unread_before_its_newest_event_stops_mattering(touched, legacy, span_now, watermark, data):
    entries: dict[int, tuple[dict[str, int] | None, set[str]]] = {}
    last: dict[str, int] = {}
    for key, at, span in touched:
        keyset = key.split(KEY_SEPARATOR, 1)[0]
        time = -(-(at + span) // 2) * 2
        # Entries at a ``legacy`` time were written before spans were recorded, and stay without.
        old_spans, keys = entries.get(time, ({} if time not in legacy else None, set()))
        spans = None if old_spans is None else {**old_spans, keyset: min(span, old_spans.get(keyset, span))}
        entries[time] = (spans, keys | {key})
        last[key] = at
    at = data.draw(st.sampled_from(sorted(entries)))  # the timer that fires
    due, unread, read = settle_expiry(entries, at, watermark, lambda keyset: span_now)
    # Due: this timer's entry and every other whose timer fires in the batch (Spark: before the watermark).
    assert sorted(due) == sorted({t for t in entries if t < watermark} | {at})
    # Safe: a key goes unread only once the watermark has passed its newest event plus what it needs now.
    assert all(last[key] + span_now < watermark for key in unread), (entries, unread)
    # Complete: every key whose newest entry is due is settled now, one way; no other key is.
    newest = {key: max(t for t, (_, keys) in entries.items() if key in keys) for key in last}
    assert unread | read == {key for key, t in newest.items() if t in due}
    assert not unread & read


def test_a_key_indexed_again_later_is_settled_by_its_newest_entry():
    a, b, c = _key("a"), _key("b"), _key("c")
    spans = {"payeeId": 60_000}
    entries = {10: (spans, {a, b, c}), 20: (spans, {b}), 30: (None, {c})}
    # b's newer entry is due too: purged unread there. c's newer entry is not due: left to it.
    assert settle_expiry(entries, 10, watermark=25, span_of=KEYSETS.__getitem__) == ([10, 20], {a, b}, set())
    # When 30 fires, its entry has no recorded spans: c is read.
    assert settle_expiry(entries, 30, watermark=40, span_of=KEYSETS.__getitem__) == ([10, 20, 30], {a, b}, {c})
    # A wider rule since: every key is read, none purged unread.
    assert settle_expiry(entries, 10, watermark=25, span_of=lambda _: 7_200_000) == ([10, 20], set(), {a, b})


def test_a_key_indexed_under_a_narrower_rule_since_is_read_when_the_rule_widens_again():
    hour, k = 3_600_000, _key("k")
    # k was indexed under 5 h while a 5 h rule held; the rule narrowed to 1 h and k, touched again
    # just before 4 h, went under just before 5 h (so its newest entry is still the old one). Now
    # the rule is 2 h: k's newest event matters until nearly 6 h; the old entry's 5 h span must not
    # purge it unread.
    entries = {5 * hour: ({"payeeId": 5 * hour}, {k}), 5 * hour - 1: ({"payeeId": hour}, {k})}
    due, unread, read = settle_expiry(entries, 5 * hour, watermark=5 * hour + 1, span_of=lambda _: 2 * hour)
    assert (sorted(due), unread, read) == (sorted(entries), set(), {k})
