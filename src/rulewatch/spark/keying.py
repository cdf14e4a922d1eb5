"""Dynamic keying (brief §2): fan each event out once per distinct set of grouping fields.

Rules that group by the same fields share one per-key history, so an event is routed once per
*keyset*, not once per rule; the evaluator then checks every rule of that keyset against it.
The key is built from column values looked up by name: rule text never becomes SQL.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from rulewatch.spark.schema import FIELD_COLUMNS


def keysets(rules: DataFrame) -> DataFrame:
    """Distinct grouping-field lists of rules that are not deleted (paused rules keep history)."""
    return (
        rules.where(F.coalesce(F.col("ruleState"), F.lit("ACTIVE")) != "DELETE")
        .where(F.size("groupingKeyNames") > 0)
        .select("groupingKeyNames")
        .distinct()
    )


def _escape(part: Column) -> Column:
    # "a|b","c" and "a","b|c" must not share a key: escape the separator (and the escape) in values.
    return F.replace(F.replace(part, F.lit("\\"), F.lit("\\\\")), F.lit("|"), F.lit("\\|"))


def fan_out(events: DataFrame, keyset_rows: DataFrame, shards: int) -> DataFrame:
    """One row per (event, keyset) whose grouping fields are all present, with its hash shard."""
    by_name = F.create_map(*[x for f, c in FIELD_COLUMNS.items() for x in (F.lit(f), F.col(c).cast("string"))])
    parts = F.transform("groupingKeyNames", lambda name: by_name[name])
    fanned = events.crossJoin(keyset_rows).withColumn("_parts", parts)
    return (
        fanned.where(~F.exists("_parts", lambda p: p.isNull()))
        .withColumn("keyset", F.array_join("groupingKeyNames", ","))
        .withColumn("group_key", F.array_join(F.transform("_parts", _escape), "|"))
        .withColumn("shard", F.pmod(F.xxhash64("keyset", "group_key"), F.lit(shards)))
        .drop("_parts", "groupingKeyNames")
    )
