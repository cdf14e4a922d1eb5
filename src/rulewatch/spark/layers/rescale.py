"""Rescale gold: move the evaluator's state from N shards to M without losing a window or repeating an alert.

A stateful query's state partitions are fixed by its checkpoint, so M shards need a new checkpoint.
Its first batch receives the old state through ``transformWithStateInPandas(initialState=...)``:

1. the old gold runs to the end of what is available (so its last batch is committed and nothing is pending);
2. the old checkpoint's state is read with the state data source (``format("statestore")``): every shard's
   rule book and history entries; the entries are unpacked into one blob per key (``history.stored_histories``)
   and each key is given its shard under M by the hash the events are routed with (``keying.fan_out``);
3. the old checkpoint is moved aside (kept for a roll-back) and the new one records where the old query
   stopped: each Delta source's next version, the watermark, and the batch number the tables go on from;
4. a ``rescale_gold`` command row gives the new query's first batch its input; that batch loads the state, then
   goes on with whatever silver holds beyond the old query's last batch.

Nothing is replayed: each key's history and memory (cooldowns, reported values, folded buckets) are the
bytes the old shard stored, so the evaluator goes on exactly as it would have. docs/scale.md has why this
way and not replaying silver.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from rulewatch.engine.engine import KEY_SEPARATOR
from rulewatch.engine.shards import shard_labels
from rulewatch.spark.control.commands import record_command
from rulewatch.spark.evaluator.history import GENERATION_KEYS, stored_histories, unrecorded_layout
from rulewatch.spark.evaluator.keying import key_shard
from rulewatch.spark.evaluator.settings import GoldSettings
from rulewatch.spark.layers.gold import SHUFFLE_PARTITIONS, start_gold
from rulewatch.spark.runtime.session import session_confs
from rulewatch.spark.storage import tables
from rulewatch.spark.storage.checkpoints import (
    BATCH_BASE,
    GOLD_LAYOUT,
    GOLD_SOURCE,
    RESCALED_FROM,
    SHARD_PARTITIONS,
    SILVER_AFTER_BATCH,
    SOURCE_IDS,
    STARTING_VERSIONS,
    WATERMARK_FLOOR,
    batch_base,
    check_queries,
    committed_sources,
    gold_record,
    has_run,
)
from rulewatch.spark.storage.delta_log import CheckpointError
from rulewatch.spark.storage.lakehouse import Lakehouse

RESCALE_COMMAND = "rescale_gold"
_STAGED = "rulewatch-rescale-state"  # the new shards' initial state, in the new checkpoint until its first batch
_INITIAL_STATE = "shard long, book string, entries array<struct<state_key: string, blob: binary>>"


@dataclass(frozen=True)
class Rescaled:
    shards_before: int
    shards: int
    keys: int
    kept_at: str  # the old checkpoint, moved aside
    batch: int  # the old query's last batch; the new one's go on from the next


def staged(checkpoint: str) -> Path:
    """Where a rescale builds the new checkpoint before it takes the old one's place."""
    return Path(checkpoint + ".rescale")


