"""A new path table's first commit written here (storage/first_commit.py) is the one Delta writes for it."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

from rulewatch.spark.storage import first_commit
from rulewatch.spark.storage.lakehouse import table_ref
from rulewatch.spark.storage.sinks import together
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


def test_tables_created_together_read_the_settings_once_and_each_gets_its_commit(spark, tmp_path, kept_in, monkeypatch):
    """A lakehouse's creations share one read of the session's settings (a py4j call per setting), in
    the threads ``together`` runs them in too, and get the commits a lone creation gets; a setting changed
    before the block still shapes its tables."""
    ensure_table(spark, str(tmp_path / "alone"), SCHEMA)
    setting = "spark.databricks.delta.properties.defaults.enableDeletionVectors"
    spark.conf.set(setting, "true")
    try:
        ensure_table(spark, str(tmp_path / "vectors_alone"), SCHEMA)
        reads = []
        get_all = type(spark.conf).getAll
        with monkeypatch.context() as counting:
            counting.setattr(type(spark.conf), "getAll", property(lambda conf: reads.append(1) or get_all.fget(conf)))
            with first_commit.settings_read_once(spark):
                together([partial(ensure_table, spark, str(tmp_path / name), SCHEMA) for name in ("x", "y", "z")])
    finally:
        spark.conf.unset(setting)
    assert len(reads) == 1
    vectors = _shared(_commit_0(str(tmp_path / "vectors_alone")))
    assert [_shared(_commit_0(str(tmp_path / name))) for name in ("x", "y", "z")] == [vectors] * 3
    assert vectors != _shared(_commit_0(str(tmp_path / "alone"))) and "deletionVectors" in vectors["protocol"]["readerFeatures"]
    with first_commit.settings_read_once(spark):  # a later block reads the settings as they are then
        ensure_table(spark, str(tmp_path / "after"), SCHEMA)
    assert _shared(_commit_0(str(tmp_path / "after"))) == _shared(_commit_0(str(tmp_path / "alone")))


def test_a_folder_with_anything_in_it_is_left_to_delta(spark, tmp_path, kept_in):
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a table")
    assert not first_commit.create(spark, str(folder), lambda ref: f"CREATE TABLE {ref} (id BIGINT) USING delta")
    assert not (folder / "_delta_log").exists()


def test_a_table_another_creator_put_first_stands(spark, tmp_path, kept_in, monkeypatch):
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
    assert [p.name for p in (table / "_delta_log").iterdir()] == [first_commit.COMMIT_0]
    assert (table / "_delta_log" / first_commit.COMMIT_0).read_text() == theirs
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing of its own put left


def test_a_kept_commit_this_cannot_use_is_made_again(spark, tmp_path, kept_in, monkeypatch):
    ensure_table(spark, str(tmp_path / "a"), SCHEMA)
    (kept,) = kept_in.glob("*.json")
    kept.write_text(json.dumps({"commit": [{"add": {}}], "checksum": {}}))
    monkeypatch.setattr(first_commit, "_made", {})
    ensure_table(spark, str(tmp_path / "b"), SCHEMA)
    assert _shared(_commit_0(str(tmp_path / "b"))) == _shared(_commit_0(str(tmp_path / "a")))
    assert json.loads(kept.read_text())["commit"] != [{"add": {}}]


def _without_own(checksum: dict) -> dict:
    return {**checksum, "txnId": None, "metadata": {k: v for k, v in checksum["metadata"].items() if k not in OWN["metaData"]}}


def test_the_checksum_is_the_one_delta_writes_and_spares_the_first_read_a_job(spark, tmp_path, kept_in, monkeypatch):
    statements = []
    create = first_commit.create
    monkeypatch.setattr(first_commit, "create", lambda s, table, statement: statements.append(statement) or create(s, table, statement))
    ensure_table(spark, str(tmp_path / "copied"), SCHEMA, "notes", properties=CDF)
    by_delta = spark.newSession()  # Delta's own checksum, from the same statement
    by_delta.conf.set("spark.databricks.delta.writeChecksumFile.enabled", "true")
    by_delta.sql(statements[0](table_ref(str(tmp_path / "by_delta"))))
    copied, theirs = (json.loads(Path(tmp_path, t, "_delta_log", first_commit.CHECKSUM_0).read_text()) for t in ("copied", "by_delta"))
    assert _without_own(copied) == _without_own(theirs)
    assert copied["metadata"]["id"] == _commit_0(str(tmp_path / "copied"))["metaData"]["id"] != theirs["metadata"]["id"]

    def jobs_of_first_read(table: str) -> int:
        group = f"first-read-{table}"
        spark.sparkContext.setJobGroup(group, group)
        try:
            spark.read.format("delta").load(table).schema
        finally:
            spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
        return len(spark.sparkContext.statusTracker().getJobIdsForGroup(group))

    ensure_table(spark, str(tmp_path / "bare"), SCHEMA, "notes", properties=CDF)
    Path(tmp_path, "bare", "_delta_log", first_commit.CHECKSUM_0).unlink()  # as an older copy of this module wrote it
    assert jobs_of_first_read(str(tmp_path / "copied")) == 0 < jobs_of_first_read(str(tmp_path / "bare"))


def test_a_table_that_holds_values_of_its_own_is_left_to_delta(spark, tmp_path, kept_in):
    """Column mapping names each column physically per table: a copy would give two tables one name."""
    mapped = {"delta.columnMapping.mode": "name"}
    for name in ("a", "b"):
        ensure_table(spark, str(tmp_path / name), SCHEMA, properties=mapped)
    physical = [
        [f["metadata"]["delta.columnMapping.physicalName"] for f in json.loads(_commit_0(str(tmp_path / n))["metaData"]["schemaString"])["fields"]]
        for n in ("a", "b")
    ]
    assert len(set(physical[0]) | set(physical[1])) == 4
    assert not list(kept_in.glob("*.json"))  # nothing kept for it: the next process tries again


def test_a_session_s_sql_settings_shape_the_commit(spark, tmp_path, kept_in):
    stamped = StructType([StructField("at", TimestampType())])
    ensure_table(spark, str(tmp_path / "plain"), stamped)
    spark.conf.set("spark.sql.timestampType", "TIMESTAMP_NTZ")
    try:
        ensure_table(spark, str(tmp_path / "ntz"), stamped)
    finally:
        spark.conf.unset("spark.sql.timestampType")
    types = [json.loads(_commit_0(str(tmp_path / t))["metaData"]["schemaString"])["fields"][0]["type"] for t in ("plain", "ntz")]
    assert types == ["timestamp", "timestamp_ntz"]


def test_a_put_that_fails_leaves_no_half_table_and_the_table_to_delta(spark, tmp_path, kept_in, monkeypatch):
    """Had the log's folder been made in place, Delta's CREATE TABLE IF NOT EXISTS would take it as a table."""

    def refused(*_):
        raise PermissionError("refused")

    monkeypatch.setattr(first_commit.os, "rename", refused)
    ensure_table(spark, str(tmp_path / "t"), SCHEMA)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # the folder written aside is gone
    assert (tmp_path / "t" / "_delta_log" / first_commit.COMMIT_0).exists()
    assert not (tmp_path / "t" / "_delta_log" / first_commit.CHECKSUM_0).exists()  # Delta's own commit
    assert spark.read.format("delta").load(str(tmp_path / "t")).schema.fieldNames() == ["id", "note"]
