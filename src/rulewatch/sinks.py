"""Delta sinks that are idempotent per micro-batch.

``foreachBatch`` is at-least-once: after a crash the same batch id runs again. Every table write
carries Delta's ``txnAppId`` + ``txnVersion``, so Delta skips a write it has already committed
for that (sink, batch) and a replayed batch neither loses nor duplicates a row.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType


def _ddl(schema: StructType) -> str:
    return ", ".join(
        f"`{f.name}` {f.dataType.simpleString()}{'' if f.nullable else ' NOT NULL'}" for f in schema.fields
    )


def table_ref(path: str) -> str:
    if "`" in path:
        raise ValueError(f"table path {path!r} contains a backtick; choose a lakehouse path without one")
    return f"delta.`{path}`"


def ensure_table(
    spark: SparkSession, path: str, schema: StructType, comment: str = "", properties: dict[str, str] | None = None
) -> None:
    """Create the Delta table at ``path`` with ``schema`` unless it exists (streams need it to start)."""
    props = {"delta.appendOnly": "false", **(properties or {})}
    tbl_props = ", ".join(f"'{k}' = '{v}'" for k, v in props.items())
    comment_sql = f" COMMENT '{comment}'" if comment else ""
    spark.sql(
        f"CREATE TABLE IF NOT EXISTS {table_ref(path)} ({_ddl(schema)}) USING delta{comment_sql} "
        f"TBLPROPERTIES ({tbl_props})"
    )


def append_once(df: DataFrame, path: str, sink: str, batch_id: int) -> None:
    """Append ``df`` to the table at ``path`` unless batch ``batch_id`` of ``sink`` already did."""
    (
        df.write.format("delta")
        .mode("append")
        .option("txnAppId", sink)
        .option("txnVersion", batch_id)
        .save(path)
    )


def batch_column(name: str, batch_id: int) -> Column:
    """The micro-batch id as a ``long`` column (a bare literal would be an int and not merge)."""
    return F.lit(batch_id).cast("long").alias(name)
