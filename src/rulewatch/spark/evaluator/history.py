"""Where a shard keeps its keys' histories: state key -> history blob over one MapState.

Three layouts, recorded per shard in state (evaluator.ShardEvaluator._open_history) and fixed for
it; ``history_store`` builds the one a record names:

- ``batch`` (new shards with ``state_slots = 0``): a handler call that touches many keys, reads
  many of the keys its shard stores, or finds its shard empty, writes the ones it keeps as one
  entry (a generation); other calls write one entry per key. A one-entry-per-key batch pays one
  state call per written key (~25-35 µs each, pipelined), which is most of a big batch's state time
  (docs/journal/benchmarks.md).
- ``slots=0`` (shards from before ``batch``): one entry per key.
- ``slots=N``: keys hashed into N entries per shard, every key sharing a touched entry rewritten.

Reads and writes go by the batch (state_batch.py). Call ``open`` at the start of every handler call
(state is per shard) and ``flush`` at its end.
"""

from __future__ import annotations

import pickle
import zlib
from collections import Counter
from typing import Iterable, Mapping

from pyspark.sql.streaming.stateful_processor import MapState

from rulewatch.spark.evaluator.state_batch import batched_map

# Records kept under history keys no state key can take (state keys start with a keyset, which
# never starts with "#").
_MEMBERS = "#members"  # slots=0: the shard's stored keys
_WHERE = "#where"  # batch: each stored key's entry, and each generation's size when written
_GEN = "#gen"

BATCH = "batch"

# A call writes a generation when it touches at least this many keys (written, deleted, or dropped
# as expired before they were ever stored: a backfill over a million keys writes few of the many it
# touches), when the stored keys it read are at least a quarter of its shard's (the next calls
# are then likely to read most of a generation too), or when its shard stores nothing (its first
# batch, or one after every key was purged: the same; one entry per key in a first batch cost the
# evaluator bench 1-3 s at 10k and 100k keys, docs/journal/benchmarks.md); otherwise one entry per key. A
# generation is read whole for any of its keys, so a live batch over few of many stored keys, or
# over keys that come and go, keeps entries per key.
GENERATION_KEYS = 4096
GENERATION_SHARE = 4


def new_shard_layout(state_slots: int) -> str:
    """The layout a new shard records for the ``state_slots`` setting."""
    return BATCH if not state_slots else f"slots={state_slots}"


def unrecorded_layout(state_slots: int, fresh: bool) -> str:
    """The layout of a shard with no record: a new one's, or, for a shard whose state predates the
    record, the one ``state_slots`` gave then (0: one entry per key)."""
    return new_shard_layout(state_slots) if fresh else f"slots={state_slots}"


def check_layout(recorded: str, state_slots: int) -> None:
    """Raise unless a shard that recorded ``recorded`` can go on under this ``state_slots`` setting.

    A shard that began one entry per key (``slots=0``) keeps it while ``state_slots`` is still 0."""
    if recorded != new_shard_layout(state_slots) and not (recorded == "slots=0" and not state_slots):
        raise ValueError(
            f"this checkpoint's evaluator state was written with {recorded}, not {new_shard_layout(state_slots)}; "
            "keep the state_slots setting of an existing checkpoint (or start a new checkpoint)"
        )


def history_store(state: MapState, layout: str, pipeline: bool) -> "HistoryStore":
    """The store for a shard whose layout record reads ``layout``."""
    if layout == BATCH:
        return BatchStore(state, pipeline)
    slots = int(layout.removeprefix("slots="))
    return SlotStore(state, slots, pipeline) if slots else KeyStore(state, pipeline)


class HistoryStore:
    """What every layout offers the evaluator; counts the entries and bytes each call writes."""

    def __init__(self, state: MapState, pipeline: bool) -> None:
        self.state = batched_map(state, pipeline)
        self.rows_written = 0
        self.bytes_written = 0

    def open(self, fresh: bool) -> None:
        """Start a handler call; ``fresh``: this shard has stored nothing yet."""

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes | None]:
        """Each key's blob (None: nothing stored)."""
        raise NotImplementedError

    def put_many(self, blobs: Mapping[str, bytes | None]) -> None:
        """Store each key's blob; None deletes the key."""
        raise NotImplementedError

    def flush(self) -> None:
        """End the handler call: write what ``put_many`` left to write."""

    def _write(self, blobs: list[tuple[str, bytes | None]]) -> None:
        self.state.write_many([((key,), None if blob is None else (blob,)) for key, blob in blobs])
        for _, blob in blobs:
            if blob is not None:
                self.rows_written += 1
                self.bytes_written += len(blob)

    def _read(self, keys: list[str]) -> list[bytes | None]:
        return [value[0] if value else None for value in self.state.get_many([(key,) for key in keys])]


