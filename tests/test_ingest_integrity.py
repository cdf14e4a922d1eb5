"""Ingest integrity through the real pipeline: no landed line lost or misread, no event can blind detection.

Each case here ran "ok" before and lost or distorted data: a future-dated event pushed the watermark
a day ahead, files in subfolders were skipped (or failed the read), a file appended to after it was
read and a file gone before it was read were silently short, and invalid UTF-8 merged different keys.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pyspark.sql import Observation
from pyspark.sql import functions as F

from conftest import bronze_frame
from rulewatch.spark.layers import bronze
from rulewatch.spark.layers.gold import GoldSettings
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.storage.metrics import Recorder
from rulewatch.spark.layers.landing import FILES_READ, LandingError, audit, check_landing, local_path, scan, unread
from rulewatch.spark.layers.pipeline import ensure_all_tables, run_all

RULE = {"ruleId": 1, "ruleState": "ACTIVE", "groupingKeyNames": ["payeeId"], "aggregateFieldName": "paymentAmount",
        "aggregatorFunctionType": "SUM", "limitOperatorType": "GREATER", "limit": 20, "windowMinutes": 60}  # fmt: skip
T0 = datetime(2026, 11, 1, 10, tzinfo=timezone.utc)


def _payment(txn: str, when: datetime, payee: str = "payee-A", amount: object = 15) -> str:
    return json.dumps({"transactionId": txn, "eventTime": int(when.timestamp() * 1000), "payeeId": payee,
                       "beneficiaryId": "ben-1", "paymentAmount": amount, "paymentType": "CSH"})  # fmt: skip


def _run(spark, lakehouse: Lakehouse, landing: Path, rules: Path):
    _, summary = run_all(spark, lakehouse, str(landing), str(rules), log=lambda _: None)
    return summary


def _alerts(spark, lakehouse: Lakehouse) -> set[str]:
    return {r.transaction_id for r in spark.read.format("delta").load(lakehouse.alerts).collect()}


@pytest.fixture
def rules(tmp_path) -> Path:
    path = tmp_path / "rules.json"
    path.write_text(json.dumps([RULE]))
    return path


def test_future_dated_events_cannot_make_on_time_payments_late(spark, tmp_path, rules):
    """One event and a small group 23 h ahead (a file each), then on-time payments that break the rule: they must alert."""
    landing, lakehouse = tmp_path / "landing", Lakehouse(str(tmp_path / "lakehouse"))
    landing.mkdir()
    ahead = datetime.now(timezone.utc) + timedelta(hours=23)
    for future in (1, 3):
        lines = [_payment(f"future-{future}-{i}", ahead, f"payee-F{future}-{i}") for i in range(future)]
        (landing / f"poison-{future}.jsonl").write_text("\n".join(lines) + "\n")
    first = _run(spark, lakehouse, landing, rules)
    assert first.quarantined == 4 and first.silver == 0
    assert first.quarantine_reasons == {"event_time_in_future": 4}
    assert "is more than 5m after its ingest time" in first.quarantine_examples["event_time_in_future"]
    now = datetime.now(timezone.utc)
    (landing / "on-time.jsonl").write_text(_payment("on-time-1", now) + "\n" + _payment("on-time-2", now + timedelta(seconds=1)) + "\n")
    second = _run(spark, lakehouse, landing, rules)
    assert second.late == 0
    assert _alerts(spark, lakehouse) == {"on-time-2"}  # 15 + 15 > 20


def test_the_lateness_may_not_be_below_the_future_tolerance():
    with pytest.raises(ValueError, match="below silver's future tolerance 5m"):
        GoldSettings(allowed_lateness="1m")
    GoldSettings(allowed_lateness="5m")


COLON = "export_2026-12-04T13:33:00.jsonl"
ODD = "odd:dir/a b%20+#?[x]{y};&=,'é\tz\nline.jsonl"
PLANTED = ("loop", "host.jsonl", "twice.jsonl", "dangling.jsonl", "pipe.jsonl")


def _plant_links(root: Path, landing: Path) -> None:
    """What a careless operator or an attacker leaves in a landing folder: links out, back and in, and a FIFO."""
    (root / "outside.jsonl").write_text(_payment("outside-1", T0, "payee-X") + "\n")
    (landing / "loop").symlink_to(landing)  # followed, 30 lines became 1,205 bronze rows
    (landing / "host.jsonl").symlink_to(root / "outside.jsonl")  # a host file's lines copied into bronze
    (landing / "twice.jsonl").symlink_to("top.jsonl")  # a landed file read a second time
    (landing / "dangling.jsonl").symlink_to(root / "nowhere")
    os.mkfifo(landing / "pipe.jsonl")


def test_the_listing_names_links_and_special_files_and_follows_none(tmp_path):
    root, landing = tmp_path, tmp_path / "landing"
    (landing / "sub").mkdir(parents=True)
    (landing / "sub" / "a.jsonl").write_text("{}\n")
    (landing / "_tmp").mkdir()
    (landing / "_tmp" / "link").symlink_to(root)  # under a skipped name: the reader never sees it
    (landing / "top.jsonl").write_text("{}\n")
    _plant_links(root, landing)
    taken, ignored, skipped = scan(str(landing))
    assert sorted(taken) == [str(landing / "sub" / "a.jsonl"), str(landing / "top.jsonl")]
    assert ignored == [str(landing / "_tmp" / "link")]
    assert list(skipped) == [str(landing / name) for name in sorted(PLANTED)]
    assert skipped[str(landing / "host.jsonl")].startswith(f"a symbolic link (to {root / 'outside.jsonl'}), not followed")
    assert skipped[str(landing / "pipe.jsonl")].startswith("not a regular file (a FIFO")
    assert list(unread(str(landing), str(root / "no-checkpoint"))) == [str(landing / name) for name in sorted(PLANTED) if name != "pipe.jsonl"]


def test_a_file_with_several_names_is_read_under_the_one_listed_first(tmp_path):
    """Hard links: one file, several names; the reader would read each. The name the source listed
    first keeps it (then the first by name), so a link made after the read never reads it again."""
    landing, checkpoint = tmp_path / "landing", tmp_path / "checkpoint"
    (landing / "sub").mkdir(parents=True)
    (landing / "b.jsonl").write_text("{}\n")
    os.link(landing / "b.jsonl", landing / "sub" / "c.jsonl")  # both land together: the first by name is read
    (landing / "_staging").mkdir()
    os.link(landing / "b.jsonl", landing / "_staging" / "b.jsonl")  # a skipped name is no second reading
    one = f"a hard link to {landing / 'b.jsonl'} (the same file), read once under that name"
    assert scan(str(landing))[2] == {str(landing / "sub" / "c.jsonl"): one}
    assert unread(str(landing), str(checkpoint)) == {str(landing / "sub" / "c.jsonl"): one}
    # b.jsonl was read in an earlier batch; a.jsonl, linked later, sorts first but is the repeat.
    log = checkpoint / "sources" / "0"
    log.mkdir(parents=True)
    (log / "0").write_text("v1\n" + json.dumps({"path": f"file://{landing / 'b.jsonl'}", "timestamp": 0, "batchId": 0}) + "\n")
    os.link(landing / "b.jsonl", landing / "a.jsonl")
    (log / "1").write_text("v1\n" + json.dumps({"path": f"file://{landing / 'a.jsonl'}", "timestamp": 0, "batchId": 1}) + "\n")
    again = {str(landing / name): one for name in ("a.jsonl", "sub/c.jsonl")}
    assert unread(str(landing), str(checkpoint)) == again
    assert scan(str(landing), {str(landing / "b.jsonl"): 0, str(landing / "a.jsonl"): 1})[2] == again


@pytest.fixture(scope="module")
def layered(spark, tmp_path_factory):
    """A landing folder in several layouts, with hidden files and invalid UTF-8, run once, then changed and run again."""
    root = tmp_path_factory.mktemp("layered")
    landing = root / "landing"
    files = {
        "top.jsonl": [_payment("top-1", T0)],
        "2026/11/01/dated.jsonl": [_payment("dated-1", T0 + timedelta(minutes=1))],
        "dt=2026-11-01/partitioned.jsonl": [_payment("part-1", T0 + timedelta(minutes=2))],
        ".in-progress.jsonl": [_payment("hidden-1", T0)],
        "_tmp/writer.jsonl": [_payment("hidden-2", T0)],
        # Names as the file system allows them: an ISO time (a colon made Hadoop's checksum file an
        # invalid URI, failing every restart), and every separator a URI treats specially.
        COLON: [_payment("colon-1", T0 + timedelta(minutes=4))],
        ODD: [_payment("odd-1", T0 + timedelta(minutes=5))],
    }
    for name, lines in files.items():
        (landing / name).parent.mkdir(parents=True, exist_ok=True)
        (landing / name).write_text("\n".join(lines) + "\n")
    # Three payees that differ only in one byte: two are not UTF-8, the third is U+FFFD itself.
    utf8 = [_payment(f"utf-{i}", T0 + timedelta(minutes=3 + i), f"p{c}").encode() for i, c in enumerate("\x01\x02\ufffd")]
    raw = [line.replace(b"p\\u0001", b"p\xff").replace(b"p\\u0002", b"p\xfe").replace(b"p\\ufffd", "p\ufffd".encode()) for line in utf8]
    (landing / "bytes.jsonl").write_bytes(b"\n".join(raw) + b"\n")
    (landing / "growing.jsonl").write_text(_payment("grow-1", T0 + timedelta(minutes=10)) + "\n")
    (landing / "torn.jsonl").write_text(_payment("torn-1", T0 + timedelta(minutes=11)) + "\n" + _payment("torn-2", T0)[:30])
    _plant_links(root, landing)
    (landing / "u").mkdir()
    os.link(landing / "top.jsonl", landing / "u" / "top.jsonl")  # hard link: one file, two names, read once
    rules = root / "rules.json"
    rules.write_text(json.dumps([RULE]))
    lakehouse = Lakehouse(str(root / "lakehouse"))
    first = _run(spark, lakehouse, landing, rules)
    os.link(landing / "top.jsonl", landing / "a-top.jsonl")  # linked after the read, under a name that sorts first
    with open(landing / "growing.jsonl", "a") as f:  # a writer still appending after the read
        f.write(_payment("grow-2", T0 + timedelta(minutes=12)) + "\n")
    with open(landing / "torn.jsonl", "a") as f:  # the torn last line completed later
        f.write(_payment("torn-2", T0)[30:] + "\n")
    second = _run(spark, lakehouse, landing, rules)
    return lakehouse, landing, raw, first, second


def test_every_layout_and_name_of_the_landing_folder_is_read_and_no_link_followed(spark, layered):
    lakehouse, landing, _, first, _ = layered
    bronze_rows = spark.read.format("delta").load(lakehouse.bronze_transactions).collect()
    sources = {str(Path(local_path(r.source_file)).relative_to(landing)) for r in bronze_rows}
    assert sources == {"top.jsonl", "2026/11/01/dated.jsonl", "dt=2026-11-01/partitioned.jsonl", "bytes.jsonl",
                       "growing.jsonl", "torn.jsonl", COLON, ODD}  # fmt: skip
    assert first.bronze == len(bronze_rows) == 1 + 1 + 1 + 3 + 1 + 2 + 1 + 1
    assert not any("outside-1" in r.value for r in bronze_rows)
    assert first.landing.ignored == [str(landing / ".in-progress.jsonl"), str(landing / "_tmp/writer.jsonl")]
    assert sorted(first.landing.skipped) == [str(landing / name) for name in sorted(PLANTED)] + [str(landing / "u" / "top.jsonl")]
    assert first.landing.problems == [] and first.ok


def test_a_file_linked_under_a_second_name_is_read_once_and_named(layered):
    _, landing, _, first, second = layered
    assert first.landing.skipped[str(landing / "u" / "top.jsonl")] == second.landing.skipped[str(landing / "a-top.jsonl")] == (
        f"a hard link to {landing / 'top.jsonl'} (the same file), read once under that name")
    assert second.bronze == first.bronze  # the earlier-sorting link made after the read added no line


def test_invalid_utf8_never_merges_keys_and_bronze_keeps_the_bytes(spark, layered):
    lakehouse, _, raw, first, _ = layered
    assert first.quarantine_reasons["not_utf8"] == 2
    silver = spark.read.format("delta").load(lakehouse.silver_transactions).where("transaction_id LIKE 'utf-%'").collect()
    assert [(r.transaction_id, r.payee_id) for r in silver] == [("utf-2", "p\ufffd")]
    assert not {"utf-0", "utf-1", "utf-2"} & _alerts(spark, lakehouse)  # merged, 15 + 15 + 15 would alert
    # Any Parquet reader opens bronze: the text column is valid UTF-8, the bytes are exact.
    rows = [r for f in Path(lakehouse.bronze_transactions).glob("*.parquet") for r in pq.read_table(f).to_pylist()]
    kept = {r["value_bytes"] for r in rows if r["value_bytes"] is not None}
    assert kept == {raw[0], raw[1]}


def test_a_file_changed_after_it_was_read_is_reported_by_name(layered):
    _, landing, _, _, second = layered
    assert not second.ok and second.balanced
    assert [p.split(" ")[0] for p in second.landing.problems] == [str(landing / "growing.jsonl"), str(landing / "torn.jsonl")]
    assert all("changed after it was read" in p for p in second.landing.problems)
    assert any("NO (2 file(s) above)" in line for line in second.lines())


def test_the_audit_answers_from_its_record_of_what_bronze_read(spark, layered):
    """Each audit keeps, in bronze's checkpoint, what bronze recorded per file; later audits read only newer rows."""
    lakehouse, landing, _, _, second = layered
    record = Path(lakehouse.checkpoint("bronze"), FILES_READ)
    stored = json.loads(record.read_text(encoding="utf-8"))
    newest = spark.read.format("delta").load(lakehouse.bronze_transactions).agg(F.unix_millis(F.max("ingest_time"))).first()[0]
    assert stored["through_ms"] == newest
    # A record past every bronze row: the answer comes from the record alone, and is the full read's.
    stored["through_ms"] = newest + 86_400_000
    record.write_text(json.dumps(stored), encoding="utf-8")
    from_record = audit(spark, lakehouse, str(landing), "bronze", time.time())
    record.unlink()
    from_bronze = audit(spark, lakehouse, str(landing), "bronze", time.time())
    assert from_record.problems == from_bronze.problems == second.landing.problems != []
    assert json.loads(record.read_text(encoding="utf-8"))["through_ms"] == newest
    record.write_text('{"through_ms": ', encoding="utf-8")  # cut short: all of bronze is read again
    assert audit(spark, lakehouse, str(landing), "bronze", time.time()).problems == second.landing.problems
    assert json.loads(record.read_text(encoding="utf-8"))["through_ms"] == newest


