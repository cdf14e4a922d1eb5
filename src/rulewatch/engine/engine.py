"""One micro-batch of one shard: rules in, events in, alerts / metrics / late records out.

Pure Python + numpy so it can be tested (and checked against the oracle) without Spark; the
Spark processor in ``spark/evaluator/shard.py`` only moves state blobs in and out of RocksDB around it.

State is one blob per *state key* = (keyset, group key): the retained events of that key, shared by
every rule with the same grouping fields (brief §2), plus each rule's cooldown / reported-values
memory for that key.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Callable, Iterable, Mapping

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from rulewatch.engine import buckets
from rulewatch.engine.book import RuleBook
from rulewatch.engine.rules import EVENT_FIELDS, Aggregator, Rule
from rulewatch.engine.windows import MAX_SPAN_MS, aggregate, compare, decimal_texts, window_lo, window_start

MONEY_SCALE = 2
KEY_SEPARATOR = "\x1f"
MAX_REPORTED_VALUES = 20
STRING_FIELDS = tuple(f for f, kind in EVENT_FIELDS.items() if kind == "string" and f != "transactionId")
NUMERIC_FIELDS = tuple(f for f, kind in EVENT_FIELDS.items() if kind == "decimal")
HISTORY_COLUMNS = ("eventTime", "transactionId", *STRING_FIELDS, *NUMERIC_FIELDS, *(f"{f}_null" for f in NUMERIC_FIELDS))

# Every kind of output row shares one schema (the stateful operator has a single output type).
OUTPUT_COLUMNS = [
    "kind", "rule_id", "rule_version", "keyset", "group_key", "transaction_id", "event_ms",
    "aggregate_value", "limit_value", "operator", "aggregator", "window_start_ms", "window_end_ms",
    "event_count", "max_aggregate", "distinct_values", "detail", "key_values", "ingest_ms",
    "keys_touched", "state_rows", "state_bytes", "active_rules",
]  # fmt: skip
OUTPUT_SCHEMA = (
    "kind string, rule_id int, rule_version long, keyset string, group_key string, transaction_id string, "
    "event_ms long, aggregate_value string, limit_value string, operator string, aggregator string, "
    "window_start_ms long, window_end_ms long, event_count long, max_aggregate string, "
    "distinct_values array<string>, detail string, key_values array<string>, ingest_ms long, "
    "keys_touched long, state_rows long, state_bytes long, active_rules int"
)


def state_key(keyset: str, group_key: str) -> str:
    return f"{keyset}{KEY_SEPARATOR}{group_key}"


# ---------------------------------------------------------------------------------------------- state


_TEXT_COLUMNS = ("transactionId", *STRING_FIELDS)
_ARRAY_COLUMNS = tuple((c, np.dtype(bool) if c.endswith("_null") else np.dtype(np.int64)) for c in HISTORY_COLUMNS if c not in _TEXT_COLUMNS)
_FORMAT = "h1"


def decode_history(blob: bytes) -> tuple[dict[str, np.ndarray], dict]:
    """One key's stored events (as numpy columns) and memory; the format is written by ``_write_back``:
    raw array bytes plus one flat list of the text columns (~20x faster than pickling object arrays)."""
    cols, memories = _load_histories([blob])
    del cols["group"]
    for name in _TEXT_COLUMNS:
        column = np.empty(len(cols[name]), dtype=object)
        column[:] = cols[name]
        cols[name] = column
    return cols, memories[0]


@dataclass
class BatchResult:
    rows: list[dict]  # alerts and late events: few, so one dict each
    writes: dict[str, bytes | None]  # state key -> new blob, None = delete
    expiry_ms: dict[str, int]  # state key -> event time after which the key holds nothing useful
    # Window metrics, one frame per rule: a row per key touched, which with many keys is a row per
    # event, so they stay columns all the way to Arrow (as dicts they cost more than the engine).
    metrics: list[pd.DataFrame] = field(default_factory=list)

    def records(self) -> list[dict]:
        """Every output row as a dict, metrics after the others."""
        return [*self.rows, *(row for frame in self.metrics for row in frame.to_dict("records"))]


def _event_columns(frame: pd.DataFrame) -> dict[str, np.ndarray]:
    cols = {
        "eventTime": frame["eventTime"].to_numpy(np.int64),
        "transactionId": frame["transactionId"].to_numpy(object),
    }
    for name in STRING_FIELDS:
        cols[name] = frame[name].to_numpy(object)
    for name in NUMERIC_FIELDS:
        cols[name] = frame[name].to_numpy(np.int64)
        cols[f"{name}_null"] = frame[f"{name}_null"].to_numpy(bool)
    return cols


def _late_rows(late: pd.DataFrame, watermark_ms: int) -> list[dict]:
    return [
        {
            "kind": "late", "keyset": ks, "group_key": gk, "transaction_id": tid, "event_ms": int(t),
            "detail": f"event time {int(t)} is behind the watermark {watermark_ms} (beyond allowed lateness); not evaluated",
        }
        for ks, gk, tid, t in zip(late["keyset"], late["group_key"], late["transactionId"], late["eventTime"])
    ]  # fmt: skip


def evaluate_batch(
    events: pd.DataFrame,
    book: RuleBook,
    load: Callable[[list[str]], Mapping[str, bytes | None]],
    watermark_ms: int,
    next_watermark_ms: int = 0,
) -> BatchResult:
    """Evaluate every active rule on every event of the batch over its exact look-back window.

    ``events`` has one row per (event, keyset): columns ``keyset``, ``group_key`` and the event
    fields (money as int64 minor units plus a ``<field>_null`` mask). ``load`` is called once, with
    the state keys of the batch's events, and returns each key's stored blob (None: nothing stored).
    Events older than the watermark are past the allowed lateness: reported as ``late`` rows,
    neither evaluated nor kept.
    ``next_watermark_ms`` (0: unknown) is a floor on the watermark of the next batch: a key that
    expires before it holds nothing any later event can see, so it is deleted instead of written.
    """
    rows: list[dict] = []
    metrics: list[pd.DataFrame] = []
    if watermark_ms > 0:
        is_late = events["eventTime"].to_numpy(np.int64) < watermark_ms
        rows.extend(_late_rows(events[is_late], watermark_ms))
        events = events[~is_late]
    if events.empty:
        return BatchResult(rows, {}, {})
    keys = (events["keyset"] + KEY_SEPARATOR + events["group_key"]).to_numpy(object)
    new_group, uniq_keys = pd.factorize(keys, sort=False)
    uniq_keys = uniq_keys.tolist()
    # Each key's parts from its first event (with a million keys, splitting each key costs more).
    first = np.empty(len(uniq_keys), dtype=np.int64)
    first[new_group[::-1]] = np.arange(len(new_group) - 1, -1, -1)
    # Keysets as small integer codes: per-key lookups become array takes (few keysets, a million keys).
    keyset_code, keysets = pd.factorize(events["keyset"], sort=False)
    key_code = keyset_code[first]
    keysets = keysets.tolist()
    # An array, so each rule's metrics pick their keys' names with one take instead of a copy per rule.
    key_group = events["group_key"].to_numpy(object)[first]

    # Old history first, then the new events; one sort orders everything by (key, time, id).
    stored = load(uniq_keys)
    old, memories = _load_histories([stored[key] for key in uniq_keys])
    n_old = len(old["group"])
    new_cols = _event_columns(events)
    cols = {name: _concat(old[name], new_cols[name]) for name in HISTORY_COLUMNS}
    group = np.concatenate([old["group"], new_group.astype(np.int64)])
    is_new = np.zeros(len(group), dtype=bool)
    is_new[n_old:] = True
    # When each event reached bronze: only new events can fire, so it is carried, never stored.
    ingest = np.zeros(len(group), dtype=np.int64)
    if "ingestTime" in events:
        ingest[n_old:] = events["ingestTime"].fillna(0).to_numpy(np.int64)
    order = _event_order(group, cols["eventTime"], cols["transactionId"])
    cols = {name: col[order] for name, col in cols.items()}
    group, is_new, ingest = group[order], is_new[order], ingest[order]

    batch_keys = _Keys(uniq_keys, key_code, keysets, group, np.searchsorted(group, np.arange(len(uniq_keys) + 1)))
    keyset_of_group = key_code[group]
    for keyset, rules in book.active_by_keyset().items():
        code = batch_keys.code_of(keyset)
        if code is None:
            continue
        in_keyset = keyset_of_group == code
        for rule, version, cleared in rules:
            alerts, rule_metrics = _evaluate_rule(rule, version, cleared, in_keyset, cols, group, is_new, ingest, key_group, memories)
            rows.extend(alerts)
            if rule_metrics is not None:
                metrics.append(rule_metrics)
    if watermark_ms > 0:
        _fold_buckets(batch_keys, cols, memories, book, watermark_ms)
    writes, expiry = _write_back(batch_keys, cols, memories, book, watermark_ms, next_watermark_ms)
    return BatchResult(rows, writes, expiry, metrics)


@dataclass(frozen=True)
class _Keys:
    """The state keys a batch touches, and where each key's rows are once sorted by (key, time)."""

    names: list[str]
    code: np.ndarray  # per key: its keyset, as an index into ``keysets`` (array takes instead of a lookup per key)
    keysets: list[str]
    group: np.ndarray  # per row: its key, as an index into ``names``
    bounds: np.ndarray  # key k's rows are ``bounds[k]:bounds[k + 1]``

    def code_of(self, keyset: str) -> int | None:
        """``keyset``'s code, None when the batch has no key in it."""
        return self.keysets.index(keyset) if keyset in self.keysets else None

    def of_keyset(self, keyset: str) -> np.ndarray:
        """Indexes of the keys in ``keyset``."""
        code = self.code_of(keyset)
        return np.empty(0, dtype=np.int64) if code is None else np.flatnonzero(self.code == code)


