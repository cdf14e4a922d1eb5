"""The evaluator's settings and the limits they are checked against.

Kept free of Spark so the command line can check a flag value while it parses, before (and without)
anything heavy is imported; ``rulewatch.spark.gold`` uses the same class.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

from rulewatch.kafka.client import KafkaTopic
from rulewatch.engine.rules import parse_duration
from rulewatch.engine.shards import shard_labels

# An event time further than this past its own ingest time is quarantined. A future-dated event
# would otherwise drag the watermark ahead and make every on-time event after it "late"; with the
# tolerance no larger than gold's allowed lateness, no accepted event can move the watermark past
# the ingest clock (docs/reliability.md, "Watermark poisoning"). Covers producer clock skew only.
FUTURE_TOLERANCE_ENV = "RULEWATCH_FUTURE_TOLERANCE"
DEFAULT_FUTURE_TOLERANCE = "5m"


def switched_off(env: str) -> bool:
    """Whether the on-by-default switch ``env`` is set to 0, false, off or no (any case)."""
    return os.environ.get(env, "on").strip().lower() in {"0", "false", "off", "no"}


def connect_server_here(remote: str | None) -> bool:
    """Whether ``remote`` (``RULEWATCH_REMOTE``) asks for a Spark Connect server this process starts
    (``local[...]``): its Spark, its Python workers and its disk are this machine's."""
    return (remote or "").startswith("local")


def connect_server_elsewhere(remote: str | None) -> bool:
    """Whether ``remote`` names a Spark Connect server somewhere else (``sc://...``), whose Spark,
    classes and disk are its own; none (a classic session) is not."""
    return bool(remote) and not connect_server_here(remote)


class SettingError(ValueError):
    """An environment setting that is not a value it can take: names the variable, its value and the fix."""


def env_duration(env: str, default: str) -> str:
    """The duration ``env`` sets (``default`` when unset), checked: a typo stops the command with its name."""
    text = os.environ.get(env, default)
    try:
        parse_duration(text)
    except ValueError as err:
        raise SettingError(f"{env}={text!r} is not a duration ({err}); unset it for the default {default}") from None
    return text


def future_tolerance() -> str:
    """How far past its ingest time an event time may lie (``RULEWATCH_FUTURE_TOLERANCE``), as a duration."""
    return env_duration(FUTURE_TOLERANCE_ENV, DEFAULT_FUTURE_TOLERANCE)


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
    # 4 instead of 16 cut the evaluator's operator time 8-40 % here (docs/benchmarks.md, "One shard per
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
    # keys, docs/benchmarks.md). Off, the timers fire in the next data batch, this run's or the next one's.
    no_data_batches: bool = False
    # Which keys get a gold/window_metrics row per batch: "near" those whose batch peak reached
    # NEAR_LIMIT_SHARE of an upper limit (every key of the other rules), "all" every key touched.
    # A summary row per rule and batch counts every evaluated key either way. At a million keys a row per key
    # is most of what gold writes (its append ~1-2 s of a ~15 s gold layer here, docs/benchmarks.md).
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