def rescale_gold(
    spark: SparkSession,
    lakehouse: Lakehouse,
    shards: int,
    settings: GoldSettings = GoldSettings(),
    shuffle_partitions: int | None = None,
    say: Callable[[str], None] = print,
) -> Rescaled:
    """Move gold's state to ``shards`` shards over ``shuffle_partitions`` state partitions (default: one per shard).

    ``settings``: the evaluator's other settings (lateness, metrics, topic); its shard count is ignored.
    Run it again after a failure: it finishes a rescale whose new checkpoint has not run yet."""
    checkpoint = lakehouse.checkpoint("gold")
    if "://" in checkpoint:
        raise CheckpointError(f"gold rescale reads and moves checkpoint files; {checkpoint} is no local or mounted path")
    staging = staged(checkpoint)
    if not Path(checkpoint).exists() and (staging / GOLD_LAYOUT).is_file():
        # Stopped between moving the old checkpoint aside and putting the new one in its place.
        staging.rename(checkpoint)
    record = gold_record(checkpoint)
    if STARTING_VERSIONS in record and not has_run(checkpoint):
        say(f"finishing the rescale to {record['shards']} shards that did not run its first batch")
        return _first_batch(spark, lakehouse, replace(settings, shards=int(record["shards"]), state_slots=int(record["state_slots"])), record)
    if not has_run(checkpoint):
        raise CheckpointError(f"gold has not run on {lakehouse.root} yet: give `rulewatch run` --shards {shards} instead")
    if record.get(GOLD_SOURCE, "silver") != "silver":  # its offsets are a topic's, the state's moves are silver's
        raise CheckpointError(f"gold on {lakehouse.root} reads {record[GOLD_SOURCE]} itself; a rescale moves only a gold that reads silver")
    before = replace(settings, shards=int(record.get("shards", settings.shards)), state_slots=int(record.get("state_slots", 0)))
    if before.shards == shards:
        raise CheckpointError(f"gold already runs {shards} shards on {lakehouse.root}")

    say(f"bringing gold up to date with its {before.shards} shards")
    check_queries(lakehouse, "gold", spark=spark)
    query = start_gold(spark, lakehouse, before)
    query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"gold failed before the rescale: {query.exception()}")

    last, watermark, read = committed_sources(checkpoint)
    base = batch_base(checkpoint)
    # A source that has read nothing yet goes on from where its query started it: a rescaled one's
    # recorded version, else its first. A rescaled query that has seen no event yet keeps its floor.
    started = record.get(STARTING_VERSIONS) or {}
    ids = {name: _table_id(spark, table) for name, table in _sources(lakehouse).items()}
    versions = {name: read.get(ids[name], started.get(name, 0)) for name in ids}
    watermark = max(watermark, int(record.get(WATERMARK_FLOOR, 0)))
    partitions = shuffle_partitions or shards
    labels = shard_labels(shards, partitions)
    shutil.rmtree(staging, ignore_errors=True)
    say(f"reading the state of gold batch {last + base} from {checkpoint}")
    keys = _write_initial_state(spark, checkpoint, last, labels, unrecorded_layout(before.state_slots, fresh=False), str(staging / _STAGED))
    newest = committed_sources(checkpoint)[0]
    if newest != last:
        raise CheckpointError(f"gold ran batch {newest} while its state was read: stop every other run on {lakehouse.root}, then rescale again")

    kept_at = f"{checkpoint}.before-rescale-{time.strftime('%Y%m%d-%H%M%S')}-batch-{last + base}"
    new_record = {
        "shards": shards,
        "state_slots": before.state_slots,
        SHARD_PARTITIONS: partitions,
        BATCH_BASE: last + 1 + base,
        WATERMARK_FLOOR: watermark,
        STARTING_VERSIONS: versions,
        SOURCE_IDS: ids,
        # Silver's rows the old query read up to its next version: where that version is not committed
        # yet, the new query starts at the one before and skips them by batch id (gold.Continued).
        SILVER_AFTER_BATCH: _newest_batch(spark, lakehouse.silver_transactions, versions["silver"] - 1),
        RESCALED_FROM: {"shards": before.shards, "checkpoint": kept_at, "keys": keys},
    }
    (staging / GOLD_LAYOUT).write_text(json.dumps(new_record) + "\n", encoding="utf-8")
    # From here the old checkpoint is kept aside and the new one waits for its first batch; a start
    # other than this command's refuses to run it (checkpoints.check_gold_layout) until it has.
    Path(checkpoint).rename(kept_at)
    staging.rename(checkpoint)
    say(f"moved the old checkpoint aside to {kept_at}")
    return _first_batch(spark, lakehouse, replace(settings, shards=shards, state_slots=before.state_slots), new_record)


def _first_batch(spark: SparkSession, lakehouse: Lakehouse, settings: GoldSettings, record: dict) -> Rescaled:
    checkpoint = lakehouse.checkpoint("gold")
    state = Path(checkpoint, _STAGED)
    if not state.is_dir():
        raise CheckpointError(f"the rescale's staged state {state} is gone; restore gold's checkpoint from {record[RESCALED_FROM]['checkpoint']}")
    record_command(spark, lakehouse, RESCALE_COMMAND)
    with session_confs(spark, {SHUFFLE_PARTITIONS: str(record[SHARD_PARTITIONS])}):
        query = start_gold(spark, lakehouse, settings, initial_state=spark.read.parquet(str(state)))
    query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"gold's first batch on {settings.shards} shards failed (run the rescale again to retry): {query.exception()}")
    shutil.rmtree(state)
    was = record[RESCALED_FROM]
    return Rescaled(was["shards"], settings.shards, was["keys"], was["checkpoint"], record[BATCH_BASE] - 1)