def _fold_buckets(keys: _Keys, cols: Mapping[str, np.ndarray], memories: list[dict], book: RuleBook, watermark_ms: int) -> None:
    """Fold each bucketed rule's buckets that the watermark has closed into its per-key summary
    (paused rules too, so they resume with their history). Runs before raw history is trimmed."""
    everything = np.arange(len(keys.group))
    bounds = keys.bounds.tolist()
    for rule_id, (rule, _) in book.rules.items():
        if not rule.bucket_ms:
            continue
        in_keyset = keys.of_keyset(rule.keyset).tolist()
        if not in_keyset:
            continue
        cleared = book.cleared.get(rule_id)
        sel = _seen_by(rule, cleared, cols, np.ones(len(keys.group), dtype=bool))
        values, valid, _ = _rule_values(rule, cols, everything)
        fp = buckets.fingerprint(rule, cleared)
        fold_to = watermark_ms // rule.bucket_ms * rule.bucket_ms
        # Oldest bucket a window of a non-late event can still reach.
        keep_from = int(window_start(np.array([watermark_ms]), rule.window_ms, rule.bucket_ms)[0])
        for k in in_keyset:
            a, z = bounds[k], bounds[k + 1]
            m = sel[a:z]
            entry = memories[k].setdefault(rule_id, {"last_alert": None, "reported": {}})
            entry["buckets"] = buckets.fold(
                buckets.current(entry, fp), fp, rule, cols["eventTime"][a:z][m], values[a:z][m], valid[a:z][m], fold_to, keep_from
            )


