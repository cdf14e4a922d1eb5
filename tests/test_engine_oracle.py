"""The micro-batch engine (rulewatch.engine.engine / rulewatch.engine.windows) agrees with the brute-force oracle.

The driver below mirrors what the Spark wrapper does around ``evaluate_batch``: key every event once per keyset of
the rule book, cut the time-ordered stream into micro-batches (rows shuffled inside a batch: the engine must sort
itself), keep a dict as the state store (state key -> blob, ``None`` write = delete) and, for the watermark variant,
emulate the event-time cleanup timers with ``BatchResult.expiry_ms`` (a key is dropped once the watermark has passed
its expiry).

Sections: 1. property tests (hypothesis) against the oracle; 2. the brief's worked examples; 3. retention, expiry,
paused / deleted rules; 4. late events; 5. window metrics; then minimal reproductions of engine bugs found here.
"""

from __future__ import annotations

import random
import sys
from collections import defaultdict
from decimal import Decimal
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle import oracle, parse_duration_ms  # noqa: E402
from test_oracle import LOGIN_RULE, LOGIN_TABLE, login  # noqa: E402
from test_oracle import login_events as oracle_login_events  # noqa: E402

from rulewatch.engine.engine import (  # noqa: E402
    KEY_SEPARATOR,
    MAX_REPORTED_VALUES,
    MAX_SPAN_MS,
    decode_history,
    evaluate_batch,
    key_expiries,
    state_key,
)
from rulewatch.engine.book import RuleBook  # noqa: E402
from rulewatch.engine.rules import Aggregator  # noqa: E402
from rulewatch.engine.windows import WindowAggregates, decimal_texts, to_decimal  # noqa: E402

MIN = 60_000
T0 = 1_793_527_200_000  # 2026-11-01T10:00:00Z
STRING_FIELDS = ("payeeId", "beneficiaryId", "paymentType", "userId", "ip", "action")


# ------------------------------------------------------------------------------------------------- driver


def make_book(rules: list[dict], version: int = 1) -> RuleBook:
    book = RuleBook()
    for r in rules:
        err = book.apply("insert", r, version)
        assert err is None, (r, err)
    return book


def keysets(book: RuleBook) -> list[str]:
    return sorted({rule.keyset for rule, _ in book.rules.values()})


def cents(amount) -> int:
    d = Decimal(str(amount))
    c = d * 100
    assert c == c.to_integral_value(), f"{amount} has more than 2 decimals"
    return int(c)


def key_rows(events: list[dict], book: RuleBook) -> list[dict]:
    """One row per (event, keyset of the book) whose grouping fields are all present."""
    rows = []
    for keyset in keysets(book):
        names = keyset.split(",")
        for e in events:
            vals = [e.get(n) for n in names]
            if any(v is None for v in vals):
                continue
            amount = e.get("paymentAmount")
            row = {
                "keyset": keyset,
                "group_key": "|".join(str(v) for v in vals),
                "eventTime": int(e["eventTime"]),
                "transactionId": str(e["transactionId"]),
            }
            for f in STRING_FIELDS:
                row[f] = e.get(f)
            row["paymentAmount"] = 0 if amount is None else cents(amount)
            row["paymentAmount_null"] = amount is None
            rows.append(row)
    return rows


def frame(rows: list[dict]) -> pd.DataFrame:
    cols = {
        "keyset": pd.Series([r["keyset"] for r in rows], dtype=object),
        "group_key": pd.Series([r["group_key"] for r in rows], dtype=object),
        "eventTime": pd.Series([r["eventTime"] for r in rows], dtype="int64"),
        "transactionId": pd.Series([r["transactionId"] for r in rows], dtype=object),
    }
    for f in STRING_FIELDS:
        cols[f] = pd.Series([r[f] for r in rows], dtype=object)
    cols["paymentAmount"] = pd.Series([r["paymentAmount"] for r in rows], dtype="int64")
    cols["paymentAmount_null"] = pd.Series([r["paymentAmount_null"] for r in rows], dtype=bool)
    return pd.DataFrame(cols)


class Driver:
    """A rule book, a state store and the cleanup timers of one shard."""

    def __init__(self, book: RuleBook, rng: random.Random | None = None):
        self.book = book
        self.store: dict[str, bytes] = {}
        self.timers: dict[str, int] = {}
        self.rng = rng or random.Random(0)
        self.results = []  # (watermark, BatchResult) per batch

    def load(self, keys: list[str]) -> dict[str, bytes | None]:
        return {key: self.store.get(key) for key in keys}

    def fire_timers(self, watermark_ms: int) -> list[str]:
        """Event-time timers: a key whose expiry the watermark has passed is dropped."""
        fired = [k for k, t in self.timers.items() if watermark_ms > t]
        for k in fired:
            self.store.pop(k, None)
            del self.timers[k]
        return fired

    def run_batch(self, events: list[dict], watermark_ms: int = 0, shuffle: bool = True, next_watermark_ms: int = 0):
        rows = key_rows(events, self.book)
        if shuffle:
            self.rng.shuffle(rows)
        if watermark_ms > 0:
            self.fire_timers(watermark_ms)
        self.next_watermark_ms = next_watermark_ms
        result = evaluate_batch(frame(rows), self.book, self.load, watermark_ms, next_watermark_ms)
        for key, blob in result.writes.items():
            if blob is None:
                self.store.pop(key, None)
                self.timers.pop(key, None)
            else:
                self.store[key] = blob
        for key, t in result.expiry_ms.items():
            self.timers[key] = t
        self.results.append((watermark_ms, result))
        return result

    def rows(self, kind: str) -> list[dict]:
        return [r for _, res in self.results for r in res.records() if r["kind"] == kind]

    def alerts(self) -> list[dict]:
        return self.rows("alert")

    def history(self, keyset: str, group_key: str):
        blob = self.store.get(state_key(keyset, group_key))
        return None if blob is None else decode_history(blob)


def sort_events(events: list[dict]) -> list[dict]:
    return sorted(events, key=lambda e: (int(e["eventTime"]), str(e["transactionId"])))


def run_stream(events, rules, cuts=None, lateness=None, rng=None, book=None, on_batch=None) -> Driver:
    """Feed the (time, id)-sorted events in contiguous batches cut at ``cuts``.

    ``lateness`` None: watermark 0 (nothing trimmed). Otherwise the watermark of a batch is the newest event time
    seen before it minus ``lateness`` (0 for the first batch, as in Spark).
    """
    ordered = sort_events(events)
    cuts = sorted(set(c for c in (cuts or []) if 0 < c < len(ordered)))
    bounds = [0, *cuts, len(ordered)]
    d = Driver(book or make_book(rules), rng)
    newest = None
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        batch = ordered[lo:hi]
        wm = 0 if lateness is None or newest is None else max(newest - lateness, 0)
        if batch:
            top = max(int(e["eventTime"]) for e in batch)
            newest = top if newest is None else max(newest, top)
        # As in Spark: the next batch's watermark is at least this batch's newest event minus the lateness.
        next_wm = 0 if lateness is None or newest is None else max(newest - lateness, 0)
        result = d.run_batch(batch, wm, next_watermark_ms=next_wm)
        if on_batch is not None:
            on_batch(d, ordered[:hi], batch, wm, result)
    return d


