"""The stateful processor Spark pickles for gold: its state declared here, its work in shard.py.

Spark starts a Python process on the driver at every query start only to learn the processor's
state variables (``init``). This module imports no pandas or numpy, so that process does not pay
~0.5 s for them (docs/journal/benchmarks.md); a shard loads the evaluator on its first call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo, TimerValues
from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType

from rulewatch.spark.evaluator.state_batch import pipeline_requested

if TYPE_CHECKING:
    import pandas as pd

    from rulewatch.spark.evaluator.shard import ShardEvaluator

_KEY = StructType([StructField("key", StringType())])
_BLOB = StructType([StructField("blob", BinaryType())])
_TEXT = StructType([StructField("text", StringType())])
_TIME = StructType([StructField("at", LongType())])


class RuleProcessor(StatefulProcessor):
    """Evaluates every active rule on every event of a shard over its exact look-back window."""

    def __init__(
        self,
        cleanup_granularity_ms: int = 60_000,
        state_slots: int = 0,
        lateness_ms: int | None = None,
        watermark_floor_ms: int = 0,
        error_shard: int = 0,
    ) -> None:
        self.granularity = cleanup_granularity_ms
        self.state_slots = state_slots
        # The query's watermark delay (None: unknown): the next batch's watermark is at least this
        # batch's newest event time minus it, so keys expiring before that need not be written.
        self.lateness_ms = lateness_ms
        # No watermark below this: a rescaled gold's new query goes on from the old one's (layers/rescale.py).
        self.watermark_floor_ms = watermark_floor_ms
        # The one shard that reports rule errors (every shard applies every change): the first label, which
        # is 0 only when the labels are not spread over more partitions than shards (engine.shards).
        self.error_shard = error_shard
        # Read where the query is built (driver or Connect client) and pickled with the processor:
        # the Python workers' environment is not the caller's to set.
        self.state_pipeline = pipeline_requested()

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.rules = handle.getValueState("rules", _TEXT)
        self.history_map = handle.getMapState("history", _KEY, _BLOB)
        self.layout = handle.getValueState("layout", _TEXT)
        self.expiry = handle.getMapState("expiry", _TIME, _TEXT)
        self._shard: ShardEvaluator | None = None

    def _evaluator(self) -> ShardEvaluator:
        if self._shard is None:
            from rulewatch.spark.evaluator.shard import ShardEvaluator

            self._shard = ShardEvaluator(self)
        return self._shard

    def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame], timerValues: TimerValues) -> Iterator[pd.DataFrame]:
        return self._evaluator().handle_rows(key, rows, timerValues)

    def handleInitialState(self, key: Any, initialState: pd.DataFrame, timerValues: TimerValues) -> None:
        self._evaluator().handle_initial_state(initialState)

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[pd.DataFrame]:
        return self._evaluator().handle_timer(timerValues, expiredTimerInfo)

    def close(self) -> None:
        pass
