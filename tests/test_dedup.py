"""Gold straight from the source drops repeats as silver does: engine/dedup.py against silver's rule, written out.

The rule (layers/silver.py): in a batch, a later line of an id repeats the first; the first line
repeats an id an earlier batch accepted with an event time within the horizon. The model below
checks every earlier accepted line directly; the engine keeps only the times it still needs and drops
the rest as the watermark passes them, which must change nothing for a line that is not late.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rulewatch.engine.dedup import bucket_end, decide, expiry_bucket, kept_times

HORIZON = 1_000
GRANULARITY = 100


def silver_rule(batches: list[list[tuple[str, int]]], horizon: int) -> list[list[bool]]:
    accepted: list[tuple[str, int]] = []
    result = []
    for batch in batches:
        firsts, marks = set(), []
        for tid, at in batch:
            ok = tid not in firsts and not any(t == tid and abs(at - a) <= horizon for t, a in accepted)
            firsts.add(tid)
            marks.append(ok)
        accepted += [line for line, ok in zip(batch, marks) if ok]
        result.append(marks)
    return result


def with_state(batches: list[list[tuple[str, int]]], lateness: int) -> tuple[list[list[bool]], list[bool]]:
    """The engine as the operator drives it: the state, and the buckets' timers fired as the watermark
    (newest event time of the batches before, less ``lateness``) passes their ends. Also says, per batch,
    whether every line so far was on time (none behind its batch's watermark)."""
    seen: dict[str, list[int]] = {}
    due: dict[int, list[str]] = {}
    newest = None
    result, on_time = [], []
    for batch in batches:
        watermark = -(10**18) if newest is None else newest - lateness
        for bucket in sorted(b for b in due if bucket_end(b, GRANULARITY) <= watermark):
            for tid in due.pop(bucket):
                kept = kept_times(seen.get(tid, []), bucket_end(bucket, GRANULARITY), HORIZON)
                if kept:
                    seen[tid] = kept
                else:
                    seen.pop(tid, None)
        ids, times = [t for t, _ in batch], [a for _, a in batch]
        decided = decide(ids, times, {t: seen[t] for t in ids if t in seen}, HORIZON, GRANULARITY)
        seen.update(decided.times)
        for bucket, tids in decided.due.items():
            due.setdefault(bucket, []).extend(tids)
        result.append(decided.accepted)
        on_time.append(all(a >= watermark for a in times) and all(on_time))
        newest = max([*times, *([newest] if newest is not None else [])], default=None)
    return result, on_time


lines = st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 4_000)), max_size=8)


@settings(max_examples=400, deadline=None)
@given(st.lists(lines, min_size=1, max_size=8), st.integers(0, 1_500))
def test_the_state_decides_as_silver_while_every_line_is_on_time(batches, lateness):
    # A line later than the watermark is recorded by gold, not evaluated; it is checked against the
    # times still held, so after one, the two may differ (docs/design.md, "Gold straight from the source").
    expected = silver_rule(batches, HORIZON)
    got, on_time = with_state(batches, lateness)
    for batch, want, have, timely in zip(batches, expected, got, on_time):
        if timely:
            assert have == want, (batches, lateness)


def test_a_batch_keeps_the_first_line_of_an_id_whatever_the_times():
    decided = decide(["a", "b", "a", "a"], [10, 10, 5_000, 10], {}, HORIZON, GRANULARITY)
    assert decided.accepted == [True, True, False, False]
    assert decided.times == {"a": [10], "b": [10]}


def test_an_earlier_time_counts_only_within_the_horizon():
    decided = decide(["a", "b"], [2_000, 1_500], {"a": [1_000], "b": [499]}, HORIZON, GRANULARITY)
    assert decided.accepted == [False, True]
    assert decided.times == {"b": [499, 1_500]}  # the older time stays until its own bucket drops it
    assert decided.due == {expiry_bucket(1_500, HORIZON, GRANULARITY): ["b"]}


def test_a_bucket_drops_only_the_times_it_holds():
    bucket = expiry_bucket(499, HORIZON, GRANULARITY)
    assert kept_times([499, 1_500], bucket_end(bucket, GRANULARITY), HORIZON) == [1_500]
    assert 499 + HORIZON < bucket_end(bucket, GRANULARITY) <= 499 + HORIZON + GRANULARITY


def test_an_id_accepted_twice_keeps_its_newer_time_when_the_older_one_goes():
    # a at 0, then at 1,500 (beyond the horizon: accepted again); once 0's bucket is dropped, a at
    # 2,000 still repeats the 1,500 line.
    batches = [[("a", 0)], [("a", 1_500)], [("z", 2_000)], [("a", 2_000)]]
    got, on_time = with_state(batches, lateness=0)
    assert on_time[-1] and got == silver_rule(batches, HORIZON) == [[True], [True], [True], [False]]


def test_exactly_three_characters_outside_ascii_become_ascii_under_nfc():
    # Gold routes an id's forms to one group by mapping these (layers/gold.py): any other id with a character
    # outside ASCII stays outside after NFC, alone or after an ASCII letter it could compose with.
    import sys
    import unicodedata

    from rulewatch.spark.layers.gold import _NFC_INTO_ASCII

    into = [c for c in map(chr, range(0x80, sys.maxunicode + 1)) if unicodedata.normalize("NFC", c).isascii()]
    assert into == list(_NFC_INTO_ASCII[0]) and [unicodedata.normalize("NFC", c) for c in into] == list(_NFC_INTO_ASCII[1])
    composing = [c for c in map(chr, range(0x80, sys.maxunicode + 1)) if c not in into and unicodedata.normalize("NFC", "a" + c).isascii()]
    assert composing == []
