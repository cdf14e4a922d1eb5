"""``rulewatch demo``: live mode fed by the generator, with a rule edited on the way, scored against
the generator's labels (every pattern caught, how fast, the rule change's arrival)."""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from rulewatch.spark.live import generate
from rulewatch.spark.storage import tables
from rulewatch.spark.layers.bronze import Source
from rulewatch.kafka import consume
from rulewatch.kafka.client import KafkaTopic, ensure_topic
from rulewatch.kafka.produce import TopicWriter
from rulewatch.kafka.source import KafkaSource
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.storage.metrics import percentile
from rulewatch.spark.live.monitor import Alert, LayerProgress, Log, _batch_summary, _monitor, _show, _wait_started, follow, latency_summary
from rulewatch.spark.live.streams import LiveSettings, start_streams, stop_streams


ROOT = Path(__file__).resolve().parents[4]
DEMO_RULES = [ROOT / "fixtures" / "rules.json", ROOT / "fixtures" / "live_rules.json"]


@dataclass
class PatternScore:
    pattern: str
    rule_id: int
    injected: int = 0
    caught: int = 0
    detection_ms: list[int] = field(default_factory=list)  # instance start -> its first alert

    @property
    def missed(self) -> int:
        return self.injected - self.caught


@dataclass
class Score:
    patterns: dict[str, PatternScore]
    false_positives: list[Alert]

    def lines(self) -> list[str]:
        out = []
        for s in self.patterns.values():
            delay = f", detected {percentile(s.detection_ms, 50) / 1000:.1f}s after start (median)" if s.detection_ms else ""
            out.append(f"  {s.pattern:<15} rule {s.rule_id}: injected {s.injected}, caught {s.caught}, missed {s.missed}{delay}")
        keys = sorted({(a.rule_id, a.group_key) for a in self.false_positives})
        out.append(f"  false positives: {len(self.false_positives)} alert(s) on {len(keys)} unlabelled key(s)")
        out += [f"    rule {rule_id} key {key}" for rule_id, key in keys[:10]]
        return out


def score(alerts: list[Alert], labels: list[generate.Label]) -> Score:
    """An instance is caught if its rule alerted on its key; an alert on no labelled (rule, key) is a false positive."""
    first: dict[tuple[int, str], int] = {}
    for a in alerts:
        key = (a.rule_id, a.group_key)
        first[key] = min(first.get(key, a.decision_ms), a.decision_ms)
    patterns = {p: PatternScore(p, generate.PATTERN_RULES[p]) for p in generate.PATTERNS}
    for label in labels:
        s = patterns[label.pattern]
        s.injected += 1
        decided = first.get((label.rule_id, label.group_key))
        if decided is not None:
            s.caught += 1
            s.detection_ms.append(decided - label.start_ms)
    labelled = {(label.rule_id, label.group_key) for label in labels}
    return Score(patterns, [a for a in alerts if (a.rule_id, a.group_key) not in labelled])


@dataclass(frozen=True)
class GoldBatch:
    batch_id: int
    start_ms: int
    end_ms: int  # its alerts, metrics and state committed


@dataclass(frozen=True)
class RuleChangeTiming:
    """A rule edited mid-demo; the first gold batch that ran with it, and the first that evaluated
    events with it (later if no event was waiting then: events arrive with silver's commits)."""

    rule_id: int
    version: int  # its config/rules commit
    committed_ms: int
    applied: GoldBatch | None = None  # None: no gold batch ran with it before the demo ended
    evaluated: GoldBatch | None = None

    def line(self) -> str:
        head = f"rule change -> evaluator: rule {self.rule_id} edited (commit {self.version})"
        if self.applied is None:
            return f"{head}, no gold batch ran with it before the end"
        parts = [f"{head}, applied by {self._timed(self.applied)}"]
        if self.evaluated != self.applied:
            parts.append(f"first events evaluated with it by {self._timed(self.evaluated)}" if self.evaluated else "no event evaluated with it")
        return "; ".join(parts)

    def _timed(self, batch: GoldBatch) -> str:
        return (
            f"gold batch {batch.batch_id} (started {(batch.start_ms - self.committed_ms) / 1000:.2f}s, "
            f"committed {(batch.end_ms - self.committed_ms) / 1000:.2f}s after the rules commit)"
        )