class KeyStore(HistoryStore):
    """One entry per key, and the shard's set of stored keys in one entry, so a key never seen (or
    already purged) costs no read and deleting it no call. Shards whose state predates that entry
    read every key. Only shards from before the batch layout use it, so ``open`` always reads."""

    def __init__(self, state: MapState, pipeline: bool) -> None:
        super().__init__(state, pipeline)
        self._members: set[str] | None = None
        self._changed = False

    def open(self, fresh: bool) -> None:
        (stored,) = self._read([_MEMBERS])
        self._members, self._changed = (None if stored is None else set(pickle.loads(stored))), False

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes | None]:
        wanted = list(dict.fromkeys(keys))
        members = self._members
        found: dict[str, bytes | None] = dict.fromkeys(wanted)
        stored_keys = wanted if members is None else [key for key in wanted if key in members]
        found.update(zip(stored_keys, self._read(stored_keys)))
        return found

    def put_many(self, blobs: Mapping[str, bytes | None]) -> None:
        members = self._members
        if members is not None:
            blobs = {key: blob for key, blob in blobs.items() if blob is not None or key in members}
            for key, blob in blobs.items():
                if blob is None:
                    members.discard(key)
                else:
                    members.add(key)
            self._changed |= bool(blobs)
        self._write(list(blobs.items()))

    def flush(self) -> None:
        if self._members is not None and self._changed:
            # Sorted: the same keys give the same bytes whatever the worker's string hash seed.
            self._write([(_MEMBERS, pickle.dumps(sorted(self._members), protocol=5))])
        self._changed = False


class SlotStore(HistoryStore):
    """Keys hashed into ``slots`` entries per shard: one state call per touched entry, but every key
    sharing it is rewritten. Wins when most keys are touched every batch, loses when few of many are."""

    def __init__(self, state: MapState, slots: int, pipeline: bool) -> None:
        super().__init__(state, pipeline)
        self.slots = slots
        self._loaded: dict[str, dict[str, bytes]] = {}
        self._dirty: set[str] = set()

    def _slot(self, key: str) -> str:
        return f"#slot{zlib.crc32(key.encode()) % self.slots}"

    def _load(self, slots: Iterable[str]) -> None:
        missing = [slot for slot in dict.fromkeys(slots) if slot not in self._loaded]
        for slot, stored in zip(missing, self._read(missing)):
            self._loaded[slot] = pickle.loads(stored) if stored else {}

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes | None]:
        slot_of = {key: self._slot(key) for key in keys}
        self._load(slot_of.values())
        return {key: self._loaded[slot].get(key) for key, slot in slot_of.items()}

    def put_many(self, blobs: Mapping[str, bytes | None]) -> None:
        slot_of = {key: self._slot(key) for key in blobs}
        self._load(slot_of.values())
        for key, blob in blobs.items():
            entries = self._loaded[slot_of[key]]
            if blob is None:
                entries.pop(key, None)
            else:
                entries[key] = blob
            self._dirty.add(slot_of[key])

    def flush(self) -> None:
        self._write([(slot, pickle.dumps(self._loaded[slot], protocol=5) if self._loaded[slot] else None) for slot in self._dirty])
        self._loaded.clear()
        self._dirty.clear()


