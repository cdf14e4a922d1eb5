"""The values gold groups its hash shards by, so that Spark's shuffle gives each partition its share.

Pure Python (the command line's settings use it before Spark is imported); ``spark.evaluator.keying`` turns
the labels into a column.
"""

from __future__ import annotations


def shard_labels(shards: int, partitions: int) -> list[int]:
    """The value each shard is grouped by, chosen so the stateful stage's partitions share the shards evenly.

    Spark places the group of value v in partition ``pmod(murmur3(v), partitions)``. Grouped by
    0 .. shards-1 that spreads unevenly (16 shards over 4 partitions: 6, 6, 1 and 3; 2 over 2: both in
    one), and the busiest partition sets the stage's time. Here shard i gets the smallest unused long
    that lands in partition ``i % partitions``. ``partitions`` 0 gives 0 .. shards-1, the labels of
    checkpoints from before the spread (their state is keyed by them)."""
    if partitions <= 0:
        return list(range(shards))
    found: dict[int, list[int]] = {p: [] for p in range(partitions)}
    wanted = {p: len(range(p, shards, partitions)) for p in range(partitions)}
    value, remaining = 0, shards
    while remaining:
        partition = _spark_hash_long(value) % partitions
        if len(found[partition]) < wanted[partition]:
            found[partition].append(value)
            remaining -= 1
        value += 1
    return [found[i % partitions][i // partitions] for i in range(shards)]


def _spark_hash_long(value: int, seed: int = 42) -> int:
    """Spark's ``hash()`` of a long (Murmur3_x86_32.hashLong, the hash its shuffle partitions by)."""
    h1 = seed
    for word in (value & 0xFFFFFFFF, (value >> 32) & 0xFFFFFFFF):
        k1 = (word * 0xCC9E2D51) & 0xFFFFFFFF
        k1 = ((k1 << 15) | (k1 >> 17)) & 0xFFFFFFFF
        k1 = (k1 * 0x1B873593) & 0xFFFFFFFF
        h1 ^= k1
        h1 = ((h1 << 13) | (h1 >> 19)) & 0xFFFFFFFF
        h1 = (h1 * 5 + 0xE6546B64) & 0xFFFFFFFF
    h1 ^= 8
    h1 ^= h1 >> 16
    h1 = (h1 * 0x85EBCA6B) & 0xFFFFFFFF
    h1 ^= h1 >> 13
    h1 = (h1 * 0xC2B2AE35) & 0xFFFFFFFF
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1
