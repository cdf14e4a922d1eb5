"""A small path table read again from the files its log names each time a plan runs, not through Delta.

Gold routes every micro-batch by two tiny tables (the rules' grouping-field sets and ``gold/rule_keysets``,
design.md "Events are routed"), and a stream-static join plans its static side again for each batch:
through Delta that is a snapshot update and a file listing, ~120-200 ms per table and batch and ~1 s at a
table's first read in a session, against ~6-10 ms for this source (docs/benchmarks.md, "The two routing
tables' cost per gold batch"). Its reader runs when the batch runs, after the batch's offsets are fixed,
so the rows are at least as new as the change feed that batch takes, as a Delta read's are.

``read`` gives it only where the log can be read here now (a path table with plain Parquet files:
``delta_log.live_files``) and the columns are of the plain types below, not on Databricks; anything else
is Delta's read. A log read that fails is tried again (a commit or checkpoint being written meanwhile);
where the table stops being readable so while a query runs (deletion vectors or column mapping switched
on), the reader fails the batch with :class:`UnreadableTable`, which names the table and the fix.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import ArrayType, BooleanType, DataType, IntegerType, LongType, StringType, StructType

from rulewatch.spark.runtime.env import is_databricks
from rulewatch.spark.runtime.session import foreach_batch_runs_here
from rulewatch.spark.storage.delta_log import UNREADABLE, CheckpointError, column_values, live_files
from rulewatch.spark.storage.lakehouse import is_table_name

NAME = "rulewatch_log_files"
# Types pyarrow hands over as Spark reads them; a timestamp (INT96 files come back without a zone) or a
# decimal would need conversions of their own, so such a table is Delta's to read.
_PLAIN = (StringType, LongType, IntegerType, BooleanType)
ATTEMPTS = 3
_registered: weakref.WeakSet = weakref.WeakSet()


class UnreadableTable(RuntimeError):
    """The table's files can no longer be read from its log alone: a restart reads it through Delta."""


def _plain(kind: DataType) -> bool:
    return isinstance(kind, _PLAIN) or (isinstance(kind, ArrayType) and isinstance(kind.elementType, _PLAIN))


def read(spark: SparkSession, table: str, schema: StructType) -> DataFrame | None:
    """``table``'s rows (``schema``'s columns) read from its log's files at each run of a plan; None where
    only Delta can read it: a catalog table, a log this code cannot follow, a column of another type,
    Databricks, a Spark Connect server on another machine (its executors see other files than these)."""
    if is_table_name(table) or is_databricks() or not foreach_batch_runs_here(spark):
        return None
    if not all(_plain(f.dataType) for f in schema.fields):
        return None
    try:
        if live_files(table, counts=False) is None:
            return None
    except (*UNREADABLE, CheckpointError):
        return None
    if spark not in _registered:
        spark.dataSource.register(LogFiles)
        _registered.add(spark)
    return spark.read.format(NAME).schema(schema).option("path", table).load()


class LogFiles(DataSource):
    """``path``: a Delta table's folder; the schema given to the read names the columns taken."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def reader(self, schema: StructType) -> DataSourceReader:
        return _Reader(self.options["path"], schema)


class _Reader(DataSourceReader):
    def __init__(self, table: str, schema: StructType) -> None:
        self.table = table
        self.columns = schema.fieldNames()

    def read(self, partition: InputPartition) -> Iterator[tuple]:
        for attempt in range(ATTEMPTS):
            try:
                rows = self._rows()
                break
            except (*UNREADABLE, CheckpointError):
                if attempt == ATTEMPTS - 1:
                    raise
                time.sleep(0.2 * (attempt + 1))
        yield from rows

    def _rows(self) -> list[tuple]:
        files = live_files(self.table, counts=False)
        if files is None:
            raise UnreadableTable(
                f"{self.table} can no longer be read from its log's files alone (its log now names deletion vectors, "
                "column mapping, partitions, a reader feature or a file outside the table's folder); restart the query, "
                "which then reads it through Delta"
            )
        return list(column_values(files, self.columns))
