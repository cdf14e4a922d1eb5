"""A small path table read from its log's files at each run of a plan (storage/log_source.py), as gold routes by."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, LongType, StringType, StructField, StructType, TimestampType

from rulewatch.spark.evaluator.keying import fan_out
from rulewatch.spark.layers import gold
from rulewatch.spark.evaluator.settings import GoldSettings
from rulewatch.spark.storage import log_source
from rulewatch.spark.storage.delta_log import CheckpointError
from rulewatch.spark.storage.schema import FIELD_COLUMNS
from rulewatch.spark.storage.tables import read_each_run

SCHEMA = StructType([StructField("k", StringType()), StructField("n", LongType())])


def _rows(frame) -> list[tuple]:
    return sorted(tuple(r) for r in frame.collect())


def _delta(spark, table: str, columns: list[str]) -> list[tuple]:
    return _rows(spark.read.format("delta").load(table).select(*columns))


def test_one_frame_gives_the_rows_delta_gives_after_each_append_delete_overwrite_and_added_column(spark, tmp_path):
    table = str(tmp_path / "t")
    # A checkpoint every second commit: the later reads start from a checkpoint's Parquet file, not commit 0.
    spark.sql(f"CREATE TABLE delta.`{table}` (k STRING, n BIGINT) USING delta TBLPROPERTIES (delta.checkpointInterval = 2)")
    spark.createDataFrame([("a", 1), ("b", 2)], SCHEMA).write.format("delta").mode("append").save(table)
    frame = log_source.read(spark, table, SCHEMA)
    assert frame is not None
    seen = [_rows(frame)]
    spark.createDataFrame([("c", 3)], SCHEMA).write.format("delta").mode("append").save(table)
    seen.append(_rows(frame))
    assert seen[-1] == _delta(spark, table, ["k", "n"]) != seen[0]
    spark.sql(f"DELETE FROM delta.`{table}` WHERE k = 'a'")
    assert _rows(frame) == _delta(spark, table, ["k", "n"]) == [("b", 2), ("c", 3)]
    # A column added later: null in the files written before it, as Delta reads them.
    spark.sql(f"ALTER TABLE delta.`{table}` ADD COLUMNS (note STRING)")
    spark.sql(f"INSERT INTO delta.`{table}` VALUES ('d', 4, 'x')")
    wider = StructType([*SCHEMA.fields, StructField("note", StringType())])
    assert _rows(log_source.read(spark, table, wider)) == _delta(spark, table, ["k", "n", "note"])
    assert _rows(frame) == [("b", 2), ("c", 3), ("d", 4)]
    spark.createDataFrame([("e", 5)], SCHEMA).write.format("delta").mode("overwrite").option("mergeSchema", "true").save(table)
    assert _rows(frame) == _delta(spark, table, ["k", "n"]) == [("e", 5)]
    assert list(Path(table, "_delta_log").glob("*.checkpoint.parquet"))


def test_each_micro_batch_of_a_stream_joined_to_it_sees_the_version_committed_before_it(spark, tmp_path):
    events, table = str(tmp_path / "events"), str(tmp_path / "t")
    spark.createDataFrame([("a", 1)], SCHEMA).write.format("delta").save(table)
    spark.createDataFrame([("e1", 1)], SCHEMA).write.format("delta").save(events)
    seen: dict[int, list] = {}
    routing = log_source.read(spark, table, SCHEMA)
    assert routing is not None
    joined = spark.readStream.format("delta").load(events).select("k").crossJoin(routing.select(F.col("k").alias("routed")))
    query = (
        joined.writeStream.foreachBatch(lambda frame, batch: seen.setdefault(batch, _rows(frame)))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        query.processAllAvailable()
        spark.createDataFrame([("b", 2)], SCHEMA).write.format("delta").mode("append").save(table)
        spark.createDataFrame([("e2", 2)], SCHEMA).write.format("delta").mode("append").save(events)
        query.processAllAvailable()
    finally:
        query.stop()
    assert seen == {0: [("e1", "a")], 1: [("e2", "a"), ("e2", "b")]}


def test_a_table_whose_files_alone_do_not_give_its_rows_is_read_through_delta(spark, tmp_path):
    table = str(tmp_path / "dv")
    spark.sql(f"CREATE TABLE delta.`{table}` (k STRING, n BIGINT) USING delta TBLPROPERTIES (delta.enableDeletionVectors = true)")
    spark.sql(f"INSERT INTO delta.`{table}` VALUES ('a', 1), ('b', 2)")
    spark.sql(f"DELETE FROM delta.`{table}` WHERE k = 'a'")
    assert log_source.read(spark, table, SCHEMA) is None
    assert _rows(read_each_run(spark, table, SCHEMA)) == [("b", 2)]
    assert log_source.read(spark, "main.rulewatch.rules", SCHEMA) is None
    plain = str(tmp_path / "plain")
    spark.createDataFrame([("a", 1)], SCHEMA).write.format("delta").save(plain)
    # A timestamp comes back from pyarrow without its zone from some files: Delta reads it.
    assert log_source.read(spark, plain, StructType([*SCHEMA.fields, StructField("at", TimestampType())])) is None


def test_a_table_that_stops_being_readable_so_fails_the_batch_naming_it_and_a_restart_reads_it_through_delta(spark, tmp_path):
    events, table = str(tmp_path / "events"), str(tmp_path / "t")
    spark.createDataFrame([("a", 1), ("b", 2)], SCHEMA).write.format("delta").save(table)
    spark.createDataFrame([("e1", 1)], SCHEMA).write.format("delta").save(events)

    def start():
        joined = spark.readStream.format("delta").load(events).select("k").crossJoin(read_each_run(spark, table, SCHEMA).select("n"))
        return joined.writeStream.foreachBatch(lambda frame, batch: frame.count()).option("checkpointLocation", str(tmp_path / "checkpoint")).start()

    query = start()
    query.processAllAvailable()
    spark.sql(f"ALTER TABLE delta.`{table}` SET TBLPROPERTIES (delta.enableDeletionVectors = true)")
    spark.sql(f"DELETE FROM delta.`{table}` WHERE k = 'a'")
    spark.createDataFrame([("e2", 2)], SCHEMA).write.format("delta").mode("append").save(events)
    with pytest.raises(Exception) as failed:
        query.processAllAvailable()
    query.stop()
    assert "UnreadableTable" in str(failed.value) and table in str(failed.value) and "restart" in str(failed.value)
    again = start()
    try:
        again.processAllAvailable()
        assert again.exception() is None and again.lastProgress["numInputRows"] == 1
    finally:
        again.stop()


def test_gold_broadcasts_the_keysets_read_so_to_a_batch_of_any_size(spark, tmp_path, capsys):
    # The source gives the planner no size: without the broadcast a big batch is a Cartesian product
    # that reads the table again in every task.
    table = str(tmp_path / "keysets")
    spark.createDataFrame([(["userId"],)], "groupingKeyNames array<string>").write.format("delta").save(table)
    keysets = log_source.read(spark, table, StructType([StructField("groupingKeyNames", ArrayType(StringType()))]))
    events = spark.range(10**12).select(F.lit("u").alias("user_id"), *[F.lit(None).cast("string").alias(c) for c in FIELD_COLUMNS.values() if c != "user_id"])
    capsys.readouterr()
    fan_out(events, keysets, [0, 1]).explain()
    plan = capsys.readouterr().out
    assert "BroadcastNestedLoopJoin" in plan and "CartesianProduct" not in plan


def test_a_log_read_while_a_commit_is_out_of_place_is_tried_again_and_a_missing_commit_is_named(spark, tmp_path):
    table = str(tmp_path / "t")
    for row in [("a", 1), ("b", 2)]:
        spark.createDataFrame([row], SCHEMA).write.format("delta").mode("append").save(table)
    reader = log_source.LogFiles({"path": table}).reader(SCHEMA)
    commit = Path(table, "_delta_log", f"{0:020d}.json")
    aside = commit.with_suffix(".aside")
    os.rename(commit, aside)
    back = threading.Timer(0.1, os.rename, (aside, commit))
    back.start()
    assert sorted(reader.read(None)) == [("a", 1), ("b", 2)]
    back.join()
    os.rename(commit, aside)
    with pytest.raises(CheckpointError, match="missing commit 0"):
        list(reader.read(None))


def test_gold_routes_by_both_tables_read_from_their_logs_files(spark, fixture_run, capsys):
    capsys.readouterr()
    gold._events(spark, fixture_run.lakehouse, GoldSettings(), gold.Continued()).explain()
    plan = capsys.readouterr().out
    assert plan.count("rulewatch_log_files") == 2 and "BroadcastNestedLoopJoin" in plan