# ------------------------------------------------------------------------------------------------- comparison


def _dec(v):
    return None if v is None else Decimal(str(v))


def comparable_engine(alerts: list[dict]) -> dict:
    out = {}
    for a in alerts:
        k = (int(a["rule_id"]), a["transaction_id"], a["group_key"])
        assert k not in out, f"duplicate alert {k}"
        dv = a.get("distinct_values")
        out[k] = (
            _dec(a["aggregate_value"]), int(a["event_count"]), int(a["window_start_ms"]), int(a["window_end_ms"]),
            None if dv is None else list(dv),
        )
    return out


def comparable_oracle(alerts: list[dict]) -> dict:
    out = {}
    for a in alerts:
        k = (int(a["rule_id"]), a["transaction_id"], a["group_key"])
        vals = a["values"]
        out[k] = (
            _dec(a["aggregate_value"]), int(a["event_count"]), int(a["window_start"]), int(a["window_end"]),
            None if vals is None else list(vals[:MAX_REPORTED_VALUES]),
        )
    return out


def assert_same_alerts(engine_alerts: list[dict], expected: list[dict]):
    got, want = comparable_engine(engine_alerts), comparable_oracle(expected)
    missing = {k: want[k] for k in sorted(set(want) - set(got))}
    extra = {k: got[k] for k in sorted(set(got) - set(want))}
    differ = {k: (got[k], want[k]) for k in sorted(set(got) & set(want)) if got[k] != want[k]}
    assert not missing and not extra and not differ, (
        f"missing (oracle only): {missing}\nextra (engine only): {extra}\ndiffer (engine, oracle): {differ}"
    )


# ------------------------------------------------------------------------------------------------- strategies

TICK = 250  # event times on a coarse grid (many ties, many windows ending exactly on an event) ...
JITTER = st.sampled_from([0, 0, 0, 0, 1, -1, 125])  # ... plus a few off-grid times to probe the inclusive ends
OPERATORS = ["GREATER", "GREATER_EQUAL", "LESS", "LESS_EQUAL", "EQUAL", "NOT_EQUAL", ">", ">=", "<", "<=", "=", "==", "!="]
KEYSETS = [["payeeId"], ["payeeId", "paymentType"], ["ip"], ["userId"], ["beneficiaryId", "payeeId"]]
# window -> buckets that divide it and are shorter
WINDOWS = {
    "250ms": [], "500ms": ["250ms"], "1s": ["250ms", "500ms"], "2s": ["250ms", "500ms", "1s"],
    "3s": ["1s", "500ms", "1500ms"], "5s": ["1s", "2500ms"], "1m": ["20s", "30s"],
}
ALPHABET = {
    "payeeId": ["p1", "p2", None],
    "beneficiaryId": ["b1", "b2", None],
    "paymentType": ["CSH", "CRD", None],
    "userId": ["u1", "u2", "u3", "u4", None],
    "ip": ["10.0.0.1", "10.0.0.2", None],
    "action": ["login", "logout", "pay", None],
}
# money filters compare the amount's text (scale 2, as silver stores it); 1 and "1" match no amount
MONEY_FILTERS = ["0.00", "1.00", "2.50", "10.00", "19.99", "20.00", 1, "1", None]
AMOUNT_CENTS = st.one_of(st.sampled_from([0, 1, 99, 100, 250, 500, 1000, 1999, 2000, 2001]), st.integers(0, 3000))


@st.composite
def events_st(draw, max_events=24):
    n = draw(st.integers(0, max_events))
    out = []
    for i in range(n):
        t = T0 + draw(st.integers(0, 40)) * TICK + draw(JITTER)
        e = {"transactionId": draw(st.sampled_from(["a", "b", "c", "x", "y"])) + f"{i:02d}", "eventTime": t}
        for f, alphabet in ALPHABET.items():
            # mostly present: a missing grouping field drops the event for that keyset only
            e[f] = draw(st.sampled_from(alphabet[:-1] * 3 + [None]))
        e["paymentAmount"] = draw(st.one_of(st.none(), AMOUNT_CENTS.map(lambda c: Decimal(c).scaleb(-2))))
        out.append(e)
    return out


def _limit_st(agg: str):
    if agg in ("COUNT", "COUNT_FLINK", "UNIQUE_COUNT"):
        return st.one_of(st.integers(0, 6), st.sampled_from(["2.5", "3.0", 1.5, "-1", "1e30", "3E0", "-1e30"]))
    return st.one_of(
        st.sampled_from([0, 5, 10, 20, "19.99", "20.00", "10.5", 2.5, "0.01", "7.333333", "12.3456", "-1", "1e1",
                         "2E+1", "19.999999999999999999999", "1e30", "-1e30", "1E-30", 0.1]),
        st.integers(0, 60),
        AMOUNT_CENTS.map(lambda c: str(Decimal(c).scaleb(-2))),
    )


@st.composite
def rule_st(draw, rule_id: int):
    agg = draw(st.sampled_from(["SUM", "COUNT", "AVG", "MIN", "MAX", "UNIQUE_COUNT", "COUNT_FLINK"]))
    r = {"ruleId": rule_id, "groupingKeyNames": list(draw(st.sampled_from(KEYSETS)))}
    state = draw(st.sampled_from([None, "ACTIVE", "ACTIVE", "PAUSE"]))
    if state is not None:
        r["ruleState"] = state
    if agg in ("SUM", "AVG", "MIN", "MAX"):
        field = "paymentAmount"
    elif agg in ("COUNT", "COUNT_FLINK"):
        field = draw(st.sampled_from(["paymentAmount", "userId", "COUNT_FLINK"]))
    else:
        field = draw(st.sampled_from(["userId", "ip", "action", "payeeId", "transactionId", "paymentAmount"]))
    if agg == "SUM" and draw(st.booleans()) and draw(st.booleans()):
        field = "COUNT_FLINK"  # the reference's magic field: SUM over it counts events
    r["aggregateFieldName"] = field
    r["aggregatorFunctionType"] = agg
    r["limitOperatorType"] = draw(st.sampled_from(OPERATORS))
    r["limit"] = draw(_limit_st("COUNT" if field == "COUNT_FLINK" else agg))
    if draw(st.integers(0, 5)) == 0:
        r["windowMinutes"] = 1
        window = "1m"
    else:
        window = draw(st.sampled_from(sorted(WINDOWS)))
        r["window"] = window
    if WINDOWS[window] and draw(st.integers(0, 3)) == 0:
        r["bucket"] = draw(st.sampled_from(WINDOWS[window]))
    if draw(st.booleans()):
        fields = draw(st.lists(st.sampled_from(["action", "paymentType", "ip", "userId", "paymentAmount"]), min_size=1, max_size=2, unique=True))
        r["filter"] = {f: draw(st.sampled_from(ALPHABET.get(f, MONEY_FILTERS)[:-1])) for f in fields}
    if draw(st.integers(0, 3)) == 0:
        r["cooldown"] = draw(st.sampled_from(["1ms", "250ms", "1s", "2s", "5s"]))
    if agg == "UNIQUE_COUNT" and draw(st.booleans()):
        r["reportNewValuesOnly"] = True
    elif draw(st.integers(0, 5)) == 0:
        r["reportNewValuesOnly"] = False
    return r


