"""Silver validation: every kind of bad line gets a precise reason; good lines are typed exactly."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.present.views import register_views
from conftest import bronze_frame
from rulewatch.spark.layers import silver
from rulewatch.spark.layers.silver import DEDUP_HORIZON_ENV, MAX_LINE_BYTES, ensure_silver_tables, parse, write_classified
from rulewatch.spark.storage import schema, tables

GOOD = {"transactionId": "t1", "eventTime": 1793527200000, "payeeId": "p", "beneficiaryId": "b",
        "paymentAmount": 12.5, "paymentType": "CSH"}  # fmt: skip


def _parse(spark, lines: list[str]):
    bronze = bronze_frame(spark, lines)
    return sorted(parse(bronze).collect(), key=lambda r: r.ingest_seq)


def _line(**changes) -> str:
    record = {**GOOD, **changes}
    return json.dumps({k: v for k, v in record.items() if v is not ...})


def _number_amount(digits: str) -> str:
    """A good line whose paymentAmount is the JSON number written exactly as ``digits``."""
    return _line().replace('"paymentAmount": 12.5', f'"paymentAmount": {digits}')


@pytest.mark.parametrize(
    ("line", "reasons"),
    [
        ("{not json", ["malformed JSON (not a JSON object on one line)"]),
        ("[1, 2]", ["malformed JSON (not a JSON object on one line)"]),
        ("   ", ["blank line"]),
        (_line(transactionId=...), ["missing transactionId"]),
        (_line(transactionId="  "), ["missing transactionId"]),
        (_line(eventTime=...), ["missing eventTime"]),
        (_line(eventTime="tomorrow"), ["unparsable eventTime 'tomorrow' (expected epoch milliseconds or an ISO-8601 date and time)"]),
        (_line(paymentAmount="abc"), ["paymentAmount is not a number: 'abc'"]),
        (_line(paymentAmount=-1), ["negative paymentAmount -1"]),
        (_line(paymentAmount=10**13), ["paymentAmount above 1,000,000,000,000: 10000000000000"]),
        (_line(paymentAmount="1.005"), ["paymentAmount has more than 2 decimal places: 1.005"]),
        # Strict JSON: Spark's reader would take the first object, the single quotes or the last of two keys.
        (_line() + '{"transactionId": "t9"}', ["trailing content after the JSON object (one object per line)"]),
        (_line() + " junk", ["trailing content after the JSON object (one object per line)"]),
        (_line() + "}", ["trailing content after the JSON object (one object per line)"]),
        (_line() + ' "}"', ["trailing content after the JSON object (one object per line)"]),
        (_line().replace('"', "'"), ["malformed JSON (not a JSON object on one line)"]),
        (_line()[:-1] + ', "paymentAmount": 5000}', ["duplicate key in the JSON object (each field may appear once)"]),
        ('{"transactionId": "t1", "eventTime": NaN}', ["malformed JSON (not a JSON object on one line)"]),
        (_line(payeeId='x"}{"y'), []),  # braces and escaped quotes inside a string are data
        # A key that is there but blank (after the identity rule's trim) would group unrelated events.
        (_line(payeeId="  "), ["blank payeeId (send a value, or leave the field out)"]),
        (_line(beneficiaryId="\u00a0\u200b\ufeff"), ["blank beneficiaryId (send a value, or leave the field out)"]),
        (_line(paymentType=""), ["blank paymentType (send a value, or leave the field out)"]),
        (_line(paymentType=" CSH\t"), []),
        # Time: no silent 1970 or today.
        (_line(eventTime=1793527200), ["eventTime '1793527200' is before 2000-01-01T00:00:00Z (epoch seconds? send milliseconds)"]),
        (_line(eventTime="10:00:00"), ["unparsable eventTime '10:00:00' (expected epoch milliseconds or an ISO-8601 date and time)"]),
        (_line(eventTime="2026-11-01"), ["unparsable eventTime '2026-11-01' (expected epoch milliseconds or an ISO-8601 date and time)"]),
        (_line(eventTime="1999-12-31T23:59:59Z"), ["eventTime '1999-12-31T23:59:59Z' is before 2000-01-01T00:00:00Z"]),
        # Money: the digits as sent, at any length.
        # (Spark's JSON reader hands the number 10.000000000000000000001 over as "10.0".)
        (_number_amount("10.000000000000000000001"), ["paymentAmount has more than 2 decimal places: 10.000000000000000000001"]),
        (_line(paymentAmount="10.000000000001"), ["paymentAmount has more than 2 decimal places: 10.000000000001"]),
        (_number_amount("1e3"), ["paymentAmount must be a plain decimal number (no exponent, at most 38 digits): '1e3'"]),
        (_line(paymentAmount="1e3"), ["paymentAmount must be a plain decimal number (no exponent, at most 38 digits): '1e3'"]),
        (_line(paymentAmount="10.500"), []),
        (
            _line(transactionId=..., eventTime="x", paymentAmount=True),
            ["missing transactionId", "unparsable eventTime 'x' (expected epoch milliseconds or an ISO-8601 date and time)",
             "paymentAmount is not a number: 'true'"],
        ),
    ],
)  # fmt: skip
def test_bad_lines_get_every_reason(spark, line, reasons):
    (row,) = _parse(spark, [line])
    assert row.reasons == reasons


def test_a_line_over_the_size_limit_gets_that_reason_not_malformed_json(spark):
    padded = _line(payeeId="x" * MAX_LINE_BYTES)
    (row,) = _parse(spark, [padded])
    assert row.reasons == [f"line too long: {len(padded):,} bytes (at most {MAX_LINE_BYTES:,}; one transaction per line)"]


def test_good_lines_are_typed_exactly(spark):
    rows = _parse(spark, [
        _line(),
        _line(transactionId="t2", eventTime="2026-11-01T10:00:05Z", paymentAmount="0.10"),
        _line(transactionId="t3", eventTime="1793527200000", paymentAmount=...),
        json.dumps({"transactionId": "l1", "eventTime": "2026-11-01T10:00:05+01:00", "userId": "u", "ip": "1.2.3.4",
                    "action": "login"}),
    ])  # fmt: skip
    assert [r.reasons for r in rows] == [[], [], [], []]
    assert rows[0].payment_amount == Decimal("12.50")
    assert rows[0].event_time == datetime(2026, 11, 1, 10, 0, tzinfo=timezone.utc).replace(tzinfo=None)
    assert rows[1].payment_amount == Decimal("0.10")
    assert rows[1].event_time == datetime(2026, 11, 1, 10, 0, 5)
    assert rows[2].payment_amount is None and rows[2].event_time == rows[0].event_time
    assert rows[3].event_time == datetime(2026, 11, 1, 9, 0, 5)
    assert (rows[3].user_id, rows[3].ip, rows[3].action) == ("u", "1.2.3.4", "login")



def test_numbers_in_text_fields_are_read_as_their_value(spark):
    # Fields come from the variant parse: a number's value, not a double's rendering of it.
    rows = _parse(spark, [_line(transactionId=123), _line(transactionId=1000.0), _line(eventTime=1793527200000.0),
                          _line(transactionId=12345678901234567890123), _line().replace("1793527200000", "1.7935272e12")])  # fmt: skip
    assert [r.reasons for r in rows[:4]] == [[], [], [], []]
    assert [r.transaction_id for r in rows[:4]] == ["123", "1000", "t1", "12345678901234567890123"]
    assert rows[2].event_time == datetime(2026, 11, 1, 10, 0)
    # An exponent is no epoch: the time is refused, not rounded.
    assert rows[4].reasons == ["unparsable eventTime '1.7935272E12' (expected epoch milliseconds or an ISO-8601 date and time)"]


def _classify(spark, lakehouse, batch_id: int, lines: list[str]) -> dict[str, Any]:
    now = datetime(2026, 11, 1, 12, tzinfo=timezone.utc)
    bronze = bronze_frame(spark, lines, f"b{batch_id}.jsonl", now)
    return write_classified(bronze, batch_id, lakehouse)


@pytest.mark.parametrize(("horizon", "far_repeat"), [(None, "accepted"), ("3d", "duplicate")])
def test_a_repeated_id_is_a_duplicate_within_the_dedup_horizon(spark, tmp_path, monkeypatch, horizon, far_repeat):
    if horizon:
        monkeypatch.setenv(DEDUP_HORIZON_ENV, horizon)
    lakehouse = Lakehouse(str(tmp_path))
    ensure_silver_tables(spark, lakehouse)
    day = 86_400_000
    _classify(spark, lakehouse, 0, [_line(transactionId="t1"), _line(transactionId="t2")])
    counts = _classify(spark, lakehouse, 1, [
        _line(transactionId="t1"),  # a redelivery: same event time
        _line(transactionId="t2", eventTime=GOOD["eventTime"] - 2 * day),  # same id, two days earlier
        _line(transactionId="t3"), _line(transactionId="t3"),  # twice in one batch: the first wins
    ])  # fmt: skip
    duplicates = sorted(r.transaction_id for r in spark.read.format("delta").load(lakehouse.silver_duplicates).collect())
    expected = ["t1", "t3"] + (["t2"] if far_repeat == "duplicate" else [])
    assert duplicates == sorted(expected)
    steps = counts.pop("step_ms")
    assert counts == {"rows_in": 4, "rows_out": 4 - len(expected), "quarantined": 0, "duplicates": len(expected),
                      "rows_written": {"silver/transactions": 4 - len(expected), "silver/quarantine": 0,
                                       "silver/duplicates": len(expected)}}  # fmt: skip
    assert set(steps) == {"parse", "dedup", "transactions", "quarantine", "duplicates"}


def _duplicates(spark, lakehouse) -> list[str]:
    return sorted(r.transaction_id for r in spark.read.format("delta").load(lakehouse.silver_duplicates).collect())


def test_the_duplicate_lookup_reads_the_files_whose_times_can_match_and_finds_what_delta_finds(spark, tmp_path, monkeypatch):
    """Silver's earlier rows are read from the files its log names, skipping those whose event-time
    statistics are beyond the horizon; the rows found are those Delta's own read finds."""
    lakehouse = Lakehouse(str(tmp_path))
    ensure_silver_tables(spark, lakehouse)
    table = lakehouse.silver_transactions

    def batches(low_ms: int, high_ms: int) -> set[int]:  # the batches whose files are read
        near = tables.read_near(spark, table, schema.SILVER, "event_time", low_ms, high_ms)
        return set() if near is None else {r.silver_batch_id for r in near.select("silver_batch_id").distinct().collect()}

    assert batches(0, 2**62) == set()  # a first batch has nothing to look up
    day, t = 86_400_000, GOOD["eventTime"]
    _classify(spark, lakehouse, 0, [_line(transactionId="t1"), _line(transactionId="t4", eventTime=t + 1)])
    _classify(spark, lakehouse, 1, [_line(transactionId="t2", eventTime=t - 3 * day)])
    _classify(spark, lakehouse, 2, [_line(transactionId="t3", eventTime=t + 5)])
    assert (batches(t - day, t + day), batches(t + 3, t + 4), batches(t + 5, t + 5), batches(t - 3 * day, t - 3 * day)) == ({0, 2}, set(), {2}, {1})

    stamp = datetime.fromtimestamp(t / 1000, timezone.utc).replace(tzinfo=None)
    ids = spark.createDataFrame([(i,) for i in ("t1", "t2", "t3", "t4")], "transaction_id string")

    def found() -> list:
        earlier = silver._earlier_times(spark, lakehouse, 3, ids, (stamp, stamp, t, t), day)
        return sorted((r.transaction_id, [tuple(s) for s in r._seen]) for r in earlier.collect())

    from_files = found()
    monkeypatch.setattr(tables, "live_files", lambda table: None)  # as for a table whose log is not read here
    assert from_files == found() and [i for i, _ in from_files] == ["t1", "t3", "t4"]


