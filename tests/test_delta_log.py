"""Reading a Delta log as plain files: what its statistics rule out, and which tables it leaves to Delta."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from pyspark.sql.types import LongType, StructField, StructType

from rulewatch.spark.storage.delta_log import column_names, live_files, may_hold
from rulewatch.spark.storage.tables import ensure_table

T = datetime(2026, 11, 1, 10, tzinfo=timezone.utc)
MS = int(T.timestamp() * 1000)


def _file(low: str | None, high: str | None) -> dict:
    bounds = {"minValues": {"event_time": low}, "maxValues": {"event_time": high}}
    return {"stats": json.dumps({"numRecords": 1, **{side: {k: v for k, v in b.items() if v} for side, b in bounds.items()}})}


@pytest.mark.parametrize(
    ("low_ms", "high_ms", "holds"),
    [
        (MS - 10, MS - 1, False),  # wholly before the file's first time
        (MS - 10, MS, True),
        (MS + 5_000, MS + 5_000, True),
        (MS + 60_000, MS + 60_001, True),  # the maximum is truncated to milliseconds: up to one more
        (MS + 60_002, MS + 70_000, False),
    ],
)
def test_a_file_is_ruled_out_only_when_its_event_times_cannot_be_in_the_range(low_ms, high_ms, holds):
    assert may_hold(_file("2026-11-01T10:00:00.000Z", "2026-11-01T10:01:00.000Z"), "event_time", low_ms, high_ms) is holds


@pytest.mark.parametrize("stamp", ["2004-10-12T22:37:41.505Z", "2038-06-08T02:38:54.386Z", "2039-06-14T12:14:17.143Z"])
def test_a_bound_equal_to_a_file_s_time_keeps_the_file(stamp):
    """Whole milliseconds: a float's product can land above the exact millisecond and rule the file out."""
    ms = (datetime.fromisoformat(stamp) - datetime(1970, 1, 1, tzinfo=timezone.utc)) // timedelta(milliseconds=1)
    assert may_hold(_file(stamp, stamp), "event_time", ms - 5, ms) and may_hold(_file(stamp, stamp), "event_time", ms + 1, ms + 5)
    assert not may_hold(_file(stamp, stamp), "event_time", ms - 5, ms - 1)


@pytest.mark.parametrize(
    "stats",
    [
        _file(None, None),  # every value null, or the column not among the statistics
        _file("2026-11-01T10:00:00.000", "2026-11-01T10:01:00.000"),  # no time zone: no instant
        _file("yesterday", "today"),
        {"stats": None},
        {},
    ],
)
def test_statistics_that_say_nothing_rule_nothing_out(stats):
    assert may_hold(stats, "event_time", MS - 10**9, MS - 10**9)


def test_an_offset_in_the_statistics_is_honoured():
    assert not may_hold(_file("2026-11-01T11:00:00.000+01:00", "2026-11-01T11:00:00.000+01:00"), "event_time", MS + 2, MS + 9)
    assert may_hold(_file("2026-11-01T11:00:00.000+01:00", "2026-11-01T11:00:00.000+01:00"), "event_time", MS, MS)


def _log(table: Path, protocol: dict) -> None:
    log = table / "_delta_log"
    log.mkdir(parents=True)
    actions = [
        {"protocol": protocol},
        {"metaData": {"id": "x", "format": {"provider": "parquet"}, "schemaString": "{}", "partitionColumns": [], "configuration": {}}},
        {"add": {"path": "part-0.parquet", "size": 1, "modificationTime": 0, "dataChange": True, "stats": '{"numRecords": 3}'}},
    ]
    (log / f"{0:020d}.json").write_text("\n".join(json.dumps(a) for a in actions) + "\n")


def test_a_table_any_reader_feature_is_left_to_delta(tmp_path):
    """v2 checkpoints, type widening, deletion vectors...: each needs Delta's reader, whatever its files say."""
    _log(tmp_path / "plain", {"minReaderVersion": 1, "minWriterVersion": 2})
    _log(tmp_path / "featured", {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": ["v2Checkpoint"], "writerFeatures": ["v2Checkpoint"]})
    assert [f["numRecords"] for f in live_files(str(tmp_path / "plain"))] == [3]
    assert live_files(str(tmp_path / "featured")) is None


def _commit(table: Path, version: int, *actions: dict) -> None:
    (table / "_delta_log" / f"{version:020d}.json").write_text("\n".join(json.dumps(a) for a in actions) + "\n")


def _schema(*names: str) -> str:
    return json.dumps({"type": "struct", "fields": [{"name": n, "type": "long", "nullable": True, "metadata": {}} for n in names]})


def test_the_columns_are_the_newest_schemas(tmp_path):
    table = tmp_path / "t"
    _log(table, {"minReaderVersion": 1, "minWriterVersion": 2})
    _commit(table, 0, {"metaData": {"id": "x", "schemaString": _schema("a", "b"), "partitionColumns": []}})
    assert column_names(str(table)) == ["a", "b"]
    _commit(table, 1, {"add": {"path": "p.parquet", "stats": '{"numRecords": 1}'}})
    _commit(table, 2, {"metaData": {"id": "x", "schemaString": _schema("a", "b", "c"), "partitionColumns": []}})
    _commit(table, 3, {"add": {"path": "q.parquet", "stats": '{"numRecords": 1}'}})
    assert column_names(str(table)) == ["a", "b", "c"]
    assert column_names(str(tmp_path / "nothing")) is None


def test_a_path_table_whose_log_has_every_column_is_ensured_without_spark(tmp_path):
    """No SQL statement at all (``spark`` None here): one per table and start cost ~0.1-0.5 s."""
    table = tmp_path / "t"
    _log(table, {"minReaderVersion": 1, "minWriterVersion": 2})
    _commit(table, 0, {"metaData": {"id": "x", "schemaString": _schema("a", "b"), "partitionColumns": []}})
    ensure_table(None, str(table), StructType([StructField("b", LongType()), StructField("a", LongType())]))
    with pytest.raises(AttributeError):  # a column the log lacks: Spark is asked to add it
        ensure_table(None, str(table), StructType([StructField("a", LongType()), StructField("c", LongType())]))


def test_a_log_without_a_protocol_these_reads_found_is_left_to_delta(tmp_path):
    """A v2 checkpoint written as JSON is not read here: the commits after it alone do not give the table."""
    table = tmp_path / "t"
    _log(table, {"minReaderVersion": 1, "minWriterVersion": 2})
    (table / "_delta_log" / f"{0:020d}.json").unlink()
    (table / "_delta_log" / "_last_checkpoint").write_text('{"version": 0, "size": 3}')
    _commit(table, 1, {"add": {"path": "p.parquet", "stats": '{"numRecords": 1}'}})
    assert live_files(str(table)) is None
