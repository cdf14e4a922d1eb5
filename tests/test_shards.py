"""Gold's shards are grouped by labels that Spark's shuffle spreads evenly over the stateful stage's partitions."""

from __future__ import annotations

import random

import pytest

from rulewatch.engine.shards import _spark_hash_long, shard_labels

SHAPES = [(16, 4), (4, 4), (2, 2), (16, 16), (3, 8), (5, 1), (64, 7), (4096, 200)]


@pytest.mark.parametrize(("shards", "partitions"), SHAPES)
def test_every_partition_gets_its_share_of_distinct_labels(shards, partitions):
    labels = shard_labels(shards, partitions)
    assert len(labels) == shards and len(set(labels)) == shards
    per_partition = [sum(1 for label in labels if _spark_hash_long(label) % partitions == p) for p in range(partitions)]
    assert max(per_partition) - min(per_partition) <= 1, per_partition


def test_no_spread_keeps_the_numbering_of_older_checkpoints():
    assert shard_labels(16, 0) == list(range(16))


@pytest.mark.jvm
def test_the_hash_is_sparks_own(spark):
    from pyspark.sql import functions as F

    rng = random.Random(7)
    values = [0, 1, -1, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63)] + [rng.randrange(-(2**63), 2**63) for _ in range(200)]
    rows = spark.createDataFrame([(v,) for v in values], "v long").select("v", F.hash("v").alias("h")).collect()
    assert {r.v: r.h for r in rows} == {v: _spark_hash_long(v) for v in values}


@pytest.mark.jvm
@pytest.mark.parametrize(("shards", "partitions"), [(16, 4), (4, 4), (2, 2), (3, 8)])
def test_sparks_shuffle_puts_shard_i_in_partition_i_mod_partitions(spark, shards, partitions):
    # A stateful operator's input is hash-partitioned by its grouping column, as repartition(n, column) is.
    from pyspark.sql import functions as F

    from rulewatch.spark.evaluator.keying import shard_label

    placed = (
        spark.range(shards)
        .select(F.col("id").alias("number"), shard_label(F.col("id"), shard_labels(shards, partitions)).alias("shard"))
        .repartition(partitions, "shard")
        .select("number", F.spark_partition_id().alias("partition"))
        .collect()
    )
    assert sorted((r.number, r.partition) for r in placed) == [(i, i % partitions) for i in range(shards)]
