"""Delta tables by path or by catalog name: the one place that knows the difference.

``Lakehouse`` names every table either by path (locally) or as ``catalog.schema.table`` (Unity
Catalog managed tables); everything else reads, streams, writes and creates tables through these
functions and never looks at which it was given.
"""

from __future__ import annotations

import json
import re

from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, DataFrameWriter, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import DataStreamReader
from pyspark.sql.types import StructField, StructType

from rulewatch.spark.storage import first_commit, log_source
from rulewatch.spark.storage.delta_log import UNREADABLE, column_names, live_files, may_hold, table_version, whole_history_is_appends
from rulewatch.spark.storage.lakehouse import is_table_name, table_ref


def sql_string(text: str) -> str:
    """``text`` as a SQL string literal (quotes and backslashes escaped)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _ddl(schema: StructType) -> str:
    """Column definitions; a field's ``metadata["comment"]`` becomes its column comment, shown by catalogs and dashboards."""
    return ", ".join(
        f"`{f.name}` {f.dataType.simpleString()}{'' if f.nullable else ' NOT NULL'}"
        + (f" COMMENT {sql_string(f.metadata['comment'])}" if f.metadata.get("comment") else "")
        for f in schema.fields
    )


def read(spark: SparkSession, table: str, version: int | None = None) -> DataFrame:
    """The table as it is now, or as of ``version``."""
    reader = spark.read if version is None else spark.read.option("versionAsOf", version)
    if is_table_name(table):
        return reader.table(table_ref(table))
    return reader.format("delta").load(table)


def read_each_run(spark: SparkSession, table: str, schema: StructType) -> DataFrame:
    """A small table's ``schema`` columns as they are whenever the plan runs (each micro-batch of a stream
    that joins it): from its log's files where they can be read here (``log_source``), else through Delta."""
    found = log_source.read(spark, table, schema)
    return read(spark, table).select(*schema.fieldNames()) if found is None else found


# What Hadoop's path globbing (spark.read.parquet) or URI parsing would take otherwise than Delta's load does.
_PATTERN = re.compile(r"[\[\]{}*?\\:]")


def _files_here(table: str) -> list[dict] | None:
    """The path table's files as its log here names them (``delta_log.live_files``); None for a catalog
    table or a log these reads cannot follow, which Delta's own read then answers for."""
    if is_table_name(table):
        return None
    try:
        return live_files(table)
    except UNREADABLE:
        return None


def read_near(
    spark: SparkSession, table: str, schema: StructType, column: str | None = None, low_ms: int | None = None, high_ms: int | None = None
) -> DataFrame | None:
    """The table's rows, read from the files whose statistics say they may hold a ``column`` (a
    timestamp) value within [``low_ms``, ``high_ms``] (epoch milliseconds, None: unbounded), or from all
    of them without a ``column``; None when none may. The caller still filters the rows: a file's
    statistics only rule it out.

    A path table here is read as plain Parquet (with ``schema``, the table's) from the files its log
    names: a Delta read costs a Spark job over the table's log whenever the table has a new version
    (~0.5-0.6 s of a duplicate lookup's ~1.1 s, docs/benchmarks.md), which tables written every batch
    always have. Delta's own read where the log cannot be read here (a catalog table, deletion
    vectors or any other reader feature, a log this code does not understand), and for a path that
    Spark's file reader would take as a pattern (``[``, ``{``, ``*``, ``?``, ``\\``) or a URI (``:``).
    A gap in the log's commits raises CheckpointError, which names the missing commit and the way back."""
    files = None if _PATTERN.search(table) else _files_here(table)
    if files is None:
        return read(spark, table)
    low, high = -(2**63) if low_ms is None else low_ms, 2**63 if high_ms is None else high_ms
    near = [f["path"] for f in files if column is None or may_hold(f, column, low, high)]
    return spark.read.schema(schema).parquet(*near) if near else None


def column_max(spark: SparkSession, table: str, column: str) -> int | None:
    """The largest value of the integer ``column`` (None: no rows). A path table's files' statistics
    answer without a Spark job where every file has one for it; else Delta reads the table (as
    ``read_near`` says, a Delta read first runs a job over a log that has moved on)."""
    files = _files_here(table)
    if files is not None:
        highs = [(json.loads(f.get("stats") or "{}").get("maxValues") or {}).get(column) for f in files]
        if all(isinstance(high, int) for high in highs):
            return max(highs, default=None)
    return read(spark, table).agg(F.max(column)).first()[0]


