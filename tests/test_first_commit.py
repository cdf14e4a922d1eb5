"""A new path table's first commit written here (storage/first_commit.py) is the one Delta writes for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType

from rulewatch.spark.storage import first_commit
from rulewatch.spark.storage.tables import ensure_table

SCHEMA = StructType([StructField("id", LongType(), False), StructField("note", StringType(), metadata={"comment": "a note"})])
CDF = {"delta.enableChangeDataFeed": "true"}
OWN = {"metaData": {"id", "createdTime"}, "commitInfo": {"timestamp", "txnId"}}  # what each table has of its own


def _commit_0(table: str) -> dict[str, dict]:
    lines = Path(table, "_delta_log", first_commit.COMMIT_0).read_text().splitlines()
    return {kind: body for line in lines for kind, body in json.loads(line).items()}


def _shared(commit: dict[str, dict]) -> dict[str, dict]:
    return {kind: {k: v for k, v in body.items() if k not in OWN.get(kind, ())} for kind, body in commit.items()}


@pytest.fixture
def kept_in(tmp_path, monkeypatch):
    """First commits made and kept afresh, in a cache home of the test's own."""
    monkeypatch.setenv("RULEWATCH_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(first_commit, "_made", {})
    return tmp_path / "home" / "first-commits"


def test_a_new_table_gets_the_commit_delta_writes_for_it_with_an_id_of_its_own(spark, tmp_path, kept_in, monkeypatch):
    written = [str(tmp_path / name) for name in ("a", "b")]
    for table in written:
        ensure_table(spark, table, SCHEMA, "notes", properties=CDF, stats_columns=["id"])
    monkeypatch.setattr(first_commit, "create", lambda *_: False)  # as for a table this process cannot write
    by_delta = str(tmp_path / "by_delta")
    ensure_table(spark, by_delta, SCHEMA, "notes", properties=CDF, stats_columns=["id"])
    commits = [_commit_0(t) for t in [*written, by_delta]]
    assert _shared(commits[0]) == _shared(commits[1]) == _shared(commits[2])
    assert len({c["metaData"]["id"] for c in commits}) == 3 and len({c["commitInfo"]["txnId"] for c in commits}) == 3
    assert commits[0]["metaData"]["configuration"]["delta.dataSkippingStatsColumns"] == "id"
    # Delta's checksum beside it (what spares the first read a job) speaks of this table, not the one made aside.
    checksum = json.loads(Path(written[0], "_delta_log", first_commit.CHECKSUM_0).read_text())
    assert checksum["metadata"] == commits[0]["metaData"] and checksum["protocol"] == commits[0]["protocol"]
    assert checksum["txnId"] == commits[0]["commitInfo"]["txnId"] and (checksum["numFiles"], checksum["tableSizeBytes"]) == (0, 0)
    assert spark.sql(f"DESCRIBE DETAIL delta.`{written[1]}`").first()["id"] == commits[1]["metaData"]["id"]
    # Delta takes it as its own: appends, reads, and its change feed from version 0.
    spark.createDataFrame([(1, "x"), (2, None)], SCHEMA).write.format("delta").mode("append").save(written[0])
    assert sorted(tuple(r) for r in spark.read.format("delta").load(written[0]).collect()) == [(1, "x"), (2, None)]
    changes = spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", 0).load(written[0])
    assert sorted((r.id, r._change_type, r._commit_version) for r in changes.collect()) == [(1, "insert", 1), (2, "insert", 1)]
    assert spark.sql(f"DESCRIBE DETAIL delta.`{written[0]}`").first()["description"] == "notes"


def test_the_commit_made_aside_is_kept_for_the_next_process(spark, tmp_path, kept_in, monkeypatch):
    ensure_table(spark, str(tmp_path / "a"), SCHEMA)
    assert len(list(kept_in.glob("*.json"))) == 1
    monkeypatch.setattr(first_commit, "_made", {})  # a new process: only the cache home has it

    def made_aside(*_):
        raise AssertionError("made aside again")

    monkeypatch.setattr(first_commit, "_made_aside", made_aside)
    ensure_table(spark, str(tmp_path / "b"), SCHEMA)
    assert _shared(_commit_0(str(tmp_path / "a"))) == _shared(_commit_0(str(tmp_path / "b")))


def test_the_sessions_delta_settings_shape_the_commit(spark, tmp_path, kept_in):
    """A default table property set in the session is in the table, as Delta would have put it."""
    ensure_table(spark, str(tmp_path / "plain"), SCHEMA)
    setting = "spark.databricks.delta.properties.defaults.enableDeletionVectors"
    spark.conf.set(setting, "true")
    try:
        ensure_table(spark, str(tmp_path / "vectors"), SCHEMA)
    finally:
        spark.conf.unset(setting)
    plain, vectors = _commit_0(str(tmp_path / "plain")), _commit_0(str(tmp_path / "vectors"))
    assert "delta.enableDeletionVectors" not in plain["metaData"]["configuration"]
    assert vectors["metaData"]["configuration"]["delta.enableDeletionVectors"] == "true"
    assert "deletionVectors" in vectors["protocol"]["readerFeatures"]


def test_a_folder_with_anything_in_it_is_left_to_delta(spark, tmp_path, kept_in):
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a table")
    assert not first_commit.create(spark, str(folder), lambda ref: f"CREATE TABLE {ref} (id BIGINT) USING delta")
    assert not (folder / "_delta_log").exists()


def test_a_commit_another_creator_put_first_stands(spark, tmp_path, kept_in, monkeypatch):
    table = tmp_path / "t"
    statement = lambda ref: f"CREATE TABLE IF NOT EXISTS {ref} (id BIGINT) USING delta"  # noqa: E731
    made = first_commit._made_for(spark, statement)
    theirs = '{"theirs":{}}\n'

    def racing(*_):  # the other creator's commit lands between this one's look and its put
        (table / "_delta_log").mkdir(parents=True)
        (table / "_delta_log" / first_commit.COMMIT_0).write_text(theirs)
        return made

    monkeypatch.setattr(first_commit, "_made_for", racing)
    assert not first_commit.create(spark, str(table), statement)
    assert [p.name for p in (table / "_delta_log").iterdir() if p.is_file()] == [first_commit.COMMIT_0]
    assert (table / "_delta_log" / first_commit.COMMIT_0).read_text() == theirs


def test_a_kept_commit_that_is_not_one_leaves_the_table_to_delta(spark, tmp_path, kept_in, monkeypatch):
    ensure_table(spark, str(tmp_path / "a"), SCHEMA)
    (kept,) = kept_in.glob("*.json")
    kept.write_text(json.dumps({"commit": [{"add": {}}], "checksum": {}}))
    monkeypatch.setattr(first_commit, "_made", {})
    ensure_table(spark, str(tmp_path / "b"), SCHEMA)  # through SQL: Delta's own commit, no checksum beside it
    assert _shared(_commit_0(str(tmp_path / "b"))) == _shared(_commit_0(str(tmp_path / "a")))
    assert not Path(tmp_path, "b", "_delta_log", first_commit.CHECKSUM_0).exists()
