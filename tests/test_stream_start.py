"""A new stream over a path table starts from the log's commits only when they are exactly the table's rows."""

from __future__ import annotations

import uuid

from rulewatch.spark.storage.delta_log import whole_history_is_appends
from rulewatch.spark.storage.tables import ensure_table, read, read_stream


def _streamed_ids(spark, table: str, checkpoint: str, starting_version: int | None = None) -> list[int]:
    """The ids a new query reads from ``table`` in one availableNow run."""
    name = f"stream_start_{uuid.uuid4().hex}"
    query = (
        read_stream(spark.readStream.format("delta"), table, starting_version)
        .writeStream.format("memory")
        .queryName(name)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return sorted(row.id for row in spark.table(name).collect())


def test_a_new_stream_reads_an_append_only_history_and_the_snapshot_once_rows_were_removed(spark, tmp_path):
    table = str(tmp_path / "t")
    ensure_table(spark, table, spark.range(1).schema)
    for start in (0, 10, 20):
        spark.range(start, start + 5).write.format("delta").mode("append").save(table)
    assert whole_history_is_appends(table)
    assert _streamed_ids(spark, table, str(tmp_path / "c1")) == sorted(r.id for r in read(spark, table).collect())

    # Started from version 0, Delta would refuse the commit that removed rows; from the snapshot
    # a new query reads the rows the table holds now.
    spark.sql(f"DELETE FROM delta.`{table}` WHERE id = 11")
    assert not whole_history_is_appends(table)
    assert _streamed_ids(spark, table, str(tmp_path / "c2")) == [*range(0, 5), 10, *range(12, 15), *range(20, 25)]


def test_a_table_whose_schema_changed_is_read_from_its_snapshot(spark, tmp_path):
    table = str(tmp_path / "t")
    ensure_table(spark, table, spark.range(1).schema)
    spark.range(3).write.format("delta").mode("append").save(table)
    assert whole_history_is_appends(table)
    spark.sql(f"ALTER TABLE delta.`{table}` ADD COLUMNS (note string)")
    assert not whole_history_is_appends(table)
    assert _streamed_ids(spark, table, str(tmp_path / "c")) == [0, 1, 2]


def test_a_table_with_a_log_checkpoint_is_read_from_its_snapshot(spark, tmp_path):
    table = str(tmp_path / "t")
    ensure_table(spark, table, spark.range(1).schema, properties={"delta.checkpointInterval": "10"})
    for start in range(10):  # the tenth commit after the creation writes the table's first checkpoint
        spark.range(start, start + 1).write.format("delta").mode("append").save(table)
    assert not whole_history_is_appends(table)
    assert _streamed_ids(spark, table, str(tmp_path / "c")) == list(range(10))


def test_a_starting_version_the_caller_gives_is_kept(spark, tmp_path):
    table = str(tmp_path / "t")
    ensure_table(spark, table, spark.range(1).schema)  # version 0
    for start in (0, 10, 20):  # versions 1, 2, 3
        spark.range(start, start + 5).write.format("delta").mode("append").save(table)
    assert whole_history_is_appends(table)
    assert _streamed_ids(spark, table, str(tmp_path / "c"), starting_version=2) == [*range(10, 15), *range(20, 25)]