class BatchStore(HistoryStore):
    """Each key in an entry of its own (place 0) or in generation n > 0, one entry holding a dict of
    the keys a call wrote. ``#where`` records each stored key's place and each generation's size
    when written. A generation is deleted when none of its keys is left in it; one a call has read
    anyway is rewritten into this call's writes once half its keys have moved on or been purged, so
    dead blobs stay at most as many as live ones in every generation read since."""

    def __init__(self, state: MapState, pipeline: bool) -> None:
        super().__init__(state, pipeline)
        self._where: dict[str, int] = {}
        self._sizes: dict[int, int] = {}
        self._next = 1
        self._loaded: dict[int, dict[str, bytes]] = {}
        self._pending: dict[str, bytes | None] = {}
        self._found: set[str] = set()

    def open(self, fresh: bool) -> None:
        self._where, self._sizes, self._next = {}, {}, 1
        self._loaded, self._pending, self._found = {}, {}, set()
        if not fresh:
            (stored,) = self._read([_WHERE])
            if stored is not None:
                keys, places, self._sizes, self._next = pickle.loads(stored)
                self._where = dict(zip(keys, places))

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes | None]:
        wanted = list(dict.fromkeys(keys))
        where = self._where
        self._found.update(key for key in wanted if key in where)
        own = [key for key in wanted if where.get(key) == 0]
        gens = [gen for gen in dict.fromkeys(where[key] for key in wanted if where.get(key)) if gen not in self._loaded]
        for gen, stored in zip(gens, self._read([f"{_GEN}{gen}" for gen in gens])):
            self._loaded[gen] = pickle.loads(stored) if stored else {}
        found: dict[str, bytes | None] = {key: self._loaded[where[key]].get(key) if where.get(key) else None for key in wanted}
        found.update(zip(own, self._read(own)))
        return found

    def put_many(self, blobs: Mapping[str, bytes | None]) -> None:
        self._pending.update(blobs)

    def flush(self) -> None:
        where, pending = self._where, self._pending
        touched = len(pending)
        pending = {key: blob for key, blob in pending.items() if blob is not None or key in where}
        live = Counter(where.values())
        for key in pending:
            if key in where:
                live[where[key]] -= 1
        # A generation read for this call and left at most half full moves its other keys along.
        for gen, entries in self._loaded.items():
            if 0 < live[gen] * 2 <= self._sizes[gen]:
                moved = {key: blob for key, blob in entries.items() if where.get(key) == gen and key not in pending}
                pending.update(moved)
                live[gen] -= len(moved)
        written = {key: blob for key, blob in pending.items() if blob is not None}
        # A shard that stores nothing (where is empty) passes the second test.
        as_generation = touched >= GENERATION_KEYS or len(where) <= len(self._found) * GENERATION_SHARE
        place = self._next if as_generation and written else 0
        writes: list[tuple[str, bytes | None]] = []
        for key, blob in pending.items():
            was = where.pop(key, None)
            if blob is not None:
                where[key] = place
                if place == 0:
                    writes.append((key, blob))
                    continue
            if was == 0:
                writes.append((key, None))
        if place:
            writes.append((f"{_GEN}{place}", pickle.dumps(written, protocol=5)))
            self._sizes[place] = len(written)
            self._next += 1
        for gen in [gen for gen in self._sizes if gen != place and live[gen] <= 0]:
            writes.append((f"{_GEN}{gen}", None))
            del self._sizes[gen]
        if pending:
            # Sorted: the same keys give the same bytes whatever the worker's string hash seed.
            keys = sorted(where)
            writes.append((_WHERE, pickle.dumps((keys, [where[key] for key in keys], self._sizes, self._next), protocol=5)))
        self._write(writes)
        self._loaded, self._pending, self._found = {}, {}, set()


class _Entries:
    """A shard's history entries read out of its checkpoint (the state data source), answering the
    MapState calls a store makes to read them."""

    def __init__(self, entries: Mapping[str, bytes]) -> None:
        self.entries = entries

    def getValue(self, key: tuple[str]) -> tuple[bytes] | None:  # noqa: N802 (MapState's name)
        blob = self.entries.get(key[0])
        return None if blob is None else (blob,)


def stored_histories(entries: Mapping[str, bytes], layout: str) -> dict[str, bytes]:
    """Every key a shard stores, with its blob, from the shard's history entries and its layout record.

    Read through the layout's own store, so only what it would serve comes out (a generation may still
    hold blobs of keys that moved on)."""
    candidates: set[str] = {name for name in entries if not name.startswith("#")}
    for name, value in entries.items():
        if name == _WHERE:
            candidates.update(pickle.loads(value)[0])
        elif name == _MEMBERS:
            candidates.update(pickle.loads(value))
        elif name.startswith((_GEN, "#slot")):
            candidates.update(pickle.loads(value))
    store = history_store(_Entries(entries), layout, pipeline=False)  # type: ignore[arg-type]
    store.open(fresh=not entries)
    return {key: blob for key, blob in store.get_many(sorted(candidates)).items() if blob is not None}
