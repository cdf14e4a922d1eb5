"""The evaluator's settings and the limits they are checked against.

Kept free of Spark so the command line can check a flag value while it parses, before (and without)
anything heavy is imported; ``rulewatch.spark.layers.gold`` uses the same class.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from rulewatch.kafka.client import KafkaTopic
from rulewatch.engine.rules import parse_duration
from rulewatch.spark.runtime.env import FUTURE_TOLERANCE_ENV, future_tolerance
from rulewatch.engine.shards import shard_labels

# Share of its limit a key's batch peak must reach to count as "near the limit" (GREATER and
# GREATER_EQUAL rules with a positive limit): rule_effectiveness counts such keys, and gold/window_metrics
# keeps a row only for them (and for every key of the other rules) unless told to keep every key.
NEAR_LIMIT_SHARE = 0.8
WINDOW_METRICS_KEYS = ("near", "all")
# The key sketches of gold/window_metrics' summary rows: hll_sketch_agg's default precision (~1.6 % standard error, exact in
# practice up to a few hundred keys). Sketches merge only at one precision: the table's, not a setting.
HLL_LG_CONFIG_K = 12


@dataclass(frozen=True)
class GoldSettings:
    # One shard per partition of the stateful stage at the local default of 4 partitions: each shard
    # call has fixed costs (its frames converted, its history generation written, its expiry index), and
    # 4 instead of 16 cut the evaluator's operator time 8-40 % here (docs/journal/benchmarks.md, "One shard per
    # stateful partition"). A cluster with more cores wants more (the bundle's gold_shards); a
    # checkpoint keeps the count it began with.
    shards: int = 4
    allowed_lateness: str = "1h"
    cleanup_granularity: str = "1m"
    max_files_per_trigger: int | None = None  # silver files per micro-batch (None: all available)
    state_slots: int = 0  # 0: the batch layout (history.py); N: keys hashed into N entries per shard
    alerts_topic: KafkaTopic | None = None  # also publish alerts here (at least once; kafka/alerts.py)
    # Gold runs in event-time mode: with Spark's no-data batches on, every batch that moves the watermark
    # is followed by an empty one that only fires the cleanup timers (they emit nothing). Live, the next
    # events wait behind it; a job run pays it once more before it ends (~5 s of a 20 s gold run at 10k
    # keys, docs/journal/benchmarks.md). Off, the timers fire in the next data batch, this run's or the next one's.
    no_data_batches: bool = False
    # Which keys get a gold/window_metrics row per batch: "near" those whose batch peak reached
    # NEAR_LIMIT_SHARE of an upper limit (every key of the other rules), "all" every key touched.
    # A summary row per rule and batch counts every evaluated key either way. At a million keys a row per key
    # is most of what gold writes (its append ~1-2 s of a ~15 s gold layer here, docs/journal/benchmarks.md).
    window_metrics: str = "near"
    # The stateful stage's partitions the shards' labels are spread over (engine.shards); start_gold
    # takes it from the checkpoint's record. 0: labels 0 .. shards-1, as before the record held it.
    shard_partitions: int = 0

    @property
    def layout(self) -> dict[str, int]:
        """What gold's checkpoint is bound to (checkpoints.check_gold_layout)."""
        return {"shards": self.shards, "state_slots": self.state_slots}

    @cached_property  # evaluated() fans events and rule changes out by it: computed once per settings
    def shard_labels(self) -> list[int]:
        """The values the evaluator groups its shards by."""
        return shard_labels(self.shards, self.shard_partitions)

    def __post_init__(self) -> None:
        if not 1 <= self.shards <= 4096:
            raise ValueError(f"shards must be between 1 and 4096, got {self.shards}")
        if not 0 <= self.state_slots <= 1_000_000:
            raise ValueError(f"state_slots must be between 0 and 1,000,000, got {self.state_slots}")
        if self.window_metrics not in WINDOW_METRICS_KEYS:
            raise ValueError(f"window_metrics must be one of {', '.join(WINDOW_METRICS_KEYS)}, got {self.window_metrics!r}")
        parse_duration(self.cleanup_granularity)
        if parse_duration(self.allowed_lateness) < parse_duration(future_tolerance()):
            raise ValueError(
                f"allowed lateness {self.allowed_lateness} is below silver's future tolerance "
                f"{future_tolerance()} ({FUTURE_TOLERANCE_ENV}): one event "
                "dated that far ahead could then make on-time events late. Raise the lateness or lower the tolerance."
            )