def edit_a_rule(spark: SparkSession, lakehouse: Lakehouse) -> RuleChangeTiming | None:
    """Edit the first rule's description in ``config/rules``, as an analyst would mid-run.

    Only the description changes, so detection is unaffected; the commit still reaches every shard
    as a rule change, which is what the timing follows (None if there is no rule to edit).
    """
    from rulewatch.engine.rules import parse_rules
    from rulewatch.spark.control.rules_table import apply_rules, export_rules

    rules = export_rules(spark, lakehouse)
    if not rules:
        return None
    rule = rules[0]
    description = re.sub(r" ?\[edited live [0-9:]+\]$", "", rule.get("description") or "")
    edited = {**rule, "description": f"{description} [edited live {time.strftime('%H:%M:%S')}]".strip()}
    apply_rules(spark, lakehouse, parse_rules([edited]), updated_by="rulewatch demo")
    commit = tables.latest_commit(spark, lakehouse.rules)
    return RuleChangeTiming(rule["ruleId"], commit["version"], round(commit["timestamp"].timestamp() * 1000))


def first_evaluation(spark: SparkSession, lakehouse: Lakehouse, change: RuleChangeTiming) -> RuleChangeTiming:
    """``change`` with the first gold batches whose evaluator ran with its commit (``rules_version``),
    with and without events."""
    timed = F.struct("batch_id", F.unix_millis("batch_start").alias("start_ms"), F.unix_millis("batch_end").alias("end_ms"))
    batches = (
        tables.read(spark, lakehouse.pipeline_metrics)
        .where((F.col("layer") == "gold") & (F.col("rules_version") >= change.version))
        .agg(
            F.min_by(timed, "batch_id").alias("applied"),
            F.min_by(timed, F.when(F.col("rows_in") > 0, F.col("batch_id"))).alias("evaluated"),
        )
        .first()
    )
    applied, evaluated = (GoldBatch(**batch.asDict()) if batch else None for batch in (batches.applied, batches.evaluated))
    return replace(change, applied=applied, evaluated=evaluated)


@dataclass
class DemoReport:
    generated: generate.GenerateResult
    score: Score
    alerts: list[Alert]  # this run's, as the monitor saw them commit
    latency_ms: list[int]
    event_latency_ms: list[int]
    caught_up: bool
    drain_seconds: float  # generator end -> streams caught up: ~one pass through the layers unless a backlog grew
    layers: dict[str, LayerProgress]
    rule_change: RuleChangeTiming | None = None
    topic_latency_ms: list[int] | None = None  # ingest -> alert record on the alert topic (None: no alert topic)
    steps: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # batch_steps'

    def lines(self) -> list[str]:
        g = self.generated
        return [
            f"generated {g.events:,} events in {g.seconds:.0f}s ({g.rate:,.0f}/s), {g.labels} injected pattern instance(s)",
            f"streams caught up {self.drain_seconds:.1f}s after the generator stopped"
            if self.caught_up
            else f"streams had NOT caught up {self.drain_seconds:.0f}s after the generator stopped (backlog)",
            "detection per injected pattern:",
            *self.score.lines(),
            f"ingest -> alert latency: {latency_summary(self.latency_ms)}",
            *([f"ingest -> alert on the topic: {latency_summary(self.topic_latency_ms)}"] if self.topic_latency_ms is not None else []),
            f"event  -> alert latency: {latency_summary(self.event_latency_ms)}",
            *([self.rule_change.line()] if self.rule_change else []),
            "micro-batches that read rows (count, median and max time, where the time went):",
            *[f"  {name:<6} {_batch_summary(layer)}" for name, layer in self.layers.items()],
            *(["inside those batches, each step's median and max (steps run at once overlap):"] if self.steps else []),
            *[f"  {layer:<6} {_steps_summary(steps)}" for layer, steps in self.steps.items()],
        ]


def _steps_summary(steps: dict[str, list[int]]) -> str:
    ordered = sorted(steps.items(), key=lambda item: -(percentile(item[1], 50) or 0))
    return ", ".join(f"{name} {percentile(ms, 50) / 1000:.2f}/{max(ms) / 1000:.2f}s" for name, ms in ordered)


def batch_steps(spark: SparkSession, lakehouse: Lakehouse, since: datetime) -> dict[str, dict[str, list[int]]]:
    """Per layer, each step's milliseconds (``pipeline_metrics.step_ms``) in the batches that read rows
    and started at ``since`` or later, in data-flow order."""
    rows = (
        tables.read(spark, lakehouse.pipeline_metrics)
        .where((F.col("batch_start") >= since) & (F.col("rows_in") > 0) & F.col("step_ms").isNotNull())
        .select("layer", "step_ms")
        .collect()
    )
    found: dict[str, dict[str, list[int]]] = {}
    for row in rows:
        for step, ms in row.step_ms.items():
            found.setdefault(row.layer, {}).setdefault(step, []).append(ms)
    return {layer: found[layer] for layer in ("bronze", "silver", "gold") if layer in found}


