"""Packing events per shard (spark/evaluator/packing.py): every event reaches its own shard's evaluator call, once."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from rulewatch.spark.evaluator.packing import PACKED_COLUMN, pack_batches, unpack

# Integer columns with nulls arrive as float64, as from pyspark: exact up to 2**53 (event times in ms are ~2**41).
rows_st = st.lists(
    st.tuples(st.integers(0, 5), st.text(max_size=4), st.one_of(st.none(), st.integers(-(2**53), 2**53))),
    max_size=60,
)


def _batch(rows: list[tuple[int, str, int | None]]) -> pa.RecordBatch:
    shard, key, amount = zip(*rows) if rows else ((), (), ())
    return pa.RecordBatch.from_arrays(
        [pa.array(shard, pa.int64()), pa.array(key, pa.string()), pa.array(amount, pa.int64())], names=["shard", "group_key", "amount"]
    )


@settings(max_examples=200, deadline=None)
@given(batches=st.lists(rows_st, max_size=5), chunk_rows=st.integers(1, 50))
def test_each_shard_gets_exactly_its_events(batches, chunk_rows):
    packed = list(pack_batches([_batch(rows) for rows in batches], chunk_rows=chunk_rows))
    got: dict[int, list] = {}
    for batch in packed:
        assert batch.schema.names == ["shard", PACKED_COLUMN]
        shards = batch.column("shard").to_pylist()
        assert len(set(shards)) == len(shards)  # one row per shard per chunk
        for shard, blob in zip(shards, batch.column(PACKED_COLUMN).to_pylist()):
            frame = unpack([blob])
            assert list(frame.columns) == ["group_key", "amount"]
            got.setdefault(shard, []).extend(
                (k, None if a != a else int(a)) for k, a in zip(frame["group_key"], frame["amount"])
            )
    want: dict[int, list] = {}
    for rows in batches:
        for shard, key, amount in rows:
            want.setdefault(shard, []).append((key, amount))
    assert {s: sorted(v, key=repr) for s, v in got.items()} == {s: sorted(v, key=repr) for s, v in want.items()}
