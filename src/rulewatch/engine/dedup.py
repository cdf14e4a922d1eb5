"""Which lines of a batch are first occurrences: silver's duplicate rule, for a query that keeps it as state.

Silver's rule (layers/silver.py): within one batch, only the first line of a transaction id (in
``LINE_ORDER``) may be accepted; it is a duplicate when an earlier batch accepted that id at an event
time within the horizon. Gold straight from the source (spark/evaluator/dedup.py) holds each accepted id's
event times instead of reading silver, and decides here, so the two agree line for line wherever their
batches hold the same lines.

The state is bounded by event time: an accepted time ``t`` can go once the watermark passes
``t + horizon``, since every line not yet late lies beyond the horizon from it. Times are grouped in
buckets of ``granularity`` by when they may go, so one timer per bucket drops them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence


@dataclass
class Decided:
    """A batch's decisions: ``accepted[i]`` for its i-th line, each id's accepted times after the
    batch (only ids that gained one), and the ids newly due in each expiry bucket."""

    accepted: list[bool]
    times: dict[str, list[int]] = field(default_factory=dict)
    due: dict[int, list[str]] = field(default_factory=dict)


def expiry_bucket(event_ms: int, horizon_ms: int, granularity_ms: int) -> int:
    """The bucket an accepted time falls due in; its timer is at the bucket's end (``bucket_end``)."""
    return (event_ms + horizon_ms) // granularity_ms


def bucket_end(bucket: int, granularity_ms: int) -> int:
    return (bucket + 1) * granularity_ms


def decide(
    ids: Sequence[str],
    event_ms: Sequence[int],
    earlier: Mapping[str, Sequence[int]],
    horizon_ms: int,
    granularity_ms: int,
) -> Decided:
    """Lines in ``LINE_ORDER`` (their ids and event times); ``earlier``: the accepted times earlier
    batches left for the ids among them (absent: none)."""
    decided = Decided([False] * len(ids))
    seen_in_batch: set[str] = set()
    for i, (tid, at) in enumerate(zip(ids, event_ms)):
        if tid in seen_in_batch:
            continue  # a later line of an id in one batch repeats it, whatever its time (as silver)
        seen_in_batch.add(tid)
        before = earlier.get(tid, ())
        if any(abs(at - t) <= horizon_ms for t in before):
            continue
        decided.accepted[i] = True
        decided.times[tid] = [*before, at]
        decided.due.setdefault(expiry_bucket(at, horizon_ms, granularity_ms), []).append(tid)
    return decided


def kept_times(times: Sequence[int], watermark_ms: int, horizon_ms: int) -> list[int]:
    """The accepted times an id still needs once the watermark is at ``watermark_ms``."""
    return [t for t in times if t + horizon_ms >= watermark_ms]