def demo(
    spark: SparkSession,
    lakehouse: Lakehouse,
    landing: Path | KafkaSource,
    labels: Path,
    config: generate.GeneratorConfig,
    settings: LiveSettings = LiveSettings(),
    drain_timeout: float = 120,
    log: Log = print,
) -> DemoReport:
    """Start the streams, then the generator; follow both; let the streams drain; score and summarise.

    Halfway through the traffic a rule is edited (``edit_a_rule``) and the report times how soon
    gold evaluated with it. The caller applies the rules first (``DEMO_RULES``). Ctrl-C stops the
    generator and the streams cleanly and still reports what was scored so far.

    ``landing``: a folder the generator writes files into, or a Kafka topic it produces to.
    """
    if isinstance(landing, KafkaSource):
        ensure_topic(landing.topic)  # the source needs it before the first event
        source: Source = landing
    else:
        generate.check_folders(landing, labels)
        landing.mkdir(parents=True, exist_ok=True)  # the file source refuses a folder that does not exist yet
        source = str(landing)
    monitor = _monitor(spark, lakehouse)
    started = datetime.now(timezone.utc)
    streams = start_streams(spark, lakehouse, source, settings)
    streams.watched_by(monitor)
    stop = threading.Event()
    result: list[generate.GenerateResult] = []
    change: RuleChangeTiming | None = None
    caught_up, drain_seconds = False, 0.0
    try:
        log("waiting for the streams' first micro-batch ...")
        _wait_started(monitor)
        log(f"generating {config.rate:,.0f} events/s for {config.duration:.0f}s (run {config.run_id})")
        generator = threading.Thread(target=lambda: result.append(_generate(config, landing, labels, stop)), daemon=True)
        generator.start()
        edit_at = time.monotonic() + config.duration / 2
        follow(monitor, lambda: not generator.is_alive() or time.monotonic() >= edit_at, log)
        if generator.is_alive():
            change = edit_a_rule(spark, lakehouse)
            if change:
                log(f"rules: edited rule {change.rule_id}'s description (commit {change.version}); timing its first evaluation")
            follow(monitor, lambda: not generator.is_alive(), log)
        generator_end = time.monotonic()
        landed = result[0].events if result else 0
        log(f"generator done ({landed:,} events); letting the streams catch up ...")
        follow(monitor, lambda: monitor.caught_up(landed) or time.monotonic() > generator_end + drain_timeout, log)
        caught_up, drain_seconds = monitor.caught_up(landed), time.monotonic() - generator_end
    except KeyboardInterrupt:
        log("interrupted: stopping the generator and the streams")
    finally:
        stop.set()
        stop_streams(streams)
    _show(monitor.poll(stopped=True), log)  # the last batches' alerts: their metrics rows are in now
    run_prefix = f"{config.run_id}-"
    alerts = [a for a in monitor.alerts if a.transaction_id.startswith(run_prefix)]
    run_labels = [label for label in generate.read_labels(labels) if label.transaction_ids[0].startswith(run_prefix)]
    return DemoReport(
        generated=result[0] if result else generate.GenerateResult(0, 0, 0, 0.0),
        score=score(alerts, run_labels),
        alerts=alerts,
        latency_ms=[a.latency_ms for a in alerts if a.latency_ms is not None],
        event_latency_ms=[a.event_latency_ms for a in alerts],
        caught_up=caught_up,
        drain_seconds=drain_seconds,
        layers=monitor.layers,
        rule_change=first_evaluation(spark, lakehouse, change) if change else None,
        topic_latency_ms=None if settings.gold.alerts_topic is None else topic_latencies(settings.gold.alerts_topic, run_prefix),
        steps=batch_steps(spark, lakehouse, started),
    )


def topic_latencies(topic: KafkaTopic, run_prefix: str) -> list[int]:
    """Per alert of this run on ``topic``: its first record's timestamp minus the event's ingest time, in ms
    (a replayed batch publishes an alert again; the first record is when downstream could act)."""
    first: dict[str, int] = {}
    for stamp, value in consume.held(topic):
        alert = json.loads(value)
        if alert["transaction_id"].startswith(run_prefix) and alert.get("ingest_time"):
            ingest = datetime.fromisoformat(alert["ingest_time"].replace("Z", "+00:00"))
            first.setdefault(alert["alert_id"], stamp - round(ingest.timestamp() * 1000))
    return list(first.values())


def _generate(config: generate.GeneratorConfig, landing: Path | KafkaSource, labels: Path, stop: threading.Event) -> generate.GenerateResult:
    if isinstance(landing, Path):
        return generate.run(config, landing, labels, stop)
    with TopicWriter(landing.topic) as writer:
        return generate.run(config, writer, labels, stop)
