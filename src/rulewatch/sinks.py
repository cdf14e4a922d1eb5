"""Delta sinks that are idempotent per micro-batch.

``foreachBatch`` is at-least-once: after a crash the same batch id runs again. Every table write
carries Delta's ``txnAppId`` + ``txnVersion``, so Delta skips a write it has already committed
for that (sink, batch) and a replayed batch neither loses nor duplicates a row.
"""

from __future__ import annotations

import os
import signal

from pyspark.sql import Column, DataFrame, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructField, StructType


def _sql_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _ddl(schema: StructType) -> str:
    """Column definitions; a field's ``metadata["comment"]`` becomes its column comment, shown by catalogs and dashboards."""
    return ", ".join(
        f"`{f.name}` {f.dataType.simpleString()}{'' if f.nullable else ' NOT NULL'}"
        + (f" COMMENT {_sql_string(f.metadata['comment'])}" if f.metadata.get("comment") else "")
        for f in schema.fields
    )


def table_ref(path: str) -> str:
    if "`" in path:
        raise ValueError(f"table path {path!r} contains a backtick; choose a lakehouse path without one")
    return f"delta.`{path}`"


def latest_commit(spark: SparkSession, path: str) -> Row:
    """The newest commit of the Delta table at ``path`` (``version``, ``timestamp``, ...)."""
    return spark.sql(f"DESCRIBE HISTORY {table_ref(path)} LIMIT 1").first()


def ensure_table(
    spark: SparkSession, path: str, schema: StructType, comment: str = "", properties: dict[str, str] | None = None
) -> None:
    """Create the Delta table at ``path`` with ``schema`` unless it exists (streams need it to start)."""
    props = {"delta.appendOnly": "false", **(properties or {})}
    tbl_props = ", ".join(f"'{k}' = '{v}'" for k, v in props.items())
    comment_sql = f" COMMENT {_sql_string(comment)}" if comment else ""
    spark.sql(
        f"CREATE TABLE IF NOT EXISTS {table_ref(path)} ({_ddl(schema)}) USING delta{comment_sql} "
        f"TBLPROPERTIES ({tbl_props})"
    )
    # A table made by an earlier release lacks the columns added since: add them (null for old rows).
    existing = set(spark.read.format("delta").load(path).columns)
    missing = [f for f in schema.fields if f.name not in existing]
    if missing:
        spark.sql(f"ALTER TABLE {table_ref(path)} ADD COLUMNS ({_ddl(StructType([StructField(f.name, f.dataType, True, f.metadata) for f in missing]))})")


# Fault injection for the crash tests (tests/test_crash.py): "<sink>:<batch>:<before|after>", e.g.
# "rulewatch.gold.alerts:1:after", SIGKILLs this process at that point of that write. A kill is the
# harshest failure (no finally, no shutdown hook), so surviving it covers every softer one.
CRASH_AT_ENV = "RULEWATCH_CRASH_AT"


def crash_point(sink: str, batch_id: int, moment: str) -> None:
    if os.environ.get(CRASH_AT_ENV) == f"{sink}:{batch_id}:{moment}":
        os.kill(os.getpid(), signal.SIGKILL)


def append_once(df: DataFrame, path: str, sink: str, batch_id: int, rows: int | None = None) -> None:
    """Append ``df`` to the table at ``path`` unless batch ``batch_id`` of ``sink`` already did.

    ``rows=0`` (the caller counted ``df`` empty) skips the commit: with ``txnAppId`` each append pays
    a Delta state reconstruction (~0.5 s locally), and an empty one adds nothing a replay could repeat.
    """
    crash_point(sink, batch_id, "before")
    if rows != 0:
        (
            df.write.format("delta")
            .mode("append")
            .option("txnAppId", sink)
            .option("txnVersion", batch_id)
            .save(path)
        )
    crash_point(sink, batch_id, "after")


def batch_column(name: str, batch_id: int) -> Column:
    """The micro-batch id as a ``long`` column (a bare literal would be an int and not merge)."""
    return F.lit(batch_id).cast("long").alias(name)
