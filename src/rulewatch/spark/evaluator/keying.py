"""Dynamic keying (brief §2): fan each event out once per distinct set of grouping fields.

Rules that group by the same fields share one per-key history, so an event is routed once per
*keyset*, not once per rule; the evaluator then checks every rule of that keyset against it.
The key is built from column values looked up by name: rule text never becomes SQL.
"""

from __future__ import annotations

import operator
from functools import reduce

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from rulewatch.spark.storage.schema import FIELD_COLUMNS


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


def fan_out(events: DataFrame, keyset_rows: DataFrame, labels: list[int]) -> DataFrame:
    """One row per (event, keyset) whose grouping fields are all present, with its hash shard's label.

    ``labels`` (``shard_labels``) are the values the shards are grouped by, one per shard.

    The key's parts are looked up with one CASE per position instead of a map and higher-order
    functions: those are interpreted row by row, these compile with the rest of the stage (1M
    events: ~1 s less in a probe, ~0.5 s of CPU in gold's stage; docs/journal/benchmarks.md). A valid
    keyset names each field at most once, so it has at most ``len(FIELD_COLUMNS)`` parts; a longer
    one is an invalid rule's and routes nothing.
    """
    names = F.col("groupingKeyNames")
    parts = [_part(F.try_element_at(names, F.lit(i + 1))) for i in range(len(FIELD_COLUMNS))]
    # Parts past a keyset's size are null and skipped by concat_ws; a null part within it drops the event.
    present = [(F.size(names) <= i) | part.isNotNull() for i, part in enumerate(parts)]
    keyed = keyset_rows.where(F.size(names) <= len(FIELD_COLUMNS)).withColumn("keyset", F.array_join(names, ","))
    return (
        events.crossJoin(keyed)
        .where(reduce(operator.and_, present))
        .withColumn("group_key", F.concat_ws("|", *[_escape(part) for part in parts]))
        .withColumn("shard", shard_label(F.pmod(F.xxhash64("keyset", "group_key"), F.lit(len(labels))), labels))
        .drop("groupingKeyNames")
    )


def shard_label(index: Column, labels: list[int]) -> Column:
    """The label of shard number ``index`` (0-based), as a long: the type ``engine.shards`` hashes."""
    return F.element_at(F.array(*[F.lit(label) for label in labels]).cast("array<bigint>"), index.cast("int") + 1)


def _part(name: Column) -> Column:
    """The event's value of the field called ``name``, as text (null for a name that is no field)."""
    first, *others = [(name == field, F.col(column).cast("string")) for field, column in FIELD_COLUMNS.items()]
    value = F.when(*first)
    for matches, text in others:
        value = value.when(matches, text)
    return value
