"""Bad input through the real pipeline: every kind lands in quarantine (or late_events) with its reason.

One landing folder mixes every kind of bad line with good ones, next to an empty file and a file
cut off mid-line; a second run adds an event beyond the allowed lateness and a repeat of an id
accepted in the first run. Nothing may crash a query and every landed line must be accounted for.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone

import pytest
from pyspark.sql import functions as F

from conftest import FIXTURES, bronze_frame
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.layers.pipeline import Summary, run_all
from rulewatch.spark.runtime.env import FUTURE_TOLERANCE_ENV
from rulewatch.spark.layers.silver import OTHER_REASON, PAYMENT_TYPES_ENV, REASON_CODES, parse

T0 = 1793527200000  # 2026-11-01T10:00:00Z
MINUTE = 60_000


def _payment(txn: object, when: object, **changes) -> str:
    """A payment line; ``when`` is minutes after T0, or the raw eventTime (``...`` leaves a field out)."""
    event_time = T0 + when * MINUTE if type(when) is int else when
    record = {"transactionId": txn, "eventTime": event_time, "payeeId": "payee-X", "beneficiaryId": "ben-X",
              "paymentAmount": 100, "paymentType": "CSH", **changes}  # fmt: skip
    return json.dumps({k: v for k, v in record.items() if v is not ...})


# (line, the quarantine reason it must get); lines are in file order.
BAD: list[tuple[str, str]] = [
    ("{not json", "malformed JSON (not a JSON object on one line)"),
    ("   ", "blank line"),
    (_payment(..., 1), "missing transactionId"),
    (_payment("no-time", ...), "missing eventTime"),
    (_payment("txt-time", "tomorrow"), "unparsable eventTime 'tomorrow' (expected epoch milliseconds or an ISO-8601 date and time)"),
    (_payment("bool-time", True), "unparsable eventTime 'true' (expected epoch milliseconds or an ISO-8601 date and time)"),
    (_payment("obj-payee", 2, payeeId={"id": 1}), "payeeId must be text, got object"),
    (_payment("arr-user", 2, userId=["u1", "u2"]), "userId must be text, got array"),
    (_payment("bool-amount", 2, paymentAmount=True), "paymentAmount is not a number: 'true'"),
    (_payment("abc-amount", 2, paymentAmount="abc"), "paymentAmount is not a number: 'abc'"),
    (_payment("neg-amount", 2, paymentAmount=-5), "negative paymentAmount -5"),
    (_payment("huge-amount", 2, paymentAmount=5 * 10**12), "paymentAmount above 1,000,000,000,000: 5000000000000"),
    (_payment("cents-amount", 2, paymentAmount="1.005"), "paymentAmount has more than 2 decimal places: 1.005"),
    (_payment("btc", 2, paymentType="BTC"), "unknown paymentType 'BTC' (allowed: CRD, CSH)"),
    (_payment("far-future", "2099-01-01T00:00:00Z"),
     "eventTime '2099-01-01T00:00:00Z' is more than 5m after its ingest time"),
    ('{"transactionId": "torn", "eventTime": 17935', "malformed JSON (not a JSON object on one line)"),
]  # fmt: skip
# The stable reason code of each line of BAD, in order.
CODES = ["malformed_json", "blank_line", "missing_transaction_id", "missing_event_time", "unparsable_event_time",
         "unparsable_event_time", "wrong_type", "wrong_type", "amount_not_a_number", "amount_not_a_number",
         "amount_negative", "amount_too_large", "amount_too_precise", "unknown_payment_type", "event_time_in_future",
         "malformed_json"]  # fmt: skip
GOOD = [
    _payment("good-1", 0),
    _payment("good-2", 30, paymentAmount="250.50", paymentType="CRD"),
    _payment("good-extra", 60, deviceId="d-77", channel={"app": "ios"}),  # unknown fields: kept in bronze
    json.dumps({"transactionId": "login-1", "eventTime": T0 + 90 * MINUTE, "userId": "u-1", "ip": "203.0.113.9",
                "action": "login"}),  # no amount and no paymentType: valid
    _payment("good-1", 0),  # same id again in the same batch
    _payment("good-3", 120),
]  # fmt: skip


@dataclass
class BadRun:
    lakehouse: Lakehouse
    summary: Summary


@pytest.fixture(scope="module")
def bad_run(spark, tmp_path_factory) -> BadRun:
    root = tmp_path_factory.mktemp("bad-input")
    landing = root / "landing"
    landing.mkdir()
    mixed = [GOOD[0], *[line for line, _ in BAD[:-1]], *GOOD[1:]]
    (landing / "mixed.jsonl").write_text("\n".join(mixed) + "\n")
    (landing / "empty.jsonl").write_text("")
    (landing / "truncated.jsonl").write_text(_payment("good-4", 121) + "\n" + BAD[-1][0])  # cut off: no newline
    lakehouse = Lakehouse(str(root / "lakehouse"))
    rules = str(FIXTURES / "rules.json")
    run_all(spark, lakehouse, str(landing), rules, log=lambda _: None)
    # Next run: the watermark is now 11:01 (good-4's 12:01 minus 1h lateness), so 09:00 is too late to evaluate.
    (landing / "later.jsonl").write_text("\n".join([_payment("too-late", -60), _payment("good-2", 130)]) + "\n")
    _, summary = run_all(spark, lakehouse, str(landing), rules, log=lambda _: None)
    return BadRun(lakehouse, summary)


def test_the_summary_counts_quarantined_lines_by_reason_code(bad_run):
    assert bad_run.summary.quarantine_reasons == dict(Counter(CODES))
    reasons_of: dict[str, set[str]] = {}
    for code, (_, reason) in zip(CODES, BAD):
        reasons_of.setdefault(code, set()).add(reason)
    assert all(bad_run.summary.quarantine_examples[code] in reasons for code, reasons in reasons_of.items())
    assert "  2 x malformed_json  (e.g. malformed JSON (not a JSON object on one line))" in bad_run.summary.lines()


def test_every_quarantined_line_carries_a_stable_reason_code(spark, bad_run):
    assert len(CODES) == len(BAD)
    rows = spark.read.format("delta").load(bad_run.lakehouse.silver_quarantine).collect()
    by_reason = {r.reason: r.reason_code for r in rows}
    assert [by_reason[reason] for _, reason in BAD] == CODES
    assert {code for _, code in REASON_CODES} >= set(CODES) and OTHER_REASON not in by_reason.values()


def test_every_landed_line_is_accounted_for(bad_run):
    s = bad_run.summary
    landed = len(BAD) + len(GOOD) + 1 + 2  # + good-4 in the truncated file + the later file
    assert (s.bronze, s.quarantined, s.duplicates) == (landed, len(BAD), 2)
    assert s.silver == 7  # good-1..4, good-extra, login-1, too-late
    assert s.balanced


def test_duplicates_within_and_across_batches_keep_the_first(spark, bad_run):
    duplicates = spark.read.format("delta").load(bad_run.lakehouse.silver_duplicates)
    assert sorted(r.transaction_id for r in duplicates.collect()) == ["good-1", "good-2"]
    silver = spark.read.format("delta").load(bad_run.lakehouse.silver_transactions)
    first = silver.where("transaction_id = 'good-2'").first()
    assert (first.payment_type, str(first.payment_amount)) == ("CRD", "250.50")


def test_an_event_beyond_the_allowed_lateness_is_recorded_not_evaluated(spark, bad_run):
    late = spark.read.format("delta").load(bad_run.lakehouse.late_events).collect()
    assert {r.transaction_id for r in late} == {"too-late"}
    assert all("watermark" in r.reason for r in late)
    alerts = spark.read.format("delta").load(bad_run.lakehouse.alerts)
    assert alerts.where("transaction_id = 'too-late'").count() == 0


def test_unknown_fields_are_kept_in_bronze_and_ignored_by_silver(spark, bad_run):
    bronze = spark.read.format("delta").load(bad_run.lakehouse.bronze_transactions)
    (raw,) = bronze.where(F.col("value").contains('"good-extra"')).collect()
    assert json.loads(raw.value)["deviceId"] == "d-77"
    silver = spark.read.format("delta").load(bad_run.lakehouse.silver_transactions)
    assert silver.where("transaction_id = 'good-extra'").count() == 1
    assert "deviceId" not in silver.columns and "device_id" not in silver.columns


def test_the_payment_types_are_data(spark, monkeypatch):
    line = _payment("wire-1", 0, paymentType="WIRE")
    bronze = bronze_frame(spark, [line])
    assert parse(bronze).first().reasons == ["unknown paymentType 'WIRE' (allowed: CRD, CSH)"]
    monkeypatch.setenv(PAYMENT_TYPES_ENV, "CSH, CRD, WIRE")
    assert parse(bronze).first().reasons == []


def test_the_future_tolerance_applies_to_the_next_parse(spark, monkeypatch):
    # parse reuses its columns between calls (built once per setting): a changed setting must still count.
    ingested = datetime.fromtimestamp(T0 / 1000, timezone.utc)
    bronze = bronze_frame(spark, [_payment("ahead", 10)], ingest_time=ingested)
    assert parse(bronze).first().reasons == [f"eventTime '{T0 + 10 * MINUTE}' is more than 5m after its ingest time"]
    monkeypatch.setenv(FUTURE_TOLERANCE_ENV, "15m")
    assert parse(bronze).first().reasons == []
    monkeypatch.setenv(FUTURE_TOLERANCE_ENV, "1m")
    assert parse(bronze).first().reasons == [f"eventTime '{T0 + 10 * MINUTE}' is more than 1m after its ingest time"]


def test_an_empty_landing_folder_runs_with_zero_rows(spark, tmp_path):
    (tmp_path / "landing").mkdir()
    _, summary = run_all(spark, Lakehouse(str(tmp_path / "lakehouse")), str(tmp_path / "landing"), log=lambda _: None)
    assert (summary.bronze, summary.silver, summary.quarantined, summary.alerts) == (0, 0, 0, 0)
    assert summary.balanced


def test_bronze_lines_are_untouched(spark, bad_run):
    bronze = {r.value for r in spark.read.format("delta").load(bad_run.lakehouse.bronze_transactions).collect()}
    assert {line for line, _ in BAD} <= bronze
