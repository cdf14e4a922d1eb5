"""The micro-batch engine (rulewatch.engine / rulewatch.windows) agrees with the brute-force oracle.

The driver below mirrors what the Spark wrapper does around ``evaluate_batch``: key every event once per keyset of
the rule book, cut the time-ordered stream into micro-batches (rows shuffled inside a batch: the engine must sort
itself), keep a dict as the state store (state key -> blob, ``None`` write = delete) and, for the watermark variant,
emulate the event-time cleanup timers with ``BatchResult.expiry_ms`` (a key is dropped once the watermark has passed
its expiry).
"""

from __future__ import annotations

import random
import sys
from collections import defaultdict
from decimal import Decimal
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle import oracle  # noqa: E402

from rulewatch.engine import (  # noqa: E402
    KEY_SEPARATOR,
    MAX_REPORTED_VALUES,
    RuleBook,
    decode_history,
    evaluate_batch,
    state_key,
)

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

    def fire_timers(self, watermark_ms: int) -> list[str]:
        """Event-time timers: a key whose expiry the watermark has passed is dropped."""
        fired = [k for k, t in self.timers.items() if watermark_ms > t]
        for k in fired:
            self.store.pop(k, None)
            del self.timers[k]
        return fired

    def run_batch(self, events: list[dict], watermark_ms: int = 0, shuffle: bool = True):
        rows = key_rows(events, self.book)
        if shuffle:
            self.rng.shuffle(rows)
        if watermark_ms > 0:
            self.fire_timers(watermark_ms)
        result = evaluate_batch(frame(rows), self.book, self.store.get, watermark_ms)
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
        return [r for _, res in self.results for r in res.rows if r["kind"] == kind]

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
        result = d.run_batch(batch, wm)
        if on_batch is not None:
            on_batch(d, ordered[:hi], batch, wm, result)
        if batch:
            top = max(int(e["eventTime"]) for e in batch)
            newest = top if newest is None else max(newest, top)
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

from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

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
        return st.one_of(st.integers(0, 6), st.sampled_from(["2.5", "3.0", 1.5, "-1"]))
    return st.one_of(
        st.sampled_from([0, 5, 10, 20, "19.99", "20.00", "10.5", 2.5, "0.01", "7.333333", "12.3456", "-1"]),
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
        # UNIQUE_COUNT over the money field is covered by test_unique_count_over_money_reports_decimal_values
        field = draw(st.sampled_from(["userId", "ip", "action", "payeeId", "transactionId"]))
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
        # filters on string fields (a filter on the money field is covered by test_filter_on_payment_amount)
        fields = draw(st.lists(st.sampled_from(["action", "paymentType", "ip", "userId"]), min_size=1, max_size=2, unique=True))
        r["filter"] = {f: draw(st.sampled_from(ALPHABET[f][:-1])) for f in fields}
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
    for m in result.rows:
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
    from oracle import parse_duration_ms

    ret = mem = 0
    for r in rules:
        if ",".join(r["groupingKeyNames"]) != keyset:
            continue
        w = parse_duration_ms(r["window"]) if "window" in r else r["windowMinutes"] * MIN
        b = parse_duration_ms(r["bucket"]) if r.get("bucket") else 0
        c = parse_duration_ms(r["cooldown"]) if r.get("cooldown") else 0
        ret, mem = max(ret, w + b), max(mem, w, c)
    return ret, mem


def check_state(rules):
    """on_batch hook: a written key holds exactly its events inside the retention, never an empty blob."""

    def hook(d: Driver, so_far, batch, wm, result):
        assert not any(r["kind"] == "late" for r in result.rows), "in-order stream produced late rows"
        for key, blob in result.writes.items():
            keyset, group_key = key.split(KEY_SEPARATOR, 1)
            retention, memory_span = _span(rules, keyset)
            mine = [e for e in key_rows(so_far, d.book) if e["keyset"] == keyset and e["group_key"] == group_key]
            horizon = wm - retention if wm > 0 else -(2**63)
            want = sorted((e["eventTime"], e["transactionId"]) for e in mine if e["eventTime"] >= horizon)
            if blob is None:
                assert not want, (key, want)
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