def read_stream(reader: DataStreamReader, table: str, starting_version: int | str | None = None) -> DataFrame:
    """``reader`` (format and options set) streaming from ``table``, from ``starting_version`` if given.

    Without one, a path table whose whole log only appended is read from version 0 (the same rows).
    """
    if starting_version is None and not is_table_name(table) and whole_history_is_appends(table):
        # A new query's first batch is then read from the log's commits. Without a starting version
        # Delta plans it from a snapshot whose files a Spark job sorts: ~1-1.5 s per source and
        # query start (docs/journal/benchmarks.md). A restarted query resumes from its offsets either way.
        starting_version = 0
    if starting_version is not None:
        reader = reader.option("startingVersion", starting_version)
    if is_table_name(table):
        return reader.table(table_ref(table))
    return reader.load(table)


def newest_version(spark: SparkSession, table: str) -> int:
    """The table's newest version: from its log for a path table here, else from its history."""
    if not is_table_name(table):
        found = table_version(table)
        if found is not None:
            return found[1]
    return int(spark.sql(f"DESCRIBE HISTORY {table_ref(table)} LIMIT 1").first()["version"])


def exists(spark: SparkSession, table: str) -> bool:
    if is_table_name(table):
        return spark.catalog.tableExists(table_ref(table))
    # SQL, not DeltaTable.isDeltaTable: under Spark Connect that needs the server's Delta Connect
    # plugin, which a plain Connect server (as `RULEWATCH_REMOTE=local[2]` starts) lacks.
    try:
        spark.sql(f"DESCRIBE DETAIL {table_ref(table)}").collect()
    except AnalysisException as err:
        if err.getCondition() == "DELTA_MISSING_DELTA_TABLE":
            return False
        raise
    return True


def _has_columns(table: str, schema: StructType) -> bool:
    """Whether the path table's log here says it exists with every column of ``schema`` (False: it
    does not, or the log cannot tell). A commit missing from the log raises CheckpointError, which names
    it and the way back, before any SQL statement fails on it less clearly."""
    try:
        names = column_names(table)
    except UNREADABLE:
        return False
    return names is not None and set(schema.fieldNames()) <= set(names)


def save(writer: DataFrameWriter, table: str) -> None:
    """Run ``writer`` (format, mode and options set) into the existing ``table``; Delta's write options hold for both."""
    if is_table_name(table):
        writer.saveAsTable(table_ref(table))
    else:
        writer.save(table)


def latest_commit(spark: SparkSession, table: str) -> Row:
    """The newest commit of the Delta table (``version``, ``timestamp``, ...)."""
    return spark.sql(f"DESCRIBE HISTORY {table_ref(table)} LIMIT 1").first()


# Delta writes a log checkpoint inside the commit that reaches each multiple of this, in the writer's
# thread: 2-4 s on two cores, against 0.4-1.6 s for a live micro-batch's append, and every table of a
# batch reaches it together. Delta's default (10) put that on every tenth live batch of each query;
# at 100 a reader replays at most 99 small commit files instead of 9 (docs/benchmarks.md, #70).
CHECKPOINT_INTERVAL = 100


def ensure_table(
    spark: SparkSession,
    table: str,
    schema: StructType,
    comment: str = "",
    properties: dict[str, str] | None = None,
    stats_columns: list[str] | None = None,
) -> None:
    """Create the Delta table with ``schema`` unless it exists (streams need it to start).

    ``stats_columns``: the columns whose min/max Delta keeps per file (by default the first 32).
    For the tables written a million rows at a time, only the columns reads filter on: the
    statistics of every other column cost each append ~35 % of its time (docs/journal/benchmarks.md)."""
    if not is_table_name(table) and _has_columns(table, schema):
        return  # read from its log: no SQL statement, which costs ~0.1-0.5 s even for a table that exists
    stats = {"delta.dataSkippingStatsColumns": ",".join(stats_columns)} if stats_columns else {}
    props = {"delta.appendOnly": "false", "delta.checkpointInterval": str(CHECKPOINT_INTERVAL), **stats, **(properties or {})}
    tbl_props = ", ".join(f"'{k}' = '{v}'" for k, v in props.items())
    comment_sql = f" COMMENT {sql_string(comment)}" if comment else ""

    def statement(ref: str) -> str:
        return f"CREATE TABLE IF NOT EXISTS {ref} ({_ddl(schema)}) USING delta{comment_sql} TBLPROPERTIES ({tbl_props})"

    if first_commit.create(spark, table, statement):
        return
    spark.sql(statement(table_ref(table)))
    # A table made by an earlier release lacks the columns added since: add them (null for old rows).
    existing = set(read(spark, table).columns)
    missing = [f for f in schema.fields if f.name not in existing]
    if missing:
        spark.sql(f"ALTER TABLE {table_ref(table)} ADD COLUMNS ({_ddl(StructType([StructField(f.name, f.dataType, True, f.metadata) for f in missing]))})")