def _concat(old: np.ndarray | list, new: np.ndarray) -> np.ndarray:
    if len(old) == 0:
        return new
    if new.dtype != object:
        return np.concatenate([old, new])
    out = np.empty(len(old) + len(new), dtype=object)
    out[: len(old)] = old
    out[len(old) :] = new
    return out


def _load_histories(blobs: list[bytes | None]) -> tuple[dict, list[dict]]:
    """Every stored event of each key's blob as whole columns (``group`` = index into ``blobs``),
    plus each key's memory. Columns are gathered raw and converted once, not per key."""
    raw: dict[str, list] = {name: [] for name, _ in _ARRAY_COLUMNS}
    texts: dict[str, list] = {name: [] for name in _TEXT_COLUMNS}
    sizes: list[int] = []
    owners: list[int] = []
    memories: list[dict] = [{} for _ in blobs]
    # Only stored keys in the loop: in a batch of a million keys most may be new.
    for g in [g for g, blob in enumerate(blobs) if blob is not None]:
        fmt, n, arrays, flat, memory = pickle.loads(blobs[g])
        if fmt != _FORMAT:
            raise ValueError(f"unknown history state format {fmt!r}; this state was written by another rulewatch version")
        memories[g] = memory
        for (name, _), chunk in zip(_ARRAY_COLUMNS, arrays):
            raw[name].append(chunk)
        for i, name in enumerate(_TEXT_COLUMNS):
            texts[name].extend(flat[i * n : (i + 1) * n])
        sizes.append(n)
        owners.append(g)
    cols: dict = {name: np.frombuffer(b"".join(raw[name]), dtype=dtype) for name, dtype in _ARRAY_COLUMNS}
    cols.update(texts)
    cols["group"] = np.repeat(np.array(owners, dtype=np.int64), sizes)
    return cols, memories