def _sources(lakehouse: Lakehouse) -> dict[str, str]:
    return {"silver": lakehouse.silver_transactions, "rules": lakehouse.rules, "commands": lakehouse.rule_commands}


def _table_id(spark: SparkSession, table: str) -> str | None:
    if not tables.exists(spark, table):
        return None
    return spark.sql(f"DESCRIBE DETAIL {tables.table_ref(table)}").first()["id"]


def _newest_batch(spark: SparkSession, table: str, version: int) -> int:
    """The newest ``silver_batch_id`` in silver as of ``version`` (-1: none)."""
    if version < 0:
        return -1
    newest = tables.read(spark, table, version=version).agg(F.max("silver_batch_id")).first()[0]
    return -1 if newest is None else int(newest)


def _state(spark: SparkSession, checkpoint: str, batch: int, variable: str) -> DataFrame:
    # Pinned to the batch the sources' versions were read from.
    return spark.read.format("statestore").option("batchId", batch).option("stateVarName", variable).load(checkpoint)


def _write_initial_state(spark: SparkSession, checkpoint: str, batch: int, labels: list[int], unrecorded: str, out: str) -> int:
    """Write the new shards' initial state (``_INITIAL_STATE`` rows) to ``out``; returns the keys moved.

    Every shard gets the rule book (the old shards hold one and the same); each key goes to its shard
    under the new labels, in rows of at most GENERATION_KEYS keys."""
    # A state read needs the state store coordinator, which Spark starts with the session's first
    # streaming query; without it the read fails with CANNOT_LOAD_STATE_STORE (the query manager starts it).
    spark.streams.active
    books = {row.value.text for row in _state(spark, checkpoint, batch, "rules").collect()}
    if len(books) != 1:
        raise CheckpointError(f"the shards of {checkpoint} hold {len(books)} different rule books; gold cannot be rescaled from it")
    layouts = {row.key.shard: row.value.text for row in _state(spark, checkpoint, batch, "layout").collect()}
    entries = _state(spark, checkpoint, batch, "history").select(
        F.col("key.shard").alias("old"), F.col("user_map_key.key").alias("entry"), F.col("user_map_value.blob").alias("blob")
    )

    def unpacked(frame):  # type: ignore[no-untyped-def]
        import pandas as pd

        # A shard whose state predates the layout record (and has not run since) has none: its old layout.
        stored = stored_histories(dict(zip(frame["entry"], frame["blob"])), layouts.get(int(frame["old"].iloc[0]), unrecorded))
        return pd.DataFrame({"state_key": list(stored), "blob": list(stored.values())})

    keyed = entries.groupBy("old").applyInPandas(unpacked, "state_key string, blob binary").cache()
    try:
        count = keyed.count()
        keyset = F.substring_index("state_key", KEY_SEPARATOR, 1)
        group_key = F.substr(F.col("state_key"), F.length(keyset) + 2)
        chunks = max(1, -(-count // (len(labels) * GENERATION_KEYS)))
        (book,) = books
        moved = (
            keyed.select(
                key_shard(keyset, group_key, labels).alias("shard"),
                F.pmod(F.xxhash64("state_key"), F.lit(chunks)).alias("chunk"),
                F.struct("state_key", "blob").alias("entry"),
            )
            .groupBy("shard", "chunk")
            .agg(F.collect_list("entry").alias("entries"))
            .select("shard", F.lit(book).alias("book"), "entries")
        )
        every_shard = spark.createDataFrame([(label, book, []) for label in labels], _INITIAL_STATE)
        moved.unionByName(every_shard).write.mode("overwrite").parquet(out)
    finally:
        keyed.unpersist()
    return count
