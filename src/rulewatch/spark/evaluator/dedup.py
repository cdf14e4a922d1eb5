"""Silver's duplicate rule as keyed state: the first stateful operator of gold straight from the source.

Gold that reads the Kafka topic itself (layers/gold.py, ``_first_lines``) must evaluate only the
lines silver accepts, without waiting for silver. Lines are grouped by a hash of their transaction id
into a few shards (one call per shard and batch, not per id: a call per id costs milliseconds,
perf-notes.md); each shard holds its ids' accepted event times in a MapState and drops them by event-time
timers once the watermark passes their horizon (engine/dedup.py decides). Spark passes the watermark on
to the evaluator behind it; this operator gets the event time as plain milliseconds, not the
watermarked column, and passes late lines on: the evaluator records them as it does from silver.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Iterator

from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo, TimerValues
from pyspark.sql.types import LongType, StringType, StructField, StructType

from rulewatch.engine.dedup import bucket_end, decide, kept_times
from rulewatch.engine.identity import composed
from rulewatch.spark.evaluator.state_batch import BatchedMap, batched_map, pipeline_requested

if TYPE_CHECKING:
    import pandas as pd

_ID = StructType([StructField("id", StringType())])
_TIMES = StructType([StructField("times", StringType())])  # accepted event times in ms, comma-separated
_BUCKET_END = StructType([StructField("bucket_end", LongType())])  # ms: the timer's time, whatever the granularity then
_IDS = StructType([StructField("ids", StringType())])  # a JSON list: ids may hold any character

EVENT_MS = "event_ms"  # the line's event time in ms (not the watermarked column: see layers/gold.py)


class DedupProcessor(StatefulProcessor):
    """Passes on each line silver would accept (its ``output`` columns), drops its repeats."""

    def __init__(self, horizon_ms: int, granularity_ms: int, output: list[str], id_columns: list[str], order: list[str]) -> None:
        self.horizon_ms = horizon_ms
        self.granularity_ms = granularity_ms
        self.output = output
        self.id_columns = id_columns  # composed to NFC here, as silver does before it compares ids
        self.order = order  # silver's LINE_ORDER: which line of a batch comes first
        self.state_pipeline = pipeline_requested()  # read where the query is built, as RuleProcessor does

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self._seen_state = handle.getMapState("seen", _ID, _TIMES)
        self._due_state = handle.getMapState("due", _BUCKET_END, _IDS)
        self._maps: tuple[BatchedMap, BatchedMap] | None = None

    def _state(self) -> tuple[BatchedMap, BatchedMap]:
        if self._maps is None:
            self._maps = (batched_map(self._seen_state, self.state_pipeline), batched_map(self._due_state, self.state_pipeline))
        return self._maps

    def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame], timerValues: TimerValues) -> Iterator[pd.DataFrame]:
        import pandas as pd

        lines = pd.concat(list(rows), ignore_index=True).sort_values(self.order, kind="stable", na_position="first")
        for column in self.id_columns:
            lines[column] = lines[column].map(composed, na_action="ignore")
        seen, due = self._state()
        ids = lines["transaction_id"].tolist()
        event_ms = lines[EVENT_MS].tolist()
        distinct = list(dict.fromkeys(ids))
        earlier = {tid: _times(value) for tid, value in zip(distinct, seen.get_many([(tid,) for tid in distinct])) if value}
        decided = decide(ids, event_ms, earlier, self.horizon_ms, self.granularity_ms)
        seen.write_many([((tid,), (",".join(map(str, times)),)) for tid, times in decided.times.items()])
        ends = {bucket_end(bucket, self.granularity_ms): ids for bucket, ids in decided.due.items()}
        held = due.get_many([(end,) for end in ends])
        for end, value in zip(ends, held):
            if value is None:  # a new bucket: its timer drops its times once the watermark passes them
                self.handle.registerTimer(end)
        due.write_many([((end,), (json.dumps([*(json.loads(value[0]) if value else []), *ids]),)) for (end, ids), value in zip(ends.items(), held)])
        yield lines.loc[decided.accepted, self.output]

    def handleExpiredTimer(self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo) -> Iterator[pd.DataFrame]:
        at = expiredTimerInfo.getExpiryTimeInMs()
        seen, due = self._state()
        (value,) = due.get_many([(at,)])
        ids = list(dict.fromkeys(json.loads(value[0]))) if value else []
        kept = [kept_times(_times(times), at, self.horizon_ms) if times else [] for times in seen.get_many([(tid,) for tid in ids])]
        seen.write_many([((tid,), (",".join(map(str, times)),) if times else None) for tid, times in zip(ids, kept)])
        due.write_many([((at,), None)])
        return iter(())

    def close(self) -> None:
        pass


def _times(value: tuple[str] | None) -> list[int]:
    return [int(t) for t in value[0].split(",")] if value and value[0] else []
