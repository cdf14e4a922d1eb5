"""Events travel to the evaluator packed: one row per shard per input chunk, its events as Arrow bytes.

Why: pyspark's ``transformWithStateInPandas`` turns every input row into a Python tuple and groups
the tuples by key one at a time (~15-20 µs a row on these cores), which cost more than the whole
evaluation at a million keys (docs/journal/benchmarks.md). Packing each partition's events per shard in a
stateless ``mapInArrow`` first hands the stateful operator a few hundred rows per batch instead of
one per event, and the evaluator unpacks them column by column. The shuffle then moves the same
bytes in fewer, larger rows.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
import pandas as pd
import pyarrow as pa
from pyspark.sql import DataFrame

PACKED_COLUMN = "events"
PACKED_SCHEMA = f"shard long, {PACKED_COLUMN} binary"

# Rows gathered before they are split by shard: bounds the memory a packing task holds, and keeps
# each packed row far below Arrow's 2 GB binary limit.
CHUNK_ROWS = 100_000


def pack(events: DataFrame) -> DataFrame:
    """``events`` (with a ``shard`` column) as one row per shard per chunk of an input partition."""
    return events.mapInArrow(pack_batches, PACKED_SCHEMA)


def pack_batches(batches: Iterable[pa.RecordBatch], chunk_rows: int = CHUNK_ROWS) -> Iterator[pa.RecordBatch]:
    pending: list[pa.RecordBatch] = []
    rows = 0
    for batch in batches:
        if batch.num_rows:
            pending.append(batch)
            rows += batch.num_rows
        if rows >= chunk_rows:
            yield _by_shard(pa.Table.from_batches(pending))
            pending, rows = [], 0
    if pending:
        yield _by_shard(pa.Table.from_batches(pending))


def _by_shard(table: pa.Table) -> pa.RecordBatch:
    shard = table.column("shard").to_numpy()
    order = np.argsort(shard, kind="stable")
    shard = shard[order]
    events = table.drop_columns(["shard"]).take(pa.array(order))
    starts = np.flatnonzero(np.r_[True, shard[1:] != shard[:-1]])
    ends = np.r_[starts[1:], len(shard)]
    blobs = [_ipc(events.slice(int(a), int(b - a))) for a, b in zip(starts, ends)]
    return pa.RecordBatch.from_arrays([pa.array(shard[starts], pa.int64()), pa.array(blobs, pa.binary())], names=["shard", PACKED_COLUMN])


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def unpack(blobs: Iterable[bytes]) -> pd.DataFrame:
    """The events of packed rows as one frame."""
    tables = [pa.ipc.open_stream(blob).read_all() for blob in blobs]
    return pa.concat_tables(tables).to_pandas()
