"""The stateful processor's work (processor.py declares its state): RocksDB state around the pure
batch engine, one call per hash shard.

Grouping by a hash shard of the key (not by the key) is deliberate: a Python call per key costs
milliseconds, so each call evaluates all keys of a shard at once with numpy (docs/design.md).

State per shard:
- ``rules``   (ValueState): the rule book, built from the rules table's change feed (the rules
  stream is broadcast to every shard, like Flink's broadcast state).
- ``history`` (MapState): each state key's retained events + per-rule memory, in the shard's layout
  (history.py). Only the keys a batch touches are read and written.
- ``expiry``  (MapState time -> keys): which keys may become empty at an event time, with one
  event-time timer per rounded time, so idle keys are purged without scanning the shard.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import numpy as np
import pandas as pd
import pyarrow as pa
from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo, TimerValues

from rulewatch.spark.control.commands import CLEAR_STATE
from rulewatch.engine.book import RuleBook
from rulewatch.engine.engine import KEY_SEPARATOR, OUTPUT_COLUMNS, arrow_column, decode_history, evaluate_batch, key_expiry, newest_time
from rulewatch.spark.evaluator.history import HistoryStore, check_layout, history_store, unrecorded_layout
from rulewatch.spark.evaluator.packing import PACKED_COLUMN, unpack
from rulewatch.spark.evaluator.state_batch import batched_map
from rulewatch.spark.storage.schema import RULE_FIELDS
from rulewatch.engine.windows import MAX_SPAN_MS

if TYPE_CHECKING:
    from rulewatch.spark.evaluator.processor import RuleProcessor


def _python(value: Any) -> Any:
    """Arrow hands rule rows over as numpy scalars/arrays and map entries as tuples; integer
    columns that also carry event rows (all null there) arrive as floats."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, np.floating) and float(value).is_integer():
        return int(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return [_python(v) for v in value]
    if isinstance(value, list) and value and isinstance(value[0], tuple):
        return dict(value)
    return value


def _frame(rows: list[dict]) -> pd.DataFrame:
    # Object columns keep None as None; a default frame would turn missing values into NaN floats.
    return pd.DataFrame({c: pd.Series([r.get(c) for r in rows], dtype=object) for c in OUTPUT_COLUMNS})


def _complete(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with every output column, in order; the columns it lacks are all null (Arrow
    nulls, which pyspark passes on without looking at each row)."""
    nothing = arrow_column(pa.nulls(len(frame)))
    nothing.index = frame.index
    return pd.DataFrame({c: frame[c] if c in frame else nothing for c in OUTPUT_COLUMNS})


def _keyset(state_key: str) -> str:
    return state_key.split(KEY_SEPARATOR, 1)[0]


# Index entries (and timers) one call may add. A batch spanning hours of event time (a backfill)
# would otherwise index its keys under hundreds of times, each a state read, write and timer.
MAX_INDEX_ENTRIES = 16


def expiry_buckets(expiry_ms: dict[str, int], steps: dict[str, int], max_entries: int = MAX_INDEX_ENTRIES) -> dict[int, set[str]]:
    """Index time -> state keys to re-check then: each key's expiry rounded up to its keyset's step.

    ``steps`` maps a keyset (the state key's prefix) to its rounding step. While that gives more
    than ``max_entries`` times, every step doubles: a key is then purged later, never earlier.
    """
    return {at: keys for at, keys, _ in _expiry_groups(expiry_ms, steps.__getitem__, max_entries)}


def _expiry_groups(
    expiry_ms: dict[str, int], step_of: Callable[[str], int], max_entries: int = MAX_INDEX_ENTRIES
) -> list[tuple[int, set[str], set[str]]]:
    """``expiry_buckets``'s entries, each with the keysets of its keys.

    A batch may touch a million keys, so keys are rounded as whole arrays, and coarser steps are
    tried on the distinct rounded times only: rounding a time already rounded up to a step, up to a
    multiple of that step, gives what rounding the expiry itself would."""
    keys = list(expiry_ms)
    if not keys:
        return []
    code, keyset_index = pd.factorize(np.array([_keyset(key) for key in keys], dtype=object))
    keysets: list[str] = keyset_index.tolist()
    # Expiries are at most MAX_SPAN_MS (key_expiries), and a step beyond it rounds them as MAX_SPAN_MS
    # does; with steps capped so, a time rounded up stays below 2**63 (it saturates further down).
    steps = [min(step_of(keyset), MAX_SPAN_MS) for keyset in keysets]
    expiry = np.fromiter(expiry_ms.values(), dtype=np.int64, count=len(keys))
    step = np.array(steps, dtype=np.int64)[code]
    rounded = -(-expiry // step) * step
    # Per keyset: which keys are its own, its distinct rounded times, and which of them each key has.
    per_keyset = []
    for c in range(len(keysets)):
        mine = code == c
        times, which = np.unique(rounded[mine], return_inverse=True)
        per_keyset.append((mine, times.tolist(), which))
    factor = 1
    while True:
        coarse = [[min(-(-t // (s * factor)) * s * factor, MAX_SPAN_MS) for t in times] for s, (_, times, _) in zip(steps, per_keyset)]
        if len({t for times in coarse for t in times}) <= max_entries:
            break
        factor *= 2
    at = np.empty(len(keys), dtype=np.int64)
    for (mine, _, which), times in zip(per_keyset, coarse):
        at[mine] = np.array(times, dtype=np.int64)[which]
    order = np.argsort(at, kind="stable")
    at, code = at[order], code[order]
    ordered = np.array(keys, dtype=object)[order]
    bounds = np.flatnonzero(np.diff(at)) + 1
    return [
        (int(at[a]), set(ordered[a:z].tolist()), {keysets[c] for c in np.unique(code[a:z]).tolist()})
        for a, z in zip([0, *bounds.tolist()], [*bounds.tolist(), len(keys)])
    ]


# First line of an expiry index entry: the span (retention or memory, whichever is longer) each
# keyset's keys were indexed with, as JSON. Entries written before it have none: their keys are read.
_SPANS = "\x01"


def _span(book: RuleBook, keyset: str) -> int:
    return max(book.retention_ms(keyset), book.memory_ms(keyset))


def _entry(spans: dict[str, int] | None, keys: set[str]) -> str:
    lines = sorted(keys)
    return "\n".join(lines if spans is None else [_SPANS + json.dumps(spans, sort_keys=True), *lines])


def _read_entry(text: str) -> tuple[dict[str, int] | None, set[str]]:
    """An index entry's spans (None: an entry from before they were kept) and keys."""
    lines = text.split("\n")
    if lines[0].startswith(_SPANS):
        return json.loads(lines[0][len(_SPANS):]), set(lines[1:])
    return None, set(lines)


def settle_expiry(
    entries: Mapping[int, tuple[dict[str, int] | None, set[str]]], at: int, watermark: int, span_of: Callable[[str], int]
) -> tuple[list[int], set[str], set[str]]:
    """Which index entries the timer at ``at`` settles, and of their keys those to purge unread and
    those to read and check.

    ``entries``: the shard's whole index (time -> spans, keys); ``span_of(keyset)``: what its
    keys need now. Due are ``at`` and every entry whose timer fires in the same batch (Spark fires
    those before the watermark). A key is settled at its newest entry only: indexed again later, it
    was touched since and that entry decides (now if it is due too, else when it is). It goes
    unread when that entry's time is behind the watermark and the narrowest span the key was
    indexed with in any of its entries covers what its keyset needs now; it is read when an entry of
    it predates recorded spans or a wider rule has arrived since. The narrowest, not the newest
    entry's: after a rule narrows, a key touched again is indexed under an earlier time than
    before, and its old entry's wide span says nothing about when its newest event stops mattering.
    """
    newest: dict[str, int] = {}
    narrowest: dict[str, int | None] = {}
    for time, (spans, keys) in entries.items():
        for key in keys:
            if newest.get(key, time) <= time:
                newest[key] = time
            span = None if spans is None else spans.get(_keyset(key))
            known = narrowest.get(key, span)
            narrowest[key] = None if span is None or known is None else min(span, known)
    due = [time for time in entries if time < watermark or time == at]
    unread: set[str] = set()
    read: set[str] = set()
    for time in due:
        for key in entries[time][1]:
            if newest[key] != time:
                continue
            span = narrowest[key]
            covered = span is not None and watermark > time and span_of(_keyset(key)) <= span
            (unread if covered else read).add(key)
    return due, unread, read


def _expiry(state_key: str, blob: bytes, book: RuleBook) -> int:
    """The event time after which the key's stored history and memory are of no more use."""
    cols, memory = decode_history(blob)
    keyset = _keyset(state_key)
    return key_expiry(newest_time(cols["eventTime"], memory), book.retention_ms(keyset), book.memory_ms(keyset))


class ShardEvaluator:
    """One shard's work for ``processor.RuleProcessor``: rule changes, commands, events and cleanup timers."""

    def __init__(self, processor: RuleProcessor) -> None:
        self.handle = processor.handle
        self.granularity = processor.granularity
        self.state_slots = processor.state_slots
        self.lateness_ms = processor.lateness_ms
        self.watermark_floor_ms = processor.watermark_floor_ms
        self.error_shard = processor.error_shard
        self.rules = processor.rules
        self.history_map = processor.history_map
        self.pipeline = processor.state_pipeline
        self._stores: dict[str, HistoryStore] = {}
        self.layout = processor.layout
        self.expiry = processor.expiry
        # an index write reads and rewrites up to MAX_INDEX_ENTRIES entries: batched like the histories
        self.expiry_entries = batched_map(processor.expiry, processor.state_pipeline)
        self._book_cache: tuple[str | None, RuleBook] = (None, RuleBook())

    def _book(self) -> RuleBook:
        stored = self.rules.get()
        text = stored[0] if stored else None
        if text != self._book_cache[0]:
            self._book_cache = (text, RuleBook.from_json(text))
        return self._book_cache[1]

    def _apply_rule_changes(self, changes: pd.DataFrame, report_errors: bool) -> list[dict]:
        book = self._book()
        errors: list[dict] = []
        records = changes.sort_values("commit_version", kind="stable").to_dict("records")
        # A pre-image only matters when its rule id has no post-image in the same commit
        # (UPDATE ... SET ruleId = 8 WHERE ruleId = 7): then rule 7 is gone.
        kept_ids = {
            (int(r["commit_version"]), _python(r["ruleId"])) for r in records if r["change_type"] == "update_postimage"
        }
        for row in records:
            body = {f: _python(row.get(f)) for f in RULE_FIELDS}
            version = int(row["commit_version"])
            change = str(row["change_type"])
            if change == "update_preimage":
                if (version, body["ruleId"]) in kept_ids:
                    continue
                change = "delete"
            err = book.apply(change, body, version)
            if err is not None and report_errors:
                errors.append({
                    "kind": "rule_error", "rule_id": err.rule_id, "rule_version": version,
                    "detail": str(err), "aggregator": err.field,
                })  # fmt: skip
        self._save_book(book)
        return errors

    def _apply_commands(self, commands: pd.DataFrame) -> None:
        book = self._book()
        for row in commands.to_dict("records"):
            if row["command"] == CLEAR_STATE:
                rule_id = _python(row["command_rule_id"])
                book.clear(None if pd.isna(rule_id) else int(rule_id), int(_python(row["clear_before_ms"])))
        self._save_book(book)

    def _save_book(self, book: RuleBook) -> None:
        text = book.to_json()
        self.rules.update((text,))
        self._book_cache = (text, book)

    def _open_history(self) -> HistoryStore:
        """This shard's history store, opened for a call; raises if the shard's layout is not this run's."""
        stored = self.layout.get()
        fresh = False
        if stored is None:
            fresh = not self.history_map.exists()
            layout = unrecorded_layout(self.state_slots, fresh)
            self.layout.update((layout,))
        else:
            layout = stored[0]
            check_layout(layout, self.state_slots)
        if layout not in self._stores:
            self._stores[layout] = history_store(self.history_map, layout, self.pipeline)
        history = self._stores[layout]
        history.open(fresh)
        return history

    def _index_expiry(self, expiry_ms: dict[str, int], book: RuleBook) -> None:
        def step_of(keyset: str) -> int:
            # Rounding up to 1/8 of the key's retention (at least the configured granularity) keeps the
            # number of index entries and timers per batch small; a key is purged at most that late.
            eighth = book.retention_ms(keyset) // 8
            return max(self.granularity, -(-eighth // self.granularity) * self.granularity)

        groups = _expiry_groups(expiry_ms, step_of)
        existing = self.expiry_entries.get_many([(bucket,) for bucket, _, _ in groups])
        entries: list[tuple[tuple[int], tuple[str]]] = []
        for (bucket, keys, keysets), stored in zip(groups, existing):
            spans: dict[str, int] | None = {ks: _span(book, ks) for ks in keysets}
            if stored:
                old_spans, old_keys = _read_entry(stored[0])
                keys |= old_keys
                # The narrowest span any of its keys was indexed with; an old entry stays without.
                spans = None if old_spans is None else {**old_spans, **{ks: min(span, old_spans.get(ks, span)) for ks, span in spans.items()}}  # type: ignore[union-attr]
            entries.append(((bucket,), (_entry(spans, keys),)))
        self.expiry_entries.write_many(entries)
        for bucket, _, _ in groups:
            self.handle.registerTimer(bucket)

    def handle_rows(self, key: Any, rows: Iterator[pd.DataFrame], timerValues: TimerValues) -> Iterator[pd.DataFrame]:
        batch = pd.concat(list(rows), ignore_index=True)
        out: list[dict] = []
        is_rule = batch["change_type"].notna()
        is_command = batch["command"].notna()
        if is_rule.any():
            out.extend(self._apply_rule_changes(batch[is_rule], report_errors=int(key[0]) == self.error_shard))
        if is_command.any():
            self._apply_commands(batch[is_command])
        packed = batch[PACKED_COLUMN].dropna()
        if packed.empty and is_rule.any():
            # Rule changes alone still say which rules the shard now runs (pipeline_metrics'
            # rules_version): how soon a change reached the evaluator, not only the next events.
            out.append(self._stats(0, 0, self._book(), 0, 0))
        if not packed.empty:
            events = unpack(packed)
            history = self._open_history()
            book = self._book()
            watermark = self._watermark(timerValues)
            next_watermark = 0
            if self.lateness_ms is not None:
                next_watermark = max(watermark, int(events["eventTime"].max()) - self.lateness_ms, 0)
            result = evaluate_batch(events, book, history.get_many, watermark, next_watermark)
            history.rows_written = history.bytes_written = 0
            history.put_many(result.writes)
            history.flush()
            self._index_expiry(result.expiry_ms, book)
            out.extend(result.rows)
            out.append(self._stats(len(events), len(result.writes), book, history.rows_written, history.bytes_written))
            yield from (_complete(frame) for frame in result.metrics)
        if out:
            yield _frame(out)

    def _watermark(self, timerValues: TimerValues) -> int:
        # A rescaled gold's query starts without a watermark; the old query's carries on (checkpoints.WATERMARK_FLOOR).
        return max(timerValues.getCurrentWatermarkInMs(), self.watermark_floor_ms)

    def handle_initial_state(self, frame: pd.DataFrame) -> None:
        """A rescale's state for this shard (layers/rescale.py): rows of the rule book and a chunk of
        the keys this shard now holds, each key's history blob as the old shard stored it."""
        for book_text, entries in zip(frame["book"], frame["entries"]):
            self._save_book(RuleBook.from_json(book_text))
            blobs = {entry["state_key"]: entry["blob"] for entry in entries}
            if not blobs:
                continue
            book = self._book()
            history = self._open_history()
            history.put_many(blobs)
            history.flush()
            self._index_expiry({key: _expiry(key, blob, book) for key, blob in blobs.items()}, book)

    def _stats(self, events: int, keys_touched: int, book: RuleBook, state_rows: int, state_bytes: int) -> dict:
        """What this call did, summed over shards into gold/pipeline_metrics."""
        return {
            "kind": "stats", "event_count": events, "keys_touched": keys_touched,
            "state_rows": state_rows, "state_bytes": state_bytes,
            "active_rules": sum(len(rules) for rules in book.active_by_keyset().values()),
            "rule_version": max((version for _, version in book.rules.values()), default=None),
            # The keysets this shard's rules read (gold/rule_keysets): events keep being routed to them
            # until a change that drops one has reached the evaluator, not only the rules table.
            "key_values": sorted({rule.keyset for rule, _ in book.rules.values() if rule.keyset}),
        }  # fmt: skip

    def handle_timer(self, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo) -> Iterator[pd.DataFrame]:
        at = expiredTimerInfo.getExpiryTimeInMs()
        if self.expiry.getValue((at,)) is None:
            return  # settled by an earlier timer of this shard in this batch
        watermark = self._watermark(timerValues)
        book = self._book()
        entries = {time: _read_entry(value[0]) for (time,), value in self.expiry.iterator()}
        # Every entry whose timer fires in this batch is settled now: the shard's stored-key set and
        # index are then read and written once per batch instead of once per timer (a backlog
        # batch has up to MAX_INDEX_ENTRIES a shard).
        due, unread, keys = settle_expiry(entries, at, watermark, lambda keyset: _span(book, keyset))
        self.expiry_entries.write_many([((time,), None) for time in due])
        history = self._open_history()
        purged: dict[str, bytes | None] = dict.fromkeys(unread)
        still_alive: dict[str, int] = {}
        for state_key, blob in history.get_many(keys).items():
            if blob is None:
                continue
            expires = _expiry(state_key, blob, book)
            if expires < watermark:
                purged[state_key] = None
            else:
                # A wider rule arrived since it was indexed, or its entry predates recorded spans.
                still_alive[state_key] = expires
        history.put_many(purged)
        history.flush()
        self._index_expiry(still_alive, book)
        yield from ()