@st.composite
def rules_st(draw):
    n = draw(st.integers(1, 4))
    ids = draw(st.lists(st.integers(1, 99), min_size=n, max_size=n, unique=True))
    return [draw(rule_st(i)) for i in ids]


@st.composite
def cuts_st(draw, n: int):
    if n <= 1:
        return []
    mode = draw(st.sampled_from(["one", "each", "random", "random"]))
    if mode == "one":
        return []
    if mode == "each":
        return list(range(1, n))
    return draw(st.lists(st.integers(1, n - 1), max_size=min(8, n - 1), unique=True))


# ------------------------------------------------------------------------------------------------- metrics brute force

ALWAYS = {"limitOperatorType": "!=", "limit": "-0.5"}  # aggregates here are never negative: every event "alerts"


def _clone(rule: dict, **kw) -> dict:
    c = {k: v for k, v in rule.items() if k not in ("cooldown", "reportNewValuesOnly", "ruleState")}
    c.update(ALWAYS)
    c.update(kw)
    return c


def per_event_windows(events: list[dict], rule: dict) -> dict:
    """(transaction_id, group_key) -> (aggregate or None, event_count, window_start) for every event the rule sees.

    Uses the oracle itself with an always-true condition; the COUNT twin gives the events seen and the window sizes
    (MIN/MAX/AVG over only-null windows have no aggregate and are absent from the first run)."""
    counts = {(a["transaction_id"], a["group_key"]): a for a in oracle(events, [_clone(rule, aggregatorFunctionType="COUNT", aggregateFieldName="paymentAmount")])}
    values = {(a["transaction_id"], a["group_key"]): a for a in oracle(events, [_clone(rule)])}
    return {
        k: (_dec(values[k]["aggregate_value"]) if k in values else None, c["event_count"], c["window_start"], c["event_time"])
        for k, c in counts.items()
    }


def expected_metrics(batch: list[dict], rules: list[dict], windows: dict) -> dict:
    """(rule_id, group_key) -> metric tuple for the keys each active rule sees in this batch."""
    out = {}
    batch_ids = {e["transactionId"] for e in batch}
    for r in rules:
        if r.get("ruleState", "ACTIVE") != "ACTIVE":
            continue
        per_key = defaultdict(list)
        for (tid, gk), w in windows[r["ruleId"]].items():
            if tid in batch_ids:
                per_key[gk].append((w[3], tid, w))
        for gk, items in per_key.items():
            items.sort()
            _, _, (value, count, start, t) = items[-1]
            aggs = [w[0] for _, _, w in items if w[0] is not None]
            out[(int(r["ruleId"]), gk)] = (t, value, max(aggs) if aggs else None, count, start, t)
    return out


def engine_metrics(result) -> dict:
    out = {}
    for m in result.records():
        if m["kind"] != "metric":
            continue
        k = (int(m["rule_id"]), m["group_key"])
        assert k not in out, f"two metrics for {k}"
        out[k] = (
            int(m["event_ms"]), _dec(m["aggregate_value"]), _dec(m["max_aggregate"]), int(m["event_count"]),
            int(m["window_start_ms"]), int(m["window_end_ms"]),
        )
    return out


def assert_same_metrics(result, batch, rules, windows):
    got, want = engine_metrics(result), expected_metrics(batch, rules, windows)
    assert got == want, {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}


# ------------------------------------------------------------------------------------------------- 1. property


def _span(rules: list[dict], keyset: str) -> tuple[int, int]:
    """(history retention, memory span) a keyset needs, from the rule dicts (oracle's duration parser)."""
    ret = mem = 0
    for r in rules:
        if ",".join(r["groupingKeyNames"]) != keyset:
            continue
        w = parse_duration_ms(r["window"]) if "window" in r else r["windowMinutes"] * MIN
        b = parse_duration_ms(r["bucket"]) if r.get("bucket") else 0
        c = parse_duration_ms(r["cooldown"]) if r.get("cooldown") else 0
        # a bucketed rule keeps raw events for its open bucket only; older ones live folded in its memory
        ret, mem = max(ret, b or w), max(mem, w + b, c)
    return ret, mem


def check_state(rules):
    """on_batch hook: a written key holds exactly its events inside the retention, never an empty blob."""

    def hook(d: Driver, so_far, batch, wm, result):
        assert not any(r["kind"] == "late" for r in result.records()), "in-order stream produced late rows"
        for key, blob in result.writes.items():
            keyset, group_key = key.split(KEY_SEPARATOR, 1)
            retention, memory_span = _span(rules, keyset)
            mine = [e for e in key_rows(so_far, d.book) if e["keyset"] == keyset and e["group_key"] == group_key]
            horizon = wm - retention if wm > 0 else -(2**63)
            want = sorted((e["eventTime"], e["transactionId"]) for e in mine if e["eventTime"] >= horizon)
            if blob is None:
                # Nothing left, or nothing an event at or after the next watermark could see.
                inert = bool(mine) and max(e["eventTime"] for e in mine) + max(retention, memory_span) < d.next_watermark_ms
                assert not want or inert, (key, want)
                continue
            cols, memory = decode_history(blob)
            got = sorted(zip(cols["eventTime"].tolist(), cols["transactionId"].tolist()))
            assert got == want, f"{key}: stored {got}, expected {want} (watermark {wm}, retention {retention})"
            assert got or memory, f"{key}: empty blob kept"
            newest = max(e["eventTime"] for e in mine)
            assert result.expiry_ms[key] <= newest + max(retention, memory_span), (key, result.expiry_ms[key])

    return hook


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(events=events_st(), rules=rules_st(), data=st.data())
def test_engine_matches_oracle(events, rules, data):
    expected = oracle(events, rules)
    event(f"oracle alerts: {min(len(expected), 10) // 5 * 5}+")
    event(f"features: {sorted({k for r in rules for k in ('bucket', 'cooldown', 'reportNewValuesOnly', 'filter') if r.get(k)})}")
    cuts = data.draw(cuts_st(len(events)), label="cuts")
    seed = data.draw(st.integers(0, 2**32), label="shuffle seed")
    windows = {r["ruleId"]: per_event_windows(events, r) for r in rules}

    def metrics_hook(d, so_far, batch, wm, result):
        assert_same_metrics(result, batch, rules, windows)

    # no trimming
    d = run_stream(events, rules, cuts, lateness=None, rng=random.Random(seed), on_batch=metrics_hook)
    assert_same_alerts(d.alerts(), expected)
    assert not d.rows("late")

    # watermark = newest event seen before the batch - L: nothing is late, state is trimmed and expires by timers
    lateness = data.draw(st.sampled_from([0, 0, 1, 250, 999, 10**9]), label="lateness")
    state_hook = check_state(rules)

    def both(*args):
        metrics_hook(*args)
        state_hook(*args)

    d = run_stream(events, rules, cuts, lateness=lateness, rng=random.Random(seed + 1), on_batch=both)
    assert_same_alerts(d.alerts(), expected)
    # once the watermark is past every key's newest event + retention, every key is gone
    if events:
        horizon = max(e["eventTime"] for e in events) + max(max(_span(rules, ks)) for ks in keysets(d.book)) + 1
        d.fire_timers(horizon)
        assert d.store == {}, sorted(d.store)