def test_a_file_that_cannot_be_read_as_its_name_says_is_named_and_the_others_ingested(spark, tmp_path, rules):
    """Hadoop decompresses by name: a .gz that is not gzip failed the whole batch on every restart."""
    import bz2
    import gzip

    landing, lakehouse = tmp_path / "landing", Lakehouse(str(tmp_path / "lakehouse"))
    landing.mkdir()
    (landing / "good.jsonl").write_text(_payment("good-1", T0) + "\n")
    (landing / "real.jsonl.gz").write_bytes(gzip.compress((_payment("gz-1", T0) + "\n" + _payment("gz-2", T0) + "\n").encode()))
    (landing / "real.jsonl.bz2").write_bytes(bz2.compress((_payment("bz-1", T0) + "\n").encode()))
    (landing / "plain.jsonl.gz").write_text(_payment("plain-gz", T0) + "\n")
    (landing / "plain.bz2").write_text(_payment("plain-bz", T0) + "\n")
    whole = gzip.compress("".join(_payment(f"cut-{i}", T0) + "\n" for i in range(200)).encode())
    (landing / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])  # a torn copy
    for attempt in range(2):  # the restart neither fails nor forgets the bad files
        summary = _run(spark, lakehouse, landing, rules)
        bad = sorted(p.split(" ")[0] for p in summary.landing.problems)
        assert bad == [str(landing / n) for n in ("cut.jsonl.gz", "plain.bz2", "plain.jsonl.gz")], summary.landing.problems
        assert "is not valid gzip to its end" in summary.landing.problems[0] and not summary.ok
    ids = {r.transaction_id for r in spark.read.format("delta").load(lakehouse.silver_transactions).collect()}
    assert {"good-1", "gz-1", "gz-2", "bz-1"} <= ids and not {"plain-gz", "plain-bz"} & ids