def test_a_silver_table_with_deletion_vectors_is_looked_up_through_delta(spark, tmp_path):
    """Its files still hold deleted rows: read as plain Parquet, a deleted payment would make its id's
    next line a duplicate."""
    lakehouse = Lakehouse(str(tmp_path))
    ensure_silver_tables(spark, lakehouse)
    spark.sql(f"ALTER TABLE delta.`{lakehouse.silver_transactions}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
    _classify(spark, lakehouse, 0, [_line(transactionId="kept"), _line(transactionId="erased")])
    spark.sql(f"OPTIMIZE delta.`{lakehouse.silver_transactions}`")  # both rows in one file: the delete marks one
    spark.sql(f"DELETE FROM delta.`{lakehouse.silver_transactions}` WHERE transaction_id = 'erased'")
    log = Path(lakehouse.silver_transactions, "_delta_log")
    assert any('"deletionVector":{' in commit.read_text() for commit in log.glob("*.json"))
    read = tables.read_near(spark, lakehouse.silver_transactions, schema.SILVER, "event_time")
    assert [r.transaction_id for r in read.collect()] == ["kept"]
    _classify(spark, lakehouse, 1, [_line(transactionId="kept"), _line(transactionId="erased")])
    assert _duplicates(spark, lakehouse) == ["kept"]
    accepted = spark.read.format("delta").load(lakehouse.silver_transactions).collect()
    assert sorted((r.transaction_id, r.silver_batch_id) for r in accepted) == [("erased", 1), ("kept", 0)]


def test_ids_and_keys_follow_one_identity_rule_trimmed_then_nfc(spark, tmp_path):
    """Surrounding white space and the Unicode form never make two ids or keys differ; inner text does."""
    lakehouse = Lakehouse(str(tmp_path))
    ensure_silver_tables(spark, lakehouse)
    nfc, nfd = "caf\u00e9", "cafe\u0301"
    _classify(spark, lakehouse, 0, [
        _line(transactionId="g", payeeId=nfc),
        _line(transactionId="g ", payeeId=nfc),  # the same payment redelivered with a trailing space
        _line(transactionId="h", payeeId=nfd),
        _line(transactionId="i", payeeId=f"\u3000{nfc} "),
        _line(transactionId="j", payeeId="caf e"),  # inner space: another payee
        _line(transactionId=nfd, payeeId="p"),
    ])  # fmt: skip
    silver = {r.transaction_id: r.payee_id for r in spark.read.format("delta").load(lakehouse.silver_transactions).collect()}
    assert silver == {"g": nfc, "h": nfc, "i": nfc, "j": "caf e", nfc: "p"}
    duplicates = spark.read.format("delta").load(lakehouse.silver_duplicates).collect()
    assert [(d.transaction_id, d.conflict) for d in duplicates] == [("g", False)]


def test_a_reused_id_with_other_content_is_recorded_as_a_conflict(spark, tmp_path):
    lakehouse = Lakehouse(str(tmp_path))
    ensure_silver_tables(spark, lakehouse)
    _classify(spark, lakehouse, 0, [_line(transactionId="t1", paymentAmount=10)])
    _classify(spark, lakehouse, 1, [
        _line(transactionId="t1", paymentAmount=10),  # a redelivery
        _line(transactionId="t1", paymentAmount=9999),  # the id reused for another payment
        _line(transactionId="t2", paymentAmount=1), _line(transactionId="t2", payeeId="other"),  # within one batch
        _line(transactionId="t3"), _line(transactionId="t3"),
    ])  # fmt: skip
    duplicates = spark.read.format("delta").load(lakehouse.silver_duplicates).orderBy("transaction_id", "value").collect()
    assert [(d.transaction_id, d.conflict) for d in duplicates] == [("t1", False), ("t1", True), ("t2", True), ("t3", False)]
    assert "9999" in duplicates[1].value and '"other"' in duplicates[2].value
    accepted = {r.transaction_id: r.payment_amount for r in spark.read.format("delta").load(lakehouse.silver_transactions).collect()}
    assert accepted == {"t1": Decimal("10.00"), "t2": Decimal("1.00"), "t3": Decimal("12.50")}  # first wins
    register_views(spark, lakehouse, viewer_in_pii_group=False)  # the dashboard's view of them
    assert [r.transaction_id for r in spark.sql("SELECT * FROM id_conflicts ORDER BY transaction_id").collect()] == ["t1", "t2"]