@st.composite
def memory_rules_st(draw):
    """Rules whose per-key memory matters: cooldowns longer or shorter than the window, reportNewValuesOnly."""
    n = draw(st.integers(1, 3))
    ids = draw(st.lists(st.integers(1, 99), min_size=n, max_size=n, unique=True))
    rules = []
    keys = draw(st.sampled_from(KEYSETS[:3]))
    for i in ids:
        agg = draw(st.sampled_from(["UNIQUE_COUNT", "UNIQUE_COUNT", "COUNT", "SUM", "MAX"]))
        field = {"UNIQUE_COUNT": draw(st.sampled_from(["userId", "action", "transactionId", "paymentAmount"])), "COUNT": "userId"}.get(agg, "paymentAmount")
        window = draw(st.sampled_from(["500ms", "1s", "2s", "3s"]))
        r = {"ruleId": i, "groupingKeyNames": list(keys), "aggregateFieldName": field, "aggregatorFunctionType": agg,
             "limitOperatorType": draw(st.sampled_from([">=", ">", "!=", "GREATER_EQUAL"])),
             "limit": draw(st.integers(0, 3)) if agg != "SUM" else draw(st.sampled_from([0, 5, "10.00", 20])),
             "window": window}  # fmt: skip
        if draw(st.integers(0, 2)):
            r["cooldown"] = draw(st.sampled_from(["250ms", "1s", "2s", "4s", "6s", "8s"]))
        if agg == "UNIQUE_COUNT" and draw(st.integers(0, 2)):
            r["reportNewValuesOnly"] = True
        if WINDOWS[window] and draw(st.integers(0, 4)) == 0:
            r["bucket"] = draw(st.sampled_from(WINDOWS[window]))
        rules.append(r)
    return rules


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(events=events_st(max_events=40), rules=memory_rules_st(), data=st.data())
def test_engine_matches_oracle_with_cooldown_and_reported_memory(events, rules, data):
    """Long streams cut into many batches with a tight watermark: pruning the per-key memory must be safe."""
    expected = oracle(events, rules)
    event(f"oracle alerts: {min(len(expected), 10) // 5 * 5}+")
    n = len(events)
    cuts = data.draw(st.one_of(st.just(list(range(1, n))), cuts_st(n)), label="cuts")
    seed = data.draw(st.integers(0, 2**32), label="shuffle seed")
    lateness = data.draw(st.sampled_from([None, 0, 0, 1, 250]), label="lateness")
    d = run_stream(events, rules, cuts, lateness=lateness, rng=random.Random(seed),
                   on_batch=check_state(rules) if lateness is not None else None)  # fmt: skip
    assert_same_alerts(d.alerts(), expected)


# ------------------------------------------------------------------------------------------------- out-of-order arrival


