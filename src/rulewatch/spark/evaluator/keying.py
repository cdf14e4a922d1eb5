"""Dynamic keying (brief §2): fan each event out once per distinct set of grouping fields.

Rules that group by the same fields share one per-key history, so an event is routed once per
*keyset*, not once per rule; the evaluator then checks every rule of that keyset against it.
The key is built from column values looked up by name: rule text never becomes SQL.
"""

from __future__ import annotations

import operator
from functools import cache, reduce

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from rulewatch.spark.storage.schema import FIELD_COLUMNS


def keysets(rules: DataFrame) -> DataFrame:
    """The grouping-field lists of rules that are not deleted (paused rules keep history), one per rule:
    the caller makes them distinct, with whatever else it routes to."""
    return (
        rules.where(F.coalesce(F.col("ruleState"), F.lit("ACTIVE")) != "DELETE")
        .where(F.size("groupingKeyNames") > 0)
        .select("groupingKeyNames")
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
    valid, keyset, present, group_key, shard = _routing_columns(type(events.sparkSession).__module__, tuple(labels))
    keyed = keyset_rows.where(valid).withColumn("keyset", keyset)
    return (
        # Broadcast whatever the keysets' source: a Python data source (storage/log_source.py) gives the
        # planner no size, and a big batch would be joined as a Cartesian product, the source read per task.
        events.crossJoin(F.broadcast(keyed))
        .where(present)
        .withColumn("group_key", group_key)
        .withColumn("shard", shard)
        .drop("groupingKeyNames")
    )


@cache
def _routing_columns(session_kind: str, labels: tuple[int, ...]) -> tuple[Column, Column, Column, Column, Column]:
    """``fan_out``'s columns, built once per session kind (a classic session's are JVM objects a Spark
    Connect plan cannot carry) and shard labels: they are unresolved expressions of constant names, and
    building them is ~3,000 calls into the JVM, ~0.3-0.5 s at every gold start (docs/benchmarks.md)."""
    names = F.col("groupingKeyNames")
    parts = [_part(F.try_element_at(names, F.lit(i + 1))) for i in range(len(FIELD_COLUMNS))]
    # Parts past a keyset's size are null and skipped by concat_ws; a null part within it drops the event.
    present = reduce(operator.and_, [(F.size(names) <= i) | part.isNotNull() for i, part in enumerate(parts)])
    group_key = F.concat_ws("|", *[_escape(part) for part in parts])
    return F.size(names) <= len(FIELD_COLUMNS), F.array_join(names, ","), present, group_key, key_shard("keyset", "group_key", list(labels))


def key_shard(keyset: Column | str, group_key: Column | str, labels: list[int]) -> Column:
    """The label of the shard a (keyset, key) belongs to: events are routed by it, and a rescale moves each
    key's state by it (layers/rescale.py), so the two must be this one expression."""
    return shard_label(F.pmod(F.xxhash64(keyset, group_key), F.lit(len(labels))), labels)


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