def _event_order(group: np.ndarray, time: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Order by (key, time, transaction id); ids are only ranked when some key has a time tie."""
    order = np.lexsort((time, group))
    g, t = group[order], time[order]
    if not ((g[1:] == g[:-1]) & (t[1:] == t[:-1])).any():
        return order
    _, id_rank = np.unique(ids.astype(str), return_inverse=True)
    return np.lexsort((id_rank, time, group))


def _write_back(
    keys: _Keys, cols: Mapping[str, np.ndarray], memories: list[dict], book: RuleBook, watermark_ms: int, next_watermark_ms: int
) -> tuple[dict[str, bytes | None], dict[str, int]]:
    """Each touched key's new blob (None: nothing left to keep) and expiry time.

    Rows are sorted by (key, time), so what a key keeps is a contiguous run ending at its last row.
    A key expiring before ``next_watermark_ms`` is deleted: its cleanup timer would fire before any
    event could read it (a batch spanning hours, such as a backfill, touches many such keys)."""
    bounds = keys.bounds
    event_time = cols["eventTime"]
    # Per keyset, then taken per key by its keyset's code.
    retention_of = [book.retention_ms(ks) for ks in keys.keysets]
    memory_span = [book.memory_ms(ks) for ks in keys.keysets]
    retention = np.array(retention_of, dtype=np.int64)[keys.code]
    expires = np.empty(len(keys.names), dtype=np.int64)
    newest = event_time[bounds[1:] - 1]
    for code, spans in enumerate(zip(retention_of, memory_span)):
        at = keys.code == code
        expires[at] = key_expiries(newest[at], [max(spans)])
    keep_from = bounds[:-1]
    if watermark_ms > 0:
        horizon = np.maximum(watermark_ms - retention, -MAX_SPAN_MS)
        # Times are sorted within a key, so the rows it drops are a prefix: count them.
        dropped = (event_time < horizon[keys.group]).astype(np.int64)
        keep_from = keep_from + np.add.reduceat(dropped, bounds[:-1])
    gone = expires < next_watermark_ms
    writes: dict[str, bytes | None] = dict.fromkeys(np.asarray(keys.names, dtype=object)[gone].tolist())
    expiry: dict[str, int] = {}
    # This loop runs once per touched key (a million keys: most keys, one row each), so what can be
    # done once per batch is: whole columns as bytes sliced per key, and positions as Python ints.
    arrays = [(cols[name].tobytes(), dtype.itemsize) for name, dtype in _ARRAY_COLUMNS]
    texts = [cols[name].tolist() for name in _TEXT_COLUMNS]
    starts, ends, expires_at, code = keep_from.tolist(), bounds[1:].tolist(), expires.tolist(), keys.code.tolist()
    for g in np.flatnonzero(~gone).tolist():
        key = keys.names[g]
        a, b = starts[g], ends[g]
        memory = memories[g]
        if watermark_ms > 0 and memory:
            memory = _prune_memory(memory, _horizon(watermark_ms, memory_span[code[g]]))
        if a == b and not memory:
            writes[key] = None
            continue
        flat = [column[a] for column in texts] if b - a == 1 else [value for column in texts for value in column[a:b]]
        blocks = [column[a * size : b * size] for column, size in arrays]
        writes[key] = pickle.dumps((_FORMAT, b - a, blocks, flat, memory), protocol=5)
        expiry[key] = expires_at[g]
    return writes, expiry


def key_expiry(last_ms: int, retention_ms: int, memory_ms: int) -> int:
    """Event time after which a key whose newest event or memory is ``last_ms`` holds nothing useful."""
    return int(key_expiries(np.array([last_ms], dtype=np.int64), [max(retention_ms, memory_ms)])[0])


# Any longer span means "never" for every event time Spark can hold (|ms| < 2**48 < 2**61).
_SPAN_CAP = MAX_SPAN_MS + 2**61


def key_expiries(last_ms: np.ndarray, spans_ms: Iterable[int]) -> np.ndarray:
    """``min(last + span, MAX_SPAN_MS)`` per key (``spans_ms``: each key's larger span), saturating
    instead of overflowing int64; exact for event times of at least -2**61."""
    span = np.array([min(s, _SPAN_CAP) for s in spans_ms], dtype=np.int64)
    return np.minimum(last_ms, MAX_SPAN_MS - span) + span


def _horizon(watermark_ms: int, span_ms: int) -> int:
    """Oldest event time still needed; saturated so a huge window cannot overflow int64."""
    return max(watermark_ms - span_ms, -MAX_SPAN_MS)


def _prune_memory(memory: dict, horizon: int) -> dict:
    pruned = {}
    for rule_id, mem in memory.items():
        reported = {v: t for v, t in mem.get("reported", {}).items() if t >= horizon}
        last = mem.get("last_alert")
        kept = {"last_alert": last, "reported": reported}
        # A summary without buckets holds nothing a window can still use.
        if mem.get("buckets") is not None and len(mem["buckets"]["start"]):
            kept["buckets"] = mem["buckets"]
        if reported or (last is not None and last >= horizon) or "buckets" in kept:
            pruned[rule_id] = kept
    return pruned


def newest_time(event_times: np.ndarray, memory: dict) -> int:
    """The newest event time a key's history or memory refers to (drives its expiry)."""
    times = [int(event_times.max())] if len(event_times) else []
    for mem in memory.values():
        if mem.get("last_alert") is not None:
            times.append(mem["last_alert"])
        summary = mem.get("buckets")
        if summary is not None and len(summary["start"]):
            times.append(int(summary["start"][-1]))
    return max(times, default=-(2**62))


def _rule_values(rule: Rule, cols: Mapping[str, np.ndarray], sel: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """The aggregated field as (values, non-null mask, decimal scale) restricted to ``sel``."""
    name = rule.aggregate_field
    if name in NUMERIC_FIELDS and rule.aggregator is not Aggregator.UNIQUE_COUNT:
        return cols[name][sel], ~cols[f"{name}_null"][sel], MONEY_SCALE
    if name in NUMERIC_FIELDS:
        # Distinct money values are counted and reported as decimal text ("12.50"), like strings.
        text = _field_text(cols, name)[sel]
        return text, np.array([v is not None for v in text], dtype=bool), 0
    values = cols[name][sel]
    return values, np.array([v is not None for v in values], dtype=bool), 0


def _field_text(cols: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    """A field as text (money as its decimal string), None where null: what filters compare."""
    if name not in NUMERIC_FIELDS:
        return cols[name]
    units, null = cols[name], cols[f"{name}_null"]
    return np.array(
        [None if n else str(Decimal(int(u)).scaleb(-MONEY_SCALE)) for u, n in zip(units.tolist(), null.tolist())],
        dtype=object,
    )


def _seen_by(rule: Rule, cleared: int | None, cols: Mapping[str, np.ndarray], rows: np.ndarray) -> np.ndarray:
    """Which of ``rows`` the rule sees: its filter holds and the event is after its clear point."""
    sel = rows.copy()
    for name, wanted in rule.filter:
        sel &= _field_text(cols, name) == wanted
    if cleared is not None:
        sel &= cols["eventTime"] > cleared
    return sel


def _evaluate_rule(
    rule: Rule,
    version: int,
    cleared: int | None,
    in_keyset: np.ndarray,
    cols: Mapping[str, np.ndarray],
    group: np.ndarray,
    is_new: np.ndarray,
    ingest: np.ndarray,
    key_group: np.ndarray,
    memories: list[dict],
) -> tuple[list[dict], pd.DataFrame | None]:
    """The rule's alerts (dicts) and window metrics (a frame; None when no new event is in the rule's view)."""
    sel = _seen_by(rule, cleared, cols, in_keyset)
    summaries: list[buckets.Summary | None] = []
    if rule.bucket_ms:
        fp = buckets.fingerprint(rule, cleared)
        summaries = [buckets.current(memory.get(rule.rule_id), fp) for memory in memories]
        # Raw events before a key's fold point are already in its folded buckets.
        folded_to = np.array([s["to"] if s else buckets.NOT_FOLDED for s in summaries], dtype=np.int64)
        sel &= cols["eventTime"] >= folded_to[group]
    idx = np.flatnonzero(sel)
    if len(idx) == 0 or not is_new[idx].any():
        return [], None
    g, t = group[idx], cols["eventTime"][idx]
    values, valid, scale = _rule_values(rule, cols, idx)
    lo = window_lo(g, t, window_start(t, rule.window_ms, rule.bucket_ms))
    pos = np.flatnonzero(is_new[idx])
    agg = aggregate(rule.aggregator, values, valid, lo, pos)
    folded_sets = _add_folded_buckets(rule, agg, summaries, pos, g, t, lo, values, valid) if any(summaries) else {}
    value_scale = scale if rule.aggregator not in (Aggregator.COUNT, Aggregator.UNIQUE_COUNT) else 0
    holds = compare(rule.operator, agg, rule.limit, value_scale, rule.aggregator)
    tids = cols["transactionId"][idx]
    common = {
        "rule_id": rule.rule_id, "rule_version": version, "keyset": rule.keyset,
        "limit_value": str(rule.limit), "operator": rule.operator.value, "aggregator": rule.aggregator.value,
    }  # fmt: skip
    hits = np.flatnonzero(holds)
    at = pos[hits]  # positions (within idx) of the events that fire
    # (j, distinct values) of the alerts to emit
    if rule.aggregator is Aggregator.UNIQUE_COUNT or rule.cooldown_ms or rule.report_new_values_only:
        fired = _with_memory(rule, cleared, hits, at, lo, values, valid, g, t, memories, folded_sets)
    else:
        fired = [(j, None) for j in hits.tolist()]
    out: list[dict] = []
    if fired:
        chosen = np.array([j for j, _ in fired], dtype=np.int64)
        p = pos[chosen]
        now = t[p]
        texts = decimal_texts(rule.aggregator, agg, chosen, value_scale).to_pylist()
        starts = window_start(now, rule.window_ms, rule.bucket_ms).tolist()
        # The key's parts are the triggering event's own grouping values.
        parts = list(zip(*[_field_text(cols, name)[idx[p]].tolist() for name in rule.grouping_keys]))
        tid, gid, ing = tids[p].tolist(), g[p].tolist(), ingest[idx][p].tolist()
        counts, now = agg.count[chosen].tolist(), now.tolist()
        for i, (_, distinct) in enumerate(fired):
            out.append({
                "kind": "alert", **common, "group_key": key_group[gid[i]], "transaction_id": tid[i], "event_ms": now[i],
                "aggregate_value": texts[i], "window_start_ms": starts[i], "window_end_ms": now[i],
                "event_count": counts[i],
                "distinct_values": distinct[:MAX_REPORTED_VALUES] if distinct is not None else None,
                "detail": rule.description or None, "key_values": list(parts[i]), "ingest_ms": ing[i] or None,
            })  # fmt: skip
    return out, _metrics(rule, common, agg, pos, g, t, value_scale, key_group)


def _add_folded_buckets(
    rule: Rule,
    agg,
    summaries: list,
    pos: np.ndarray,
    g: np.ndarray,
    t: np.ndarray,
    lo: np.ndarray,
    values: np.ndarray,
    valid: np.ndarray,
) -> dict[int, frozenset]:
    """Add each key's folded buckets inside the window to its events' aggregates; for
    UNIQUE_COUNT, return the folded distinct values per position in ``pos`` that has any."""
    agg.count, agg.nonnull = agg.count.copy(), agg.nonnull.copy()
    starts = window_start(t[pos], rule.window_ms, rule.bucket_ms)
    keys = g[pos]
    runs = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1], True])
    folded: dict[int, frozenset] = {}
    for a, z in zip(runs[:-1].tolist(), runs[1:].tolist()):
        summary = summaries[int(keys[a])]
        if summary is None or not len(summary["start"]):
            continue
        suffixes = buckets.Suffixes(summary)
        first = suffixes.first_at_or_after(starts[a:z])
        raw_sets = None
        if rule.aggregator is Aggregator.UNIQUE_COUNT:
            raw_sets = [set(values[lo[p] : p + 1][valid[lo[p] : p + 1]].tolist()) for p in pos[a:z].tolist()]
            folded.update((a + k, suffixes.distinct(int(i))) for k, i in enumerate(first.tolist()))
        buckets.add_folded(rule.aggregator, agg, np.arange(a, z), suffixes, first, raw_sets)
    return folded


def _with_memory(
    rule: Rule,
    cleared: int | None,
    hits: np.ndarray,
    at: np.ndarray,
    lo: np.ndarray,
    values: np.ndarray,
    valid: np.ndarray,
    g: np.ndarray,
    t: np.ndarray,
    memories: list[dict],
    folded_sets: Mapping[int, frozenset],
) -> list[tuple[int, list | None]]:
    """The firing positions that survive the rule's cooldown / reported-values memory, in event
    order (each alert updates the memory the next one sees), with their distinct values."""
    fired: list[tuple[int, list | None]] = []
    for j, p in zip(hits.tolist(), at.tolist()):
        distinct = None
        if rule.aggregator is Aggregator.UNIQUE_COUNT:
            window_vals = values[lo[p] : p + 1][valid[lo[p] : p + 1]].tolist()
            distinct = sorted({str(v) for v in [*window_vals, *folded_sets.get(j, ())]})
        if not (rule.cooldown_ms or rule.report_new_values_only):
            fired.append((j, distinct))
            continue
        memory = memories[int(g[p])].setdefault(rule.rule_id, {"last_alert": None, "reported": {}})
        if cleared is not None and (memory["last_alert"] or 0) <= cleared:
            memory.update(last_alert=None, reported={})  # written before the clear point: forgotten
        now = int(t[p])
        if rule.cooldown_ms and memory["last_alert"] is not None and now < memory["last_alert"] + rule.cooldown_ms:
            continue
        if rule.report_new_values_only:
            reported = memory["reported"]
            distinct = [v for v in distinct if reported.get(v, -(2**63)) < now - rule.window_ms]
            if not distinct:
                continue
            for v in distinct:
                reported[v] = now
        memory["last_alert"] = now
        fired.append((j, distinct))
    return fired


def _metrics(rule: Rule, common: dict, agg, pos: np.ndarray, g: np.ndarray, t: np.ndarray, scale: int, key_group: np.ndarray) -> pd.DataFrame:
    """Per key touched: the window at its last event of the batch and the batch's peak aggregate.

    Text columns are Arrow-backed: at a million keys this is a row per event, and pyspark hands
    such columns to Arrow as they are instead of converting a Python string per row."""
    groups = g[pos]
    last_of_group = np.flatnonzero(np.r_[groups[1:] != groups[:-1], True])
    first_of_group = np.r_[0, last_of_group[:-1] + 1]
    peaks = np.array(_group_peaks(rule.aggregator, agg, first_of_group, last_of_group), dtype=np.int64)
    times = t[pos[last_of_group]]
    peak_values = pc.if_else(peaks >= 0, decimal_texts(rule.aggregator, agg, np.maximum(peaks, 0), scale), None)
    constants = {name: pa.repeat(value, len(times)) for name, value in {"kind": "metric", **common}.items()}
    return pd.DataFrame({
        **{name: arrow_column(values) for name, values in constants.items()},
        "group_key": arrow_column(pa.array(key_group[groups[last_of_group]], pa.string())),
        "event_ms": times, "transaction_id": arrow_column(pa.nulls(len(times), pa.string())),
        "aggregate_value": arrow_column(decimal_texts(rule.aggregator, agg, last_of_group, scale)),
        "max_aggregate": arrow_column(peak_values),
        "window_start_ms": window_start(times, rule.window_ms, rule.bucket_ms), "window_end_ms": times,
        "event_count": agg.count[last_of_group],
    }, index=pd.RangeIndex(len(times)))  # fmt: skip


def arrow_column(values: pa.Array | pa.ChunkedArray) -> pd.Series:
    """An Arrow array as a pandas column, without converting its values."""
    return pd.Series(pd.arrays.ArrowExtensionArray(values), copy=False)


def _group_peaks(aggregator: Aggregator, agg, first: np.ndarray, last: np.ndarray) -> list[int]:
    """Index of each group's largest valid aggregate (-1 if none); vectorised except for AVG."""
    if aggregator is not Aggregator.AVG:
        masked = np.where(agg.valid, agg.value, np.iinfo(np.int64).min)
        peak_values = np.maximum.reduceat(masked, first) if len(first) else masked[:0]
        group_of = np.repeat(np.arange(len(first)), last - first + 1)
        is_peak = (masked == peak_values[group_of]) & agg.valid
        # Any position reaching the group's peak reports the same value.
        hits = np.flatnonzero(is_peak)
        peaks = np.full(len(first), -1, dtype=np.int64)
        peaks[group_of[hits][::-1]] = hits[::-1]
        return peaks.tolist()
    out = []
    for lo, hi in zip(first.tolist(), last.tolist()):
        candidates = [j for j in range(lo, hi + 1) if agg.valid[j]]
        out.append(max(candidates, key=lambda j: Decimal(int(agg.value[j])) / Decimal(int(agg.nonnull[j])), default=-1))
    return out