def run_arrivals(batches: list[list[dict]], rules: list[dict], lateness: int, rng=None, book=None):
    """Feed batches in arrival order; watermark = newest event time seen before the batch - lateness.

    Returns the driver and, per batch, the events that were on time (not behind the watermark)."""
    d = Driver(book or make_book(rules), rng)
    newest, on_time = None, []
    for batch in batches:
        wm = 0 if newest is None else max(newest - lateness, 0)
        if batch:
            top = max(e["eventTime"] for e in batch)
            newest = top if newest is None else max(newest, top)
        d.run_batch(batch, wm, next_watermark_ms=0 if newest is None else max(newest - lateness, 0))
        on_time.append([e for e in batch if not (wm > 0 and e["eventTime"] < wm)])
    return d, on_time


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(events=events_st(), rules=rules_st(), data=st.data())
def test_out_of_order_arrival_matches_oracle_over_what_has_arrived(events, rules, data):
    """Late (but not too late) events: each event is evaluated over its own window among the events that have
    arrived so far; events behind the watermark give a ``late`` row and are neither evaluated nor stored.

    Memoryless rules only (cooldown / reportNewValuesOnly depend on the order alerts are emitted in)."""
    rules = [{k: v for k, v in r.items() if k not in ("cooldown", "reportNewValuesOnly")} for r in rules]
    arrival = data.draw(st.permutations(events), label="arrival order")
    cuts = data.draw(cuts_st(len(events)), label="cuts")
    bounds = [0, *sorted(cuts), len(arrival)]
    batches = [list(arrival[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]
    lateness = data.draw(st.sampled_from([0, 500, 2000, 10**9]), label="lateness")
    d, on_time = run_arrivals(batches, rules, lateness, rng=random.Random(data.draw(st.integers(0, 2**32))))

    arrived: list[dict] = []
    for (wm, result), batch, kept in zip(d.results, batches, on_time):
        arrived += kept
        ids = {e["transactionId"] for e in kept}
        want = [a for a in oracle(arrived, rules) if a["transaction_id"] in ids]
        assert_same_alerts([r for r in result.records() if r["kind"] == "alert"], want)
        windows = {r["ruleId"]: per_event_windows(arrived, r) for r in rules}
        assert_same_metrics(result, kept, rules, windows)
        late_ids = {e["transactionId"] for e in batch} - ids
        late_rows = [r for r in result.records() if r["kind"] == "late"]
        expected_late = {(row["transactionId"], row["keyset"]) for row in key_rows([e for e in batch if e["transactionId"] in late_ids], d.book)}
        assert {(r["transaction_id"], r["keyset"]) for r in late_rows} == expected_late
        assert all(str(wm) in r["detail"] for r in late_rows)
        for blob in d.store.values():
            cols, _ = decode_history(blob)
            assert not late_ids & set(cols["transactionId"].tolist()), "a late event was stored"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(events=events_st(), rules=rules_st(), data=st.data())
def test_rule_changes_between_batches(events, rules, data):
    """Rules change while the stream runs (limit, operator, pause, resume, delete, re-add): each batch is evaluated
    with the rules of that moment over every earlier event. With a watermark, only changes that keep the retention
    (no delete / re-add) are made, so the trimmed history is still enough. Memoryless rules only."""
    rules = [{k: v for k, v in r.items() if k not in ("cooldown", "reportNewValuesOnly")} for r in rules]
    ordered = sort_events(events)
    cuts = data.draw(cuts_st(len(ordered)), label="cuts")
    lateness = data.draw(st.sampled_from([None, 0, 250]), label="lateness")
    actions = ["limit", "operator", "pause", "resume"] + (["delete", "readd"] if lateness is None else [])
    book = make_book(rules)
    current = {r["ruleId"]: (dict(r), 1) for r in rules}
    d = Driver(book, random.Random(data.draw(st.integers(0, 2**32))))
    bounds = [0, *sorted(cuts), len(ordered)]
    newest, version = None, 1
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        for _ in range(data.draw(st.integers(0, 2), label="changes")):
            version += 1
            base = data.draw(st.sampled_from(rules), label="rule")
            rid, action = base["ruleId"], data.draw(st.sampled_from(actions), label="action")
            body = dict(current[rid][0]) if rid in current else dict(base)
            if action == "delete":
                # a keyset whose last rule goes is no longer keyed (its events are not stored meanwhile), so a re-added
                # rule could not see them: only delete rules that share their keyset with another rule
                keyset = ",".join(base["groupingKeyNames"])
                if not any(",".join(b["groupingKeyNames"]) == keyset for i, (b, _) in current.items() if i != rid):
                    continue
                assert book.apply("delete", {"ruleId": rid}, version) is None
                current.pop(rid, None)
                continue
            if action == "limit":
                body["limit"] = data.draw(_limit_st("COUNT" if body["aggregateFieldName"] == "COUNT_FLINK" else body["aggregatorFunctionType"]))
            elif action == "operator":
                body["limitOperatorType"] = data.draw(st.sampled_from(OPERATORS))
            elif action in ("pause", "resume"):
                body["ruleState"] = "PAUSE" if action == "pause" else "ACTIVE"
            if rid not in current and lateness is not None:
                continue
            assert book.apply("update_postimage", body, version) is None
            current[rid] = (body, version)
        batch = ordered[lo:hi]
        wm = 0 if lateness is None or newest is None else newest - lateness
        top = max([newest or 0, *(e["eventTime"] for e in batch)])
        result = d.run_batch(batch, wm, next_watermark_ms=0 if lateness is None or not top else top - lateness)
        active = [body for body, _ in current.values()]
        ids = {e["transactionId"] for e in batch}
        want = [a for a in oracle(ordered[:hi], active) if a["transaction_id"] in ids]
        got = [r for r in result.records() if r["kind"] == "alert"]
        assert_same_alerts(got, want)
        assert all(a["rule_version"] == current[a["rule_id"]][1] for a in got)
        if batch:
            newest = max(newest or 0, max(e["eventTime"] for e in batch))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(events=events_st(max_events=30), rules=memory_rules_st(), data=st.data())
def test_clearing_a_rule_makes_it_start_over_at_the_clear_point(events, rules, data):
    """After "clear state" at time T a rule behaves as if created then: the oracle over only the events later
    than T, cooldown and reported values included; the other rules sharing its history are untouched."""
    ordered = sort_events(events)
    cut = data.draw(st.integers(0, len(ordered)), label="cut")
    target = data.draw(st.sampled_from([None, *[r["ruleId"] for r in rules]]), label="cleared rule (None: all)")
    newest = max((e["eventTime"] for e in ordered[:cut]), default=T0)
    # At or after every event evaluated so far, as the CLI's default (newest silver event time) is.
    clear_at = newest + data.draw(st.sampled_from([0, 0, TICK, 7 * TICK]), label="clear point offset")
    d = Driver(make_book(rules), random.Random(data.draw(st.integers(0, 2**32))))
    d.run_batch(ordered[:cut])
    before = d.alerts()
    d.book.clear(target, clear_at)
    d.run_batch(ordered[cut:])
    after = [a for a in d.alerts() if a not in before]
    later_ids = {e["transactionId"] for e in ordered[cut:]}
    want = []
    for r in rules:
        cleared = target in (None, r["ruleId"])
        seen = [e for e in ordered if e["eventTime"] > clear_at] if cleared else ordered
        want += [a for a in oracle(seen, [r]) if a["transaction_id"] in later_ids]
    assert_same_alerts(after, want)


def test_clear_points_survive_the_state_round_trip_and_go_with_the_rule():
    book = make_book([{**LOGIN_RULE, "ruleId": 1}, {**LOGIN_RULE, "ruleId": 2}])
    book.clear(1, 1_000)
    book.clear(None, 500)  # never moves a clear point back
    book.clear(7, 2_000)  # unknown rule: nothing to clear
    assert RuleBook.from_json(book.to_json()).cleared == {1: 1_000, 2: 500}
    book.apply("delete", {"ruleId": 1}, 3)
    assert book.cleared == {2: 500}


# ------------------------------------------------------------------------------------------------- 2. brief vectors


def pay(tid, t, amount, payee="p1", ptype="CSH", **kw):
    e = {"transactionId": tid, "eventTime": t, "payeeId": payee, "paymentType": ptype}
    e["paymentAmount"] = None if amount is None else Decimal(str(amount)).quantize(Decimal("0.01"))
    e.update(kw)
    return e


def ref_rule(**kw):
    r = {
        "ruleId": 1, "ruleState": "ACTIVE", "groupingKeyNames": ["payeeId", "paymentType"],
        "aggregateFieldName": "paymentAmount", "aggregatorFunctionType": "SUM", "limitOperatorType": "GREATER",
        "limit": 20, "windowMinutes": 1440,
    }  # fmt: skip
    r.update(kw)
    return r


def brief(alerts):
    return sorted((a["transaction_id"], Decimal(str(a["aggregate_value"]))) for a in alerts)


def both_ways(events, rules, **kw):
    """(event by event, one batch per event; everything in one batch) drivers, in (time, id) order."""
    return run_stream(events, rules, list(range(1, len(events))), **kw), run_stream(events, rules, [], **kw)


def test_reference_vector_sequence():
    events = [pay("t1", T0, 22, ptype="CSH"), pay("t2", T0 + 1000, 19, ptype="CRD"), pay("t3", T0 + 2000, 2, ptype="CRD")]
    for d in both_ways(events, [ref_rule()]):
        assert brief(d.alerts()) == [("t1", Decimal(22)), ("t3", Decimal(21))]
        assert_same_alerts(d.alerts(), oracle(events, [ref_rule()]))
        a3 = next(a for a in d.alerts() if a["transaction_id"] == "t3")
        assert a3["group_key"] == "p1|CRD" and a3["event_count"] == 2 and a3["keyset"] == "payeeId,paymentType"
        assert a3["window_start_ms"] == T0 + 2000 - 1440 * MIN and a3["window_end_ms"] == T0 + 2000


@pytest.mark.parametrize("ids,alerting", [(("a-19", "b-02"), "b-02"), (("b-19", "a-02"), "b-19")])
def test_reference_vector_same_timestamp_ordered_by_id(ids, alerting):
    events = [pay(ids[0], T0, 19, ptype="CRD"), pay(ids[1], T0, 2, ptype="CRD")]
    for d in both_ways(events, [ref_rule()]):
        assert brief(d.alerts()) == [(alerting, Decimal(21))]
    # arrival order against (time, id) order, in separate batches: the later id still sees the earlier one, and the
    # earlier id (arriving second) still sees only itself
    d, _ = run_arrivals([[events[1]], [events[0]]], [ref_rule()], lateness=0)
    assert brief(d.alerts()) == ([(alerting, Decimal(21))] if alerting == ids[0] else [])


def test_reference_vector_late_event_sees_earlier_events_of_its_window():
    t1, t3, t2 = pay("t1", T0, 19), pay("t3", T0 + 3 * MIN, 1), pay("t2", T0 + 1 * MIN, 2)  # t2 arrives last
    # one batch per event, arrival order, 5 minutes allowed lateness: t2 is late but evaluated over its own window
    # (t1 + t2 = 21). t3 was evaluated before t2 arrived (19 + 1 = 20: no alert) and is not re-evaluated.
    d, _ = run_arrivals([[t1], [t3], [t2]], [ref_rule()], lateness=5 * MIN)
    assert brief(d.alerts()) == [("t2", Decimal(21))]
    assert not d.rows("late")
    # all in one batch the engine sees everything the oracle sees
    d = run_stream([t1, t3, t2], [ref_rule()])
    assert brief(d.alerts()) == [("t2", Decimal(21)), ("t3", Decimal(22))]
    assert_same_alerts(d.alerts(), oracle([t1, t3, t2], [ref_rule()]))


def test_reference_vector_window_bounds_inclusive():
    r = ref_rule(windowMinutes=None, window="10m", groupingKeyNames=["payeeId"])
    del r["windowMinutes"]
    events = [pay("t1", T0, 15), pay("t2", T0 + 10 * MIN, 6), pay("t3", T0 + 10 * MIN + 1, 15)]
    for d in both_ways(events, [r]):
        assert brief(d.alerts()) == [("t2", Decimal(21)), ("t3", Decimal(21))]
        assert_same_alerts(d.alerts(), oracle(events, [r]))
    for d in both_ways(events, [r], lateness=0):
        assert_same_alerts(d.alerts(), oracle(events, [r]))


def login_events():
    return sort_events(oracle_login_events())


@pytest.mark.parametrize("lateness", [None, 0])
def test_malicious_login_table(lateness):
    events = login_events()
    for d in both_ways(events, [LOGIN_RULE], lateness=lateness):
        alerts = {a["transaction_id"]: a for a in d.alerts()}
        for i, (m, user, distinct, reported) in enumerate(LOGIN_TABLE):
            tid = f"l{i:02d}"
            if reported is None:
                assert tid not in alerts, (m, user)
            else:
                a = alerts.pop(tid)
                assert a["distinct_values"] == reported, (m, user)
                assert Decimal(a["aggregate_value"]) == distinct and a["group_key"] == "10.9.8.7" and a["rule_id"] == 7
        assert not alerts
        assert_same_alerts(d.alerts(), oracle(events, [LOGIN_RULE]))


def test_malicious_login_state_is_gone_after_an_hour():
    """Event by event with watermark = newest event seen: after an hour without logins the ip's history and its
    reported accounts are dropped (and user1..user4 are reported again at minute 72)."""
    events = login_events()
    seen = []

    def hook(d, so_far, batch, wm, result):
        h = d.history("ip", "10.9.8.7")
        if h is not None:
            seen.append((max(e["eventTime"] for e in batch), sorted(h[0]["eventTime"].tolist()), h[1]))

    run_stream(events, [LOGIN_RULE], list(range(1, len(events))), lateness=0, on_batch=hook)
    at = {(t - T0) // MIN: (times, memory) for t, times, memory in seen}
    times, memory = at[7]
    assert [(x - T0) // MIN for x in times] == [0, 1, 2, 3, 4, 5, 5, 6, 7]  # the logout at minute 5 is kept too
    assert set(memory[7]["reported"]) == {"user1", "user2", "user3", "user4", "user5", "user6"}
    times, memory = at[69]  # watermark is minute 68: everything before minute 8 is out of every window
    assert [(x - T0) // MIN for x in times] == [68, 69]
    assert memory == {} or not memory.get(7, {}).get("reported")


# ------------------------------------------------------------------------------------------------- 3. retention


def sum_rule(rule_id=1, window="1m", **kw):
    r = {"ruleId": rule_id, "groupingKeyNames": ["payeeId"], "aggregateFieldName": "paymentAmount",
         "aggregatorFunctionType": "SUM", "limitOperatorType": ">", "limit": 0, "window": window}  # fmt: skip
    r.update(kw)
    return r


def stored_times(d: Driver, keyset: str, group_key: str):
    h = d.history(keyset, group_key)
    return None if h is None else sorted((int(t) - T0) // 1000 for t in h[0]["eventTime"].tolist())


def test_trimming_and_expiry_drop_dead_keys():
    r = sum_rule(window="1m")
    d = Driver(make_book([r]))
    d.run_batch([pay("a1", T0, 1, payee="A"), pay("b1", T0, 1, payee="B")], watermark_ms=0)
    assert sorted(d.store) == [state_key("payeeId", "A"), state_key("payeeId", "B")]
    d.run_batch([pay("b2", T0 + 30_000, 1, payee="B")], watermark_ms=T0)
    assert stored_times(d, "payeeId", "B") == [0, 30]
    assert d.alerts()[-1]["aggregate_value"] == "2.00"
    # watermark T0+90s: B keeps only events >= T0+30s, A (newest event T0, window 1m) is dead and must be gone
    res = d.run_batch([pay("b3", T0 + 90_000, 1, payee="B")], watermark_ms=T0 + 90_000)
    assert stored_times(d, "payeeId", "B") == [30, 90]
    assert state_key("payeeId", "A") not in d.store, "key with nothing inside the retention kept in the store"
    assert res.expiry_ms[state_key("payeeId", "B")] == T0 + 90_000 + MIN
    assert d.alerts()[-1]["aggregate_value"] == "2.00"  # b2 + b3; b1 is out of b3's window
    # far later: B is dead too; a new key C only
    d.run_batch([pay("c1", T0 + 10 * MIN, 1, payee="C")], watermark_ms=T0 + 10 * MIN)
    assert sorted(d.store) == [state_key("payeeId", "C")]
    assert_same_alerts(d.alerts(), oracle([pay("a1", T0, 1, payee="A"), pay("b1", T0, 1, payee="B"),
                                           pay("b2", T0 + 30_000, 1, payee="B"), pay("b3", T0 + 90_000, 1, payee="B"),
                                           pay("c1", T0 + 10 * MIN, 1, payee="C")], [r]))  # fmt: skip


def test_cooldown_memory_outlives_the_window():
    """A 5-minute cooldown on a 1-minute window: the events go, the cooldown memory stays until it has run out."""
    r = sum_rule(window="1m", cooldown="5m")
    events = [pay("a1", T0, 1), pay("a2", T0 + 2 * MIN, 1), pay("a3", T0 + 4 * MIN, 1), pay("a4", T0 + 5 * MIN, 1)]
    d = run_stream(events, [r], [1, 2, 3], lateness=0)
    assert [a["transaction_id"] for a in d.alerts()] == ["a1", "a4"]
    assert_same_alerts(d.alerts(), oracle(events, [r]))
    assert stored_times(d, "payeeId", "p1") == [240, 300]
    d.fire_timers(T0 + 5 * MIN + 5 * MIN)
    assert d.store, "expired while the cooldown of the alert at T0+5m still runs"
    d.fire_timers(T0 + 10 * MIN + 1)
    assert d.store == {}


@pytest.mark.parametrize("how", ["delete change", "DELETE state"])
def test_paused_rule_keeps_retention_deleted_rule_does_not(how):
    narrow = sum_rule(1, window="1m", limit=1000)
    wide = sum_rule(2, window="1h", ruleState="PAUSE")
    book = make_book([narrow, wide])
    d = Driver(book)
    events = [pay(f"e{m:02d}", T0 + m * MIN, 1) for m in (0, 10, 20, 30)]
    for i, e in enumerate(events):
        d.run_batch([e], watermark_ms=events[i - 1]["eventTime"] if i else 0)
    # the paused 1h rule holds the history although the only active rule looks back 1 minute
    assert stored_times(d, "payeeId", "p1") == [0, 600, 1200, 1800]
    assert not [r for r in d.rows("alert") + d.rows("metric") if r["rule_id"] == 2]
    # resume it (a new rules-table version): it sees the whole hour at once
    assert book.apply("insert", dict(wide, ruleState="ACTIVE"), 2) is None
    res = d.run_batch([pay("e40", T0 + 40 * MIN, 1)], watermark_ms=T0 + 30 * MIN)
    (a,) = [r for r in res.records() if r["kind"] == "alert"]
    assert (a["rule_id"], a["rule_version"], a["aggregate_value"], a["event_count"]) == (2, 2, "5.00", 5)
    # delete it: its window no longer counts for the retention, and it neither alerts nor reports metrics
    if how == "delete change":
        assert book.apply("delete", {"ruleId": 2}, 3) is None
    else:
        assert book.apply("update_postimage", dict(wide, ruleState="DELETE"), 3) is None
    res = d.run_batch([pay("e50", T0 + 50 * MIN, 1)], watermark_ms=T0 + 40 * MIN)
    assert not [r for r in res.records() if r.get("rule_id") == 2]
    assert stored_times(d, "payeeId", "p1") == [2400, 3000]
    assert res.expiry_ms[state_key("payeeId", "p1")] == T0 + 50 * MIN + MIN


LIMITS = {  # each fires now and then on the stream below
    "SUM": {"limitOperatorType": ">", "limit": 170_000}, "COUNT": {"limitOperatorType": ">", "limit": 395},
    "AVG": {"limitOperatorType": ">", "limit": 510}, "MIN": {"limitOperatorType": "<", "limit": 10},
    "MAX": {"limitOperatorType": ">=", "limit": 990}, "UNIQUE_COUNT": {"limitOperatorType": ">", "limit": 11},
}  # fmt: skip


@pytest.mark.parametrize("aggregator", sorted(LIMITS))
def test_bucketed_rule_keeps_folded_buckets_not_raw_events(aggregator):
    """Two hours of one payee, a 1 h window in 1 min buckets, watermark = newest event: alerts equal the
    oracle's while the key keeps at most ~2 min of raw events plus at most 61 folded buckets."""
    rng = random.Random(7)
    field = "beneficiaryId" if aggregator == "UNIQUE_COUNT" else "paymentAmount"
    rule = {**sum_rule(window="1h", bucket="1m"), "aggregatorFunctionType": aggregator, "aggregateFieldName": field,
            **LIMITS[aggregator]}  # fmt: skip
    events = [
        {"transactionId": f"e{i:04d}", "eventTime": T0 + i * 9_000, "payeeId": "p1", "beneficiaryId": f"b{rng.randrange(12)}",
         "paymentAmount": Decimal(rng.randrange(0, 100_000)).scaleb(-2) if rng.random() > 0.1 else None}
        for i in range(800)
    ]  # fmt: skip
    sizes = []

    def hook(d, so_far, batch, wm, result):
        cols, memory = d.history("payeeId", "p1")
        sizes.append((len(cols["eventTime"]), len(memory.get(1, {}).get("buckets", {"start": []})["start"])))

    d = run_stream(events, [rule], list(range(10, 800, 10)), lateness=0, on_batch=hook)
    assert_same_alerts(d.alerts(), oracle(events, [rule]))
    assert any(d.alerts())
    raw, folded = zip(*sizes)
    assert max(raw) <= 2 * 60_000 // 9_000 + 10  # one open bucket + one batch, however long the stream
    assert max(folded) <= 61 and min(folded[47:]) >= 55  # batches are 90 s: a full window from minute 72 on


# ------------------------------------------------------------------------------------------------- 4. late events


def test_late_event_reported_not_evaluated_not_stored():
    rules = [sum_rule(1), sum_rule(2, groupingKeyNames=["payeeId", "paymentType"])]
    d = Driver(make_book(rules))
    d.run_batch([pay("a", T0 + 10_000, 5)], watermark_ms=0)
    before = dict(d.store)
    wm = T0 + 10_000
    res = d.run_batch([pay("late", wm - 1, 5), pay("edge", wm, 5, payee="p2")], watermark_ms=wm)
    late = [r for r in res.records() if r["kind"] == "late"]
    assert sorted((r["transaction_id"], r["keyset"], r["group_key"], r["event_ms"]) for r in late) == [
        ("late", "payeeId", "p1", wm - 1), ("late", "payeeId,paymentType", "p1|CSH", wm - 1)]  # fmt: skip
    assert all(str(wm) in r["detail"] and "watermark" in r["detail"] for r in late)
    # not evaluated: no alert or metric for the late event's keys; the on-time event (time == watermark) is evaluated
    assert sorted((r["transaction_id"], r["rule_id"]) for r in res.records() if r["kind"] == "alert") == [("edge", 1), ("edge", 2)]
    assert {r["group_key"] for r in res.records() if r["kind"] == "metric"} == {"p2", "p2|CSH"}
    # not stored
    for key in before:
        assert d.store[key] == before[key]
    assert "late" not in sum((decode_history(b)[0]["transactionId"].tolist() for b in d.store.values()), [])
    # a batch of late events only writes nothing
    res = d.run_batch([pay("late2", T0, 5)], watermark_ms=wm)
    assert res.writes == {} and [r["kind"] for r in res.records()] == ["late", "late"]


# ------------------------------------------------------------------------------------------------- 5. metrics


def test_window_metrics_per_rule_and_key():
    rules = [
        sum_rule(1, window="10s", aggregatorFunctionType="AVG", limit=1000),
        sum_rule(2, window="10s", aggregatorFunctionType="MIN", limit=1000),
        sum_rule(3, window="10s", aggregatorFunctionType="COUNT", limit=1000, filter={"paymentType": "CRD"}),
    ]
    batch1 = [pay("a", T0, 10), pay("b", T0 + 1000, None), pay("c", T0 + 2000, 40, ptype="CRD")]
    batch2 = [pay("d", T0 + 12_000, None, ptype="CRD"), pay("e", T0 + 11_000, None), pay("q", T0, None, payee="p2")]
    d = Driver(make_book(rules))
    m1 = engine_metrics(d.run_batch(batch1))
    # AVG: at a 10, at b 10, at c 25 -> last 25, peak 25; MIN: 10; COUNT over CRD only: c
    assert m1 == {
        (1, "p1"): (T0 + 2000, Decimal(25), Decimal(25), 3, T0 - 8000, T0 + 2000),
        (2, "p1"): (T0 + 2000, Decimal(10), Decimal(10), 3, T0 - 8000, T0 + 2000),
        (3, "p1"): (T0 + 2000, Decimal(1), Decimal(1), 1, T0 - 8000, T0 + 2000),
    }
    m2 = engine_metrics(d.run_batch(batch2))
    # e (11s): window [1s, 11s] = b, c, e -> AVG 40, MIN 40; d (12s): window [2s, 12s] = c, e, d -> 40, 40
    # p2 has only a null amount: AVG / MIN are null, the count is still reported
    assert m2 == {
        (1, "p1"): (T0 + 12_000, Decimal(40), Decimal(40), 3, T0 + 2000, T0 + 12_000),
        (2, "p1"): (T0 + 12_000, Decimal(40), Decimal(40), 3, T0 + 2000, T0 + 12_000),
        (3, "p1"): (T0 + 12_000, Decimal(2), Decimal(2), 2, T0 + 2000, T0 + 12_000),
        (1, "p2"): (T0, None, None, 1, T0 - 10_000, T0),
        (2, "p2"): (T0, None, None, 1, T0 - 10_000, T0),
    }
    windows = {r["ruleId"]: per_event_windows(batch1 + batch2, r) for r in rules}
    for (_, res), batch in zip(d.results, [batch1, batch2]):
        assert_same_metrics(res, batch, rules, windows)


def test_reported_values_capped_at_twenty():
    r = {"ruleId": 4, "groupingKeyNames": ["ip"], "aggregateFieldName": "userId", "aggregatorFunctionType": "UNIQUE_COUNT",
         "limitOperatorType": ">=", "limit": 21, "window": "1h"}  # fmt: skip
    events = [login(f"t{i:02d}", T0 + i, f"user{i:02d}") for i in range(25)]
    for d in both_ways(events, [r]):
        alerts = d.alerts()
        assert [a["transaction_id"] for a in alerts] == ["t20", "t21", "t22", "t23", "t24"]
        assert alerts[-1]["distinct_values"] == [f"user{i:02d}" for i in range(20)]
        assert alerts[-1]["aggregate_value"] == "25"
        assert_same_alerts(alerts, oracle(events, [r]))


def test_many_keys_with_a_very_long_window():
    """Enough keys x a long enough window send window_lo down its per-group fallback path."""
    rng = random.Random(7)
    events = [pay(f"t{i:02d}", T0 + rng.randint(0, 10**9), rng.randint(0, 50), payee=f"p{rng.randint(0, 7)}", userId=f"u{i % 5}")
              for i in range(48)]  # fmt: skip
    for agg, field in [("SUM", "paymentAmount"), ("MIN", "paymentAmount"), ("AVG", "paymentAmount"), ("UNIQUE_COUNT", "userId")]:
        r = sum_rule(1, window="999999999999999999ms", aggregatorFunctionType=agg, aggregateFieldName=field,
                     limitOperatorType=">=", limit=3)  # fmt: skip
        for cuts in ([], list(range(1, 48, 5))):
            assert_same_alerts(run_stream(events, [r], cuts, lateness=0).alerts(), oracle(events, [r]))


# ------------------------------------------------------------------------------------------------- engine regressions
# Minimal reproductions of engine defects found while writing this file (fixed since; kept as regression tests).


def test_unique_count_over_money_reports_decimal_values():
    """UNIQUE_COUNT(paymentAmount) must report the distinct amounts ("1.00"), not their minor units ("100")."""
    r = sum_rule(1, aggregatorFunctionType="UNIQUE_COUNT", limitOperatorType=">=", limit=2)
    events = [pay("a", T0, "1.00"), pay("b", T0 + 1, "2.50")]
    (a,) = run_stream(events, [r]).alerts()
    assert oracle(events, [r])[0]["values"] == ["1.00", "2.50"]
    assert a["distinct_values"] == ["1.00", "2.50"]


def test_filter_on_payment_amount():
    """A filter on the money field must match events with that amount (the engine compares cents with the text)."""
    r = sum_rule(1, aggregatorFunctionType="COUNT", limitOperatorType=">=", limit=1, filter={"paymentAmount": "1.00"})
    events = [pay("a", T0, "1.00"), pay("b", T0 + 1, "2.50")]
    assert [a["transaction_id"] for a in oracle(events, [r])] == ["a"]
    assert [a["transaction_id"] for a in run_stream(events, [r]).alerts()] == ["a"]


def test_longest_accepted_window_does_not_crash():
    """parse_rule accepts windows up to 2**63 - 1 ms; with one key, window_lo's overflow guard (group.max() * span)
    was 0 and the composite key overflowed int64 once window + the key's time span exceeded 2**63 - 1.
    (The engine now saturates such windows at 2**62 ms, so its window_start_ms is t - 2**62, not the oracle's t - W;
    no event can lie between the two, hence only ids and values are compared.)"""
    r = sum_rule(1, window="106751991167d")  # 9_223_372_036_828_800_000 ms, accepted by parse_rule
    events = [pay("a", T0, 1), pay("b", T0 + 8 * 3_600_000, 1)]  # 8 hours apart
    assert brief(run_stream(events, [r]).alerts()) == brief(oracle(events, [r])) == [("a", Decimal(1)), ("b", Decimal(2))]


def test_a_batch_spanning_hours_writes_only_the_keys_a_later_event_can_still_see():
    """A backfill batch: 24 keys, one an hour. With the next watermark known, keys whose window and
    lateness have passed are deleted, not written; alerts of the next batch are unchanged."""
    r = ref_rule(windowMinutes=60)
    backfill = [pay(f"b{h}", T0 + h * 60 * MIN, 15, payee=f"p{h}") for h in range(24)]
    newest, lateness = backfill[-1]["eventTime"], 30 * MIN
    late_enough = [pay("x1", newest, 6, payee="p23"), pay("x2", newest, 6, payee="p22"), pay("x3", newest, 6, payee="p0")]
    results = {}
    for floor in (0, newest - lateness):
        d = Driver(make_book([r]))
        first = d.run_batch(backfill, next_watermark_ms=floor)
        d.run_batch(late_enough, newest - lateness)
        results[floor] = (first, brief(d.alerts()))
    (full, alerts_full), (trimmed, alerts_trimmed) = results[0], results[newest - lateness]
    assert alerts_trimmed == alerts_full == [("x1", Decimal(21)), ("x2", Decimal(21))]
    # p21's event is 2 h before the newest: its 60 min window closed 30 min before the next watermark
    kept = sorted(k.split(KEY_SEPARATOR)[1] for k, v in trimmed.writes.items() if v is not None)
    assert kept == ["p22|CSH", "p23|CSH"]
    assert len([v for v in full.writes.values() if v is not None]) == 24


@settings(max_examples=200, deadline=None)
@given(
    units=st.lists(st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-1000, 1000)), max_size=30),
    data=st.data(),
)
def test_reported_values_are_printed_by_arrow_exactly_as_decimal_prints_them(units, data):
    """Arrow prints the window values; each must be ``str`` of the exact Decimal, null where null."""
    n = len(units)
    valid = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    nonnull = np.array(data.draw(st.lists(st.integers(1, 50), min_size=n, max_size=n)), dtype=np.int64)
    agg = WindowAggregates(np.array(units, dtype=np.int64), valid, nonnull, nonnull)
    idx = np.array(data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=n * 2 if n else 0)), dtype=np.int64)
    for aggregator in Aggregator:
        if aggregator is Aggregator.AVG and any(abs(u) > 2**62 for u in units):
            continue  # AVG keeps Decimal's division, unchanged
        for scale in (0, 2):
            want = [str(to_decimal(aggregator, agg, i, scale)) if valid[i] else None for i in idx.tolist()]
            assert decimal_texts(aggregator, agg, idx, scale).to_pylist() == want, (aggregator, scale)


@given(
    last=st.lists(st.integers(-(2**61), 2**62), min_size=1, max_size=20),
    spans=st.lists(st.sampled_from([0, 1, 3_600_000, 2**62 - 1, 2**62, 2**62 + 2**61, 2**63, 2**70]), min_size=20, max_size=20),
)
def test_key_expiry_saturates_without_overflow(last, spans):
    spans = spans[: len(last)]
    got = key_expiries(np.array(last, dtype=np.int64), spans).tolist()
    assert got == [min(t + s, MAX_SPAN_MS) for t, s in zip(last, spans)]