def test_a_batch_whose_observed_line_count_never_came_back_is_counted_again(spark, tmp_path, monkeypatch):
    # A Spark Connect server sends an observation's values only if it completed before the write's
    # answer; without them the metrics row must still count every line, and nothing else changes.
    class Unanswered(Observation):
        @property
        def get(self):
            return {}

    monkeypatch.setattr(bronze, "Observation", Unanswered)
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    ensure_all_tables(spark, lakehouse)
    lines = bronze_frame(spark, [_payment(f"t{i}", T0 + timedelta(minutes=i)) for i in range(3)])
    bronze.write_batch(lines, 0, lakehouse, Recorder(lakehouse, "bronze"), str(tmp_path))
    metrics = spark.read.format("delta").load(lakehouse.pipeline_metrics).collect()
    assert [(m.layer, m.batch_id, m.rows_in, m.rows_out) for m in metrics] == [("bronze", 0, 3, 3)]
    assert spark.read.format("delta").load(lakehouse.bronze_transactions).count() == 3


def test_a_file_listed_but_gone_before_it_was_read_is_reported(spark, tmp_path):
    """The file source lists three files, reads one per batch; the third is deleted before its batch runs."""
    landing, lakehouse = tmp_path / "landing", Lakehouse(str(tmp_path / "lakehouse"))
    landing.mkdir()
    for i in range(3):
        (landing / f"f{i}.jsonl").write_text(_payment(f"t{i}", T0 + timedelta(minutes=i)) + "\n")
    ensure_all_tables(spark, lakehouse)

    def write(batch, batch_id):
        if batch_id == 0:
            (landing / "f2.jsonl").unlink()
        bronze.write_batch(batch, batch_id, lakehouse, Recorder(lakehouse, "bronze"), str(landing))

    started = time.time()
    query = (
        bronze.read_landing(spark, str(landing), max_files_per_trigger=1)
        .writeStream.option("checkpointLocation", lakehouse.checkpoint("bronze"))
        .foreachBatch(write)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    report = audit(spark, lakehouse, str(landing), "bronze", started)
    assert report.problems == [f"{landing / 'f2.jsonl'} was listed but gone before it was read: its lines never reached bronze"]


def test_a_landing_folder_that_holds_the_lakehouse_or_is_not_the_one_ingested_is_refused(tmp_path):
    landing = tmp_path / "landing"
    landing.mkdir()
    with pytest.raises(LandingError, match="is inside the landing folder"):
        check_landing(Lakehouse(str(landing / "lakehouse")), str(landing))
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    check_landing(lakehouse, str(landing))
    moved = tmp_path / "lakehouse" / "landing"
    os.rename(landing, moved)
    with pytest.raises(LandingError, match=f"ingests the landing folder {landing}, not the landing folder {moved}"):
        check_landing(lakehouse, str(moved))
    with pytest.raises(LandingError, match="is not a folder"):
        check_landing(lakehouse, str(tmp_path / "rules.json"))
