"""Arrival order through the real pipeline: window(e) is over the events that had *arrived* when e was evaluated.

One key (payee-A), one rule: SUM(paymentAmount) per payeeId over 60 min, GREATER 20 (the brief's worked
example). Three `run_all`s over one landing folder, one new file each, so each is one gold micro-batch:

  run 1  x2 08:40 6, x1 08:30 15, e2 10:10 8, e0 10:00 10   (file order; all arrive together)
         x1 -> 15; x2 -> 15 + 6 = 21 ALERT (it sees x1, which is later in the file: in-batch order is
         (time, id), not file order); e0 -> 10; e2 -> e0 + e2 = 18, no alert.
         Watermark afterwards: 10:10 - 1 h allowed lateness = 09:10.
  run 2  e1 10:05 11: older than e2 but within the lateness, so it is evaluated over what has arrived
         and is not after it: e0 + e1 = 21 ALERT (count 2; e2, already arrived, is later in time).
         e2's window now holds e0 + e1 + e2 = 29 > 20, but e2 was evaluated in run 1 and is not
         evaluated again; x2's alert is not retracted.
  run 3  e3 10:15 1: sees e0, e1, e2 and itself: 30 ALERT (count 4), so e1 was kept in state.

Why this fails if the engine re-evaluated or retracted: re-evaluating e2 when e1 arrives would add an
alert (e2, 29, 3) to run 2 (the batch oracle over all four events has exactly that alert); retracting or
rewriting would change or remove run 1's x2 row (compared whole, decision time included) or add a
non-append commit to gold/alerts. If e1 saw e2 (arrival order instead of (time, id)) its alert would be
(e1, 29, 3); if e1 were dropped as late it would have no alert and e3 none either (10 + 8 + 1 = 19).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from decimal import Decimal

import pytest

from oracle import oracle
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.layers.pipeline import run_all

RULE = {
    "ruleId": 1,
    "ruleState": "ACTIVE",
    "description": "More than 20 paid by one payee within 60 minutes",
    "groupingKeyNames": ["payeeId"],
    "aggregateFieldName": "paymentAmount",
    "aggregatorFunctionType": "SUM",
    "limitOperatorType": "GREATER",
    "limit": 20,
    "windowMinutes": 60,
}


def _pay(txn: str, hhmm: str, amount: int) -> dict:
    return {"transactionId": txn, "eventTime": f"2026-11-01T{hhmm}:00Z", "payeeId": "payee-A",
            "beneficiaryId": "ben-1", "paymentAmount": amount, "paymentType": "CSH"}  # fmt: skip


# One landing file per run, lines in file order.
ARRIVALS = [
    [_pay("x2", "08:40", 6), _pay("x1", "08:30", 15), _pay("e2", "10:10", 8), _pay("e0", "10:00", 10)],
    [_pay("e1", "10:05", 11)],
    [_pay("e3", "10:15", 1)],
]

# (transaction_id, aggregate_value, event_count) of the alerts each run adds, computed by hand above.
NEW_ALERTS = [
    [("x2", Decimal("21"), 2)],
    [("e1", Decimal("21"), 2)],
    [("e3", Decimal("30"), 4)],
]


def _brief(rows) -> list[tuple]:
    return sorted((r["transaction_id"], Decimal(r["aggregate_value"]), r["event_count"]) for r in rows)


@pytest.fixture(scope="module")
def runs(spark, tmp_path_factory) -> tuple[Lakehouse, list[list[dict]]]:
    """The three runs; returns the lakehouse and the whole gold/alerts table after each run."""
    root = tmp_path_factory.mktemp("arrival-order")
    landing = root / "landing"
    landing.mkdir()
    rules = root / "rules.json"
    rules.write_text(json.dumps([RULE]))
    lakehouse = Lakehouse(str(root / "lakehouse"))
    snapshots = []
    for n, lines in enumerate(ARRIVALS, 1):
        (landing / f"arrival-{n}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        run_all(spark, lakehouse, str(landing), str(rules) if n == 1 else None, log=lambda _: None)
        table = spark.read.format("delta").load(lakehouse.alerts).collect()
        snapshots.append(sorted((r.asDict() for r in table), key=lambda r: r["transaction_id"]))
    return lakehouse, snapshots


def test_each_run_adds_exactly_the_alerts_of_the_events_that_arrived_in_it(runs):
    _, snapshots = runs
    seen: set[str] = set()
    for n, (table, expected) in enumerate(zip(snapshots, NEW_ALERTS), 1):
        new = [r for r in table if r["transaction_id"] not in seen]
        assert _brief(new) == expected, f"run {n}"
        seen |= {r["transaction_id"] for r in table}
    # e2 never alerts, although after run 2 its window (e0 + e1 + e2 = 29) breaks the limit.
    assert _brief(snapshots[-1]) == [("e1", Decimal("21"), 2), ("e3", Decimal("30"), 4), ("x2", Decimal("21"), 2)]


def test_alerts_already_emitted_are_never_changed_or_retracted(spark, runs):
    lakehouse, snapshots = runs
    for earlier, later in zip(snapshots, snapshots[1:]):
        assert [r for r in later if r in earlier] == earlier  # whole rows: ids, values, decision times
    # gold/alerts only ever receives appends: no DELETE, UPDATE or MERGE commit.
    operations = {r.operation for r in spark.sql(f"DESCRIBE HISTORY delta.`{lakehouse.alerts}`").collect()}
    assert operations <= {"CREATE TABLE", "WRITE"}, operations


def test_the_older_event_was_within_the_lateness_and_evaluated(spark, runs):
    lakehouse, snapshots = runs
    assert spark.read.format("delta").load(lakehouse.late_events).count() == 0
    e1, e3 = ({r["transaction_id"]: r for r in snapshots[-1]}[t] for t in ("e1", "e3"))
    # Its window ends at e1 itself (10:05, ten minutes before e3), not at the newest event that had arrived
    # (e2, 10:10): [09:05, 10:05].
    assert e1["window_end"] == e1["event_time"] == e3["event_time"] - timedelta(minutes=10)
    assert e1["window_end"] - e1["window_start"] == timedelta(minutes=60)


def _oracle_events(lines: list[dict]) -> list[dict]:
    return [
        {**line, "eventTime": int(datetime.fromisoformat(line["eventTime"].replace("Z", "+00:00")).timestamp() * 1000),
         "paymentAmount": Decimal(line["paymentAmount"])}
        for line in lines
    ]  # fmt: skip


def test_matches_the_oracle_over_what_had_arrived_not_over_everything(runs):
    """The oracle is a batch evaluation (every event over all events). Run once per arrival over the events
    arrived so far, its alerts for that arrival's events are what gold emitted; run over everything, it also
    has (e2, 29, 3): the alert the engine, by design, never raises."""
    _, snapshots = runs
    arrived: list[dict] = []
    seen: set[str] = set()
    for table, lines in zip(snapshots, ARRIVALS):
        arrived += _oracle_events(lines)
        ids = {line["transactionId"] for line in lines}
        assert _brief(a for a in oracle(arrived, [RULE]) if a["transaction_id"] in ids) == _brief(
            r for r in table if r["transaction_id"] not in seen
        )
        seen |= ids
    everything = _brief(oracle(arrived, [RULE]))
    assert ("e2", Decimal("29"), 3) in everything
    assert [a for a in everything if a[0] != "e2"] == _brief(snapshots[-1])
