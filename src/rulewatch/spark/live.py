"""Live mode: the pipeline as continuous streams (``rulewatch stream``), with a generator (``rulewatch demo``).

Two queries run on processing-time triggers: ingest (landing -> bronze + silver in one
micro-batch, ingest.py) and gold, the same query the batch job uses. A monitor on the driver
turns their progress and the new rows of ``gold/alerts`` into a progress line, and the demo scores the alerts against the generator's labels. Stopping (Ctrl-C, or the end
of a demo) stops each query between micro-batches, so the checkpoints stay usable and the next
start continues from them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

from pyspark.sql import Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.streaming.listener import StreamingQueryProgress

from rulewatch.cli import arguments
from rulewatch.spark import generate, tables
from rulewatch.spark.bronze import Source, check_source
from rulewatch.spark.checkpoints import check_gold_layout, check_queries
from rulewatch.spark.gold import SHUFFLE_PARTITIONS, GoldSettings, start_gold
from rulewatch.spark.ingest import start_ingest
from rulewatch.kafka import arguments as kafka_arguments
from rulewatch.kafka.client import ensure_topic
from rulewatch.kafka.health import Watch, check_topic
from rulewatch.kafka.produce import TopicWriter
from rulewatch.kafka.source import KafkaSource
from rulewatch.spark.lakehouse import Lakehouse, is_table_name, table_ref
from rulewatch.spark.metrics import Recorder, kept_rows, percentile
from rulewatch.spark.pipeline import ensure_all_tables
from rulewatch.spark.session import is_connect, session_confs

LAYERS = ("ingest", "gold")
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
ROOT = Path(__file__).resolve().parents[3]
DEMO_RULES = [ROOT / "fixtures" / "rules.json", ROOT / "fixtures" / "live_rules.json"]
Log = Callable[[str], None]


@dataclass(frozen=True)
class LiveSettings:
    trigger: str = "0 seconds"  # each query starts its next micro-batch as soon as the last one ends
    gold: GoldSettings = GoldSettings()
    shuffle_partitions: int | None = None  # for these queries; a stateful checkpoint keeps the value it began with
    metrics_every: float = 30.0  # seconds between pipeline_metrics commits; 0: each batch commits its own rows


@dataclass
class Streams:
    """The running queries, in data-flow order, and what gathers their metrics rows."""

    spark: SparkSession
    queries: list[StreamingQuery]
    recorders: list[Recorder]
    feed: AlertFeed | None = None  # gold's alerts as they commit (a classic session)


class AlertFeed:
    """Gold's alerts handed over in this process as each batch commits them (``gold.AlertsCommitted``),
    so the monitor shows them without reading ``gold/alerts``: each read is Spark jobs on the cores
    the queries use, and a classic session's ``foreachBatch`` already has the rows."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batches: dict[int, tuple[int, list[Row]]] = {}

    def __call__(self, batch_id: int, batch_end: datetime, alerts: list[Row]) -> None:
        with self._lock:
            self._batches[batch_id] = (_unix_ms(batch_end), alerts)

    def take(self) -> dict[int, tuple[int, list[Row]]]:
        """Batch id -> (its alerts' commit time, unix ms; the alerts), for the batches handed over since the last call."""
        with self._lock:
            batches, self._batches = self._batches, {}
        return batches

    def __getstate__(self) -> dict:
        # Where foreachBatch runs in another process, the function is pickled with this feed: the
        # copy there is told of the batches and this one never is, which the monitor notices.
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


def start_streams(spark: SparkSession, lakehouse: Lakehouse, source: Source, settings: LiveSettings) -> Streams:
    """Ingest and gold as continuous queries, in data-flow order (the tables must exist: ``ensure_all_tables``)."""
    check_queries(lakehouse, "ingest", "gold", spark=spark)  # a lost checkpoint would silently skip data
    check_gold_layout(lakehouse.checkpoint("gold"), settings.gold.layout)  # before ingest starts, not after
    check_source(lakehouse, source)
    partitions = {SHUFFLE_PARTITIONS: str(settings.shuffle_partitions)} if settings.shuffle_partitions else {}
    recorders = [Recorder.gathered(lakehouse, query, settings.metrics_every) for query in LAYERS]
    feed = None if is_connect(spark) else AlertFeed()
    with session_confs(spark, partitions):
        ingest = start_ingest(spark, source, lakehouse, settings.trigger, recorders[0])
        gold = start_gold(
            spark, lakehouse, settings.gold, available_now=False, processing_time=settings.trigger, recorder=recorders[1], on_alerts=feed
        )
        return Streams(spark, [ingest, gold], recorders, feed)


def stop_streams(streams: Streams) -> None:
    """Stop upstream first; each ``stop`` lets the running micro-batch's commit finish or not start.
    Then the metrics rows gathered since the last commit are appended, so what a run reports is complete."""
    for query in streams.queries:
        query.stop()
    for recorder in streams.recorders:
        recorder.flush(streams.spark)


def _unix_ms(moment: datetime) -> int:
    """Floored, as Spark's ``unix_millis`` is: the hand-over and the table read must agree to the ms."""
    return (moment - EPOCH) // timedelta(milliseconds=1)


def _epoch_ms(timestamp: str) -> int:
    """A progress report's ISO time (``...Z``) in ms, exactly (not through a float)."""
    return _unix_ms(datetime.fromisoformat(timestamp.replace("Z", "+00:00")))


@dataclass
class LayerProgress:
    """What one query has done since the monitor started, from its progress reports."""

    rows: int = 0
    completed_batch_id: int = -1  # newest batch that ran (an idle report names the next, unrun one)
    last_start_ms: int = -1  # trigger start of the newest report folded in
    batch_ms: list[int] = field(default_factory=list)  # duration of every batch that read rows
    phase_ms: Counter[str] = field(default_factory=Counter)  # where those batches spent it (durationMs)
    sources: dict[str, Any] = field(default_factory=dict)  # source description -> end offset, newest report

    def update(self, reports: list[StreamingQueryProgress]) -> int:
        """Fold in reports not seen yet; returns the rows they read.

        Reports are told apart by trigger start, not batch id: an idle query reports the id of the
        batch it has not run yet, and the batch that then runs reports the same id. Read through
        the report's properties: under Spark Connect its ``numInputRows`` item is None (the
        property sums the sources).
        """
        new = [p for p in reports if _epoch_ms(p.timestamp) > self.last_start_ms]
        for p in new:
            duration = p.durationMs.get("triggerExecution", 0)
            if p.numInputRows:
                self.batch_ms.append(duration)
                self.phase_ms.update({k: v for k, v in p.durationMs.items() if k != "triggerExecution"})
            if "addBatch" in p.durationMs:
                self.completed_batch_id = max(self.completed_batch_id, p.batchId)
            self.last_start_ms = _epoch_ms(p.timestamp)
            self.sources = {s.description: s.endOffset for s in p.sources}
        rows = sum(p.numInputRows for p in new)
        self.rows += rows
        return rows

    def has_read(self, table: str, version: int) -> bool:
        """Whether this query's Delta source on ``table`` is past ``version`` (its offset names the next one)."""
        for description, offset in self.sources.items():
            if table in description and offset:
                offset = json.loads(offset) if isinstance(offset, str) else offset
                return offset["reservoirVersion"] > version
        return False


@dataclass
class Alert:
    rule_id: int
    group_key: str
    transaction_id: str
    aggregate: str
    event_count: int
    decision_ms: int  # when the alert was committed in gold
    latency_ms: int | None  # bronze ingest -> alert committed
    event_latency_ms: int  # event time -> alert committed


@dataclass
class Monitor:
    """Polls the queries' progress and gold's new alerts: handed over by ``feed`` if there is one,
    else read from ``gold/alerts`` (from the driver, between batches)."""

    spark: SparkSession
    lakehouse: Lakehouse
    queries: list[StreamingQuery]
    feed: AlertFeed | None = None
    layers: dict[str, LayerProgress] = field(default_factory=lambda: {name: LayerProgress() for name in LAYERS})
    alerts: list[Alert] = field(default_factory=list)
    _last_gold_batch: int = -1
    _last_poll: float = field(default_factory=time.monotonic)
    drained_in: float | None = None  # seconds a draining stream took to drain (stream(drain=True))
    interrupted: bool = False  # stopped by Ctrl-C
    source_outage: str | None = None  # the Kafka source did not answer for a while (kafka.health.Watch)

    def __post_init__(self) -> None:
        # Alerts of earlier runs on this lakehouse are not news.
        latest = tables.read(self.spark, self.lakehouse.alerts).agg(F.max("gold_batch_id")).first()[0]
        self._last_gold_batch = -1 if latest is None else latest

    def _new_alerts(self) -> tuple[list[Alert], str]:
        """The alerts new since the last poll, and a note if where they come from changed."""
        if self.feed is None:
            return self._read_alerts(), ""
        alerts = self._fed_alerts(self.feed)
        done = self.layers["gold"].completed_batch_id
        if done <= self._last_gold_batch:
            return alerts, ""
        # Gold reported a batch the feed was never told of: its foreachBatch runs in another
        # process (an isolated Python worker), so the feed would stay empty. Read from here on.
        self.feed = None
        return alerts + self._read_alerts(), f"gold batch {done} was not handed over in this process: alerts are read from gold/alerts from now on"

    def _fed_alerts(self, feed: AlertFeed) -> list[Alert]:
        alerts = []
        for batch_id, (committed_ms, rows) in sorted(feed.take().items()):
            if batch_id > self._last_gold_batch:  # not an earlier run's batch, replayed
                alerts += [_alert(r, committed_ms) for r in rows]
                self._last_gold_batch = batch_id
        return alerts

    def _read_alerts(self) -> list[Alert]:
        """Alerts of the gold batches whose ``pipeline_metrics`` row has landed since the last poll.

        The row records when the batch's alerts committed (``batch_end``). Live queries append rows
        several batches at a time (metrics.Recorder) and keep them in files until then, so an alert
        is shown once its batch's row exists, in a file or in the table. The files are read first,
        the table for batches none of them holds, and ``gold/alerts`` only if a row counts alerts.
        """
        done = self.layers["gold"].completed_batch_id
        if done <= self._last_gold_batch:
            return []
        batches = range(self._last_gold_batch + 1, done + 1)
        # Per batch: when its alerts committed (unix ms, floored) and how many there were.
        committed = {
            r["batch_id"]: (_unix_ms(r["batch_end"]), r.get("alerts"))
            for r in kept_rows(self.lakehouse, "gold")
            if r["batch_id"] in batches
        }
        # Tables only for what no file says: a read runs Spark jobs on the cores the queries use.
        missing = [b for b in batches if b not in committed]
        if missing:
            committed |= {
                r.batch_id: (r.committed_ms, r.alerts)
                for r in tables.read(self.spark, self.lakehouse.pipeline_metrics)
                .where((F.col("layer") == "gold") & F.col("batch_id").between(missing[0], missing[-1]))
                .select("batch_id", F.unix_millis("batch_end").alias("committed_ms"), "alerts")
                .collect()
            }
        if not committed:
            return []
        done = max(committed)
        # A batch without a row (not expected) may hold alerts: read then.
        quiet = all(b in committed and committed[b][1] == 0 for b in range(batches.start, done + 1))
        rows = [] if quiet else (
            tables.read(self.spark, self.lakehouse.alerts)
            .where(F.col("gold_batch_id").between(self._last_gold_batch + 1, done))
            .select(
                "gold_batch_id",
                "rule_id",
                "group_key",
                "transaction_id",
                F.col("aggregate_value").cast("string").alias("aggregate"),
                "event_count",
                F.unix_millis("ingest_time").alias("ingest_ms"),
                F.unix_millis("event_time").alias("event_ms"),
                F.unix_millis("decision_time").alias("decision_ms"),
            )
            .collect()
        )
        self._last_gold_batch = done
        # A batch without a row (not expected): its alerts' decision time, the batch's start.
        return [_alert(r, committed[r.gold_batch_id][0] if r.gold_batch_id in committed else r.decision_ms) for r in rows]

    def poll(self, stopped: bool = False) -> tuple[str, list[Alert]]:
        """One progress line (rows/s per layer, alerts/s, latest latency) and the alerts new since the last poll.

        A query's error is raised, unless the queries were ``stopped``: a stop interrupts the running
        batch, and Spark may keep that interruption as the query's error (a stop during planning, or
        the regex that classifies a Python error overflowing the JVM's stack on a long message). The
        checkpoint is intact and the next start replays that batch, so the error is named in the
        line instead."""
        now = time.monotonic()
        seconds = max(now - self._last_poll, 1e-3)
        self._last_poll = now
        errors = [f"{q.name} stopped with an error: {error}" for q in self.queries if (error := q.exception()) is not None]
        if errors and not stopped:
            raise RuntimeError(errors[0])
        rates = [
            f"{name} {layer.update(query.recentProgress) / seconds:7.0f} rows/s"
            for (name, layer), query in zip(self.layers.items(), self.queries)
        ]
        new, note = self._new_alerts()
        self.alerts += new
        latencies = [a.latency_ms for a in new if a.latency_ms is not None]
        latency = f"{max(latencies) / 1000:5.2f}s" if latencies else "  n/a"
        gold_batches = self.layers["gold"].batch_ms
        gold_batch = f"{gold_batches[-1] / 1000:4.1f}s" if gold_batches else "  n/a"
        line = f"{' | '.join(rates)} | alerts {len(new) / seconds:5.1f}/s | latency {latency} | last gold batch {gold_batch}"
        if note:
            line += f"\n{note}"
        for error in errors:  # the first line: the rest is the query's plan
            line += f"\n{error.splitlines()[0]} (as it was stopped; the next start replays its batch)"
        return line, new

    def _latest_version(self, table: str) -> int:
        return tables.latest_commit(self.spark, table)["version"]

    def drained(self) -> bool:
        """Everything available has gone through: every query has reported, ingest's newest trigger
        found nothing new to read (and is not running one), and gold has read silver's newest commit.

        Ingest writes silver inside its batch, so once it is idle silver holds everything it read.
        Gold's side comes from the last poll's reports, which can only be behind: never drained too soon.
        """
        if len(self.queries) != len(LAYERS) or any(q.lastProgress is None for q in self.queries):
            return False
        status = self.queries[0].status
        return not (status["isDataAvailable"] or status["isTriggerActive"]) and self._gold_read_all_of_silver()

    def _gold_read_all_of_silver(self) -> bool:
        """Gold's last report is past silver's newest commit."""
        return self.layers["gold"].has_read(self._silver_location, self._latest_version(self.lakehouse.silver_transactions))

    @cached_property
    def _silver_location(self) -> str:
        """Silver as gold's Delta source names it in its progress reports: by its path, also for a catalog table."""
        silver = self.lakehouse.silver_transactions
        if not is_table_name(silver):
            return silver
        return self.spark.sql(f"DESCRIBE DETAIL {table_ref(silver)}").first()["location"]

    def caught_up(self, landed_events: int) -> bool:
        """Ingest has read every landed event, and gold every commit of silver.

        Checked upstream first: ingest reports a batch after committing it, so once it has read
        every landed event, silver's latest commit holds all of them.
        """
        return self.layers["ingest"].rows >= landed_events and self._gold_read_all_of_silver()


def _alert(r: Row, decided: int) -> Alert:
    """An alert row (gold.ALERT_FIELDS) committed at ``decided`` (unix ms)."""
    latency = None if r.ingest_ms is None else decided - r.ingest_ms
    return Alert(r.rule_id, r.group_key, r.transaction_id, r.aggregate, r.event_count, decided, latency, decided - r.event_ms)


def latency_summary(values: list[int]) -> str:
    if not values:
        return "n/a (no alert carried the time stamps)"
    p = {q: percentile(values, q) / 1000 for q in (50, 95, 99, 100)}
    return f"p50 {p[50]:.2f}s  p95 {p[95]:.2f}s  p99 {p[99]:.2f}s  max {p[100]:.2f}s  ({len(values)} alerts)"


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


def _alert_line(a: Alert) -> str:
    latency = f"{a.latency_ms / 1000:.2f}s after ingest" if a.latency_ms is not None else "latency n/a"
    return f"  ALERT rule {a.rule_id} key {a.group_key}  txn {a.transaction_id}  value {a.aggregate}  ({latency})"


def _monitor(spark: SparkSession, lakehouse: Lakehouse) -> Monitor:
    """A monitor created before the streams start, so the first batch's alerts count as new."""
    ensure_all_tables(spark, lakehouse)
    return Monitor(spark, lakehouse, [])


def _wait_started(monitor: Monitor, timeout: float = 180) -> None:
    """Until every query has finished a first micro-batch (JVM, Python workers and state stores warm)."""
    deadline = time.monotonic() + timeout
    while any(q.lastProgress is None for q in monitor.queries):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the streams did not finish a first micro-batch within {timeout:.0f}s")
        for q in monitor.queries:
            if q.exception() is not None:
                raise RuntimeError(f"{q.name} failed while starting: {q.exception()}")
        time.sleep(0.5)
    monitor.poll()


def follow(monitor: Monitor, until: Callable[[], bool], log: Log, every: float = 1.0) -> None:
    """Print a progress line (and the new alerts) every ``every`` seconds until ``until()``."""
    while not until():
        time.sleep(every)
        _show(monitor.poll(), log)


def _show(polled: tuple[str, list[Alert]], log: Log, show_alerts: int = 5) -> None:
    line, new = polled
    log(line)
    for a in new[:show_alerts]:
        log(_alert_line(a))
    if len(new) > show_alerts:
        log(f"  ... and {len(new) - show_alerts} more alert(s)")


def _batch_summary(layer: LayerProgress) -> str:
    if not layer.batch_ms:
        return "none"
    total = sum(layer.phase_ms.values()) or 1
    phases = ", ".join(f"{k} {v / total:.0%}" for k, v in layer.phase_ms.most_common(3))
    ms = layer.batch_ms
    return f"{len(ms)}, p50 {percentile(ms, 50) / 1000:.2f}s, max {max(ms) / 1000:.2f}s ({phases})"


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
    from rulewatch.spark.rules_table import apply_rules, export_rules

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
            f"event  -> alert latency: {latency_summary(self.event_latency_ms)}",
            *([self.rule_change.line()] if self.rule_change else []),
            "micro-batches that read rows (count, median and max time, where the time went):",
            *[f"  {name:<6} {_batch_summary(layer)}" for name, layer in self.layers.items()],
        ]


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
    streams = start_streams(spark, lakehouse, source, settings)
    monitor.queries, monitor.feed = streams.queries, streams.feed
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
    )


def _generate(config: generate.GeneratorConfig, landing: Path | KafkaSource, labels: Path, stop: threading.Event) -> generate.GenerateResult:
    if isinstance(landing, Path):
        return generate.run(config, landing, labels, stop)
    with TopicWriter(landing.topic) as writer:
        return generate.run(config, writer, labels, stop)


def stream(
    spark: SparkSession,
    lakehouse: Lakehouse,
    source: Source,
    settings: LiveSettings = LiveSettings(),
    duration: float | None = None,
    log: Log = print,
    drain: bool = False,
) -> Monitor:
    """Run the streams until Ctrl-C (or ``duration`` seconds), printing a progress line each second.

    ``drain``: stop as soon as everything available has gone through (``Monitor.drained``), within
    ``duration`` if given: a catch-up run of the live queries that ends by itself, as the job does.
    ``monitor.drained_in`` then holds the seconds it took (None: it had not drained when it stopped).
    A Kafka source is probed beside the streams (kafka.health.Watch): an outage is logged when it
    starts and ends, a stream whose cluster is not answering has not drained, and
    ``monitor.source_outage`` says how long the cluster was gone.
    """
    monitor = _monitor(spark, lakehouse)
    streams = start_streams(spark, lakehouse, source, settings)
    monitor.queries, monitor.feed = streams.queries, streams.feed
    started = time.monotonic()
    deadline = started + duration if duration else float("inf")
    watch = Watch(source.topic, log) if isinstance(source, KafkaSource) else None

    def done() -> bool:
        if drain and (watch is None or watch.down is None) and monitor.drained():
            monitor.drained_in = time.monotonic() - started
            return True
        return time.monotonic() > deadline

    try:
        with watch or nullcontext():
            follow(monitor, done, log)
    except KeyboardInterrupt:
        monitor.interrupted = True
        log("interrupted: stopping the streams (checkpoints stay usable; the next start continues)")
    finally:
        stop_streams(streams)
        monitor.source_outage = watch.summary() if watch else None
    _show(monitor.poll(stopped=True), log)  # the last batches' alerts: their metrics rows are in now
    return monitor


# --- command line ---------------------------------------------------------------------------------------------


def _settings(args: argparse.Namespace, lakehouse: Lakehouse) -> LiveSettings:
    return LiveSettings(
        trigger=args.trigger,
        gold=GoldSettings(
            **arguments.gold_layout(args, lakehouse.checkpoint("gold")),
            allowed_lateness=args.allowed_lateness,
            alerts_topic=kafka_arguments.alerts_topic(args),
            no_data_batches=args.gold_no_data_batches,
            window_metrics=args.window_metrics,
        ),
        shuffle_partitions=args.shuffle_partitions,
        metrics_every=args.metrics_every,
    )


def _apply_rules(spark: SparkSession, lakehouse: Lakehouse, files: list[str], log: Log) -> None:
    from rulewatch.spark.rules_table import apply_rules_file

    for path in files:
        for change in apply_rules_file(spark, lakehouse, path):
            log(f"rules: {change}")


def _check_rules_files(files: list[str]) -> list[str]:
    """Every problem of every rules file, found before Spark starts (as `rulewatch run` does)."""
    from rulewatch.engine.rules import RuleSetError, load_rules_file

    problems = []
    for path in files:
        try:
            load_rules_file(path)
        except RuleSetError as err:
            problems.append(str(err))
    return problems


def _refuse(problems: list[str]) -> int:
    for problem in problems:
        print(f"rulewatch: {problem}", file=sys.stderr)
    print("rulewatch: nothing was started or written", file=sys.stderr)
    return 2


def _config(args: argparse.Namespace, duration: float, run_id: str | None) -> generate.GeneratorConfig:
    return generate.GeneratorConfig(
        args.rate, duration, args.seed, run_id or generate.new_run_id(), args.file_interval, args.pattern_every
    )


def cmd_generate(args: argparse.Namespace) -> int:
    kafka = kafka_arguments.source(args)
    if bool(kafka) == bool(args.landing):
        print("rulewatch: give where the traffic goes: --landing FOLDER or --kafka-topic TOPIC (with --kafka-bootstrap)", file=sys.stderr)
        return 2
    landing = Path(args.landing) if args.landing else None
    labels = Path(args.labels) if args.labels else (landing.with_name(f"{landing.name}-labels") if landing else Path("labels"))
    try:
        config = _config(args, args.duration, args.run_id)
        if landing:
            generate.check_folders(landing, labels)
    except ValueError as err:
        print(f"rulewatch: {err}", file=sys.stderr)
        return 2
    target = landing or f"Kafka topic {kafka.topic.topic} at {kafka.topic.bootstrap}"
    print(f"rulewatch generate: run {config.run_id}, {config.rate:,.0f} events/s for {config.duration:.0f}s into {target}, labels in {labels}")
    try:
        if landing:
            result = generate.run(config, landing, labels)
        else:
            with TopicWriter(kafka.topic) as writer:
                result = generate.run(config, writer, labels)
    except KeyboardInterrupt:
        print("interrupted")
        return 130
    print(f"{result.events:,} events in {result.files} {'files' if landing else 'sends'}, {result.labels} pattern instance(s), {result.rate:,.0f} events/s achieved")
    return 0


def cmd_stream(args: argparse.Namespace) -> int:
    from rulewatch.spark.lakehouse import exclusive
    from rulewatch.spark.session import get_spark

    lakehouse = Lakehouse(args.lakehouse)
    kafka = kafka_arguments.source(args)
    if kafka and args.landing:
        print("rulewatch: give either --landing FOLDER or --kafka-topic TOPIC, not both", file=sys.stderr)
        return 2
    landing = Path(args.landing or Path(lakehouse.root, "landing"))
    settings = _settings(args, lakehouse)
    if problems := _check_rules_files(args.rules):
        return _refuse(problems)
    if kafka:
        check_topic(kafka.topic)  # a dead cluster or a mistyped topic: said now, not after Spark has started
    with exclusive(lakehouse, "rulewatch stream"):  # before the landing folder: by default it lies inside the lakehouse, whose problems the lock reports
        if not kafka:
            landing.mkdir(parents=True, exist_ok=True)
        spark = get_spark("rulewatch-stream")
        _apply_rules(spark, lakehouse, args.rules, print)
        source: Source = kafka or str(landing.resolve())
        described = f"Kafka topic {kafka.topic.topic}" if kafka else str(landing)
        until = "until everything available has gone through" if args.drain else "Ctrl-C stops cleanly"
        print(f"rulewatch stream: {described} -> {lakehouse.root}, trigger {args.trigger!r}; {until}")
        monitor = stream(spark, lakehouse, source, settings, args.duration, drain=args.drain)
    if monitor.interrupted:
        return 130
    if monitor.source_outage:
        print(f"rulewatch stream: {monitor.source_outage}: what was sent meanwhile was read only once it answered", file=sys.stderr)
        return 1
    if not args.drain:
        return 0
    if monitor.drained_in is None:
        print(f"rulewatch stream: NOT drained within --duration {args.duration:g}s: input was still arriving or being processed", file=sys.stderr)
        return 1
    print(f"rulewatch stream: drained in {monitor.drained_in:.1f}s: everything available has gone through")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from rulewatch.spark.lakehouse import exclusive
    from rulewatch.spark.session import get_spark

    lakehouse = Lakehouse(args.lakehouse)
    kafka = kafka_arguments.source(args)
    landing: Path | KafkaSource = kafka or Path(lakehouse.root, "landing")
    labels = Path(lakehouse.root, "labels")
    rules = args.rules or [str(p) for p in DEMO_RULES]
    try:
        settings = _settings(args, lakehouse)
        config = _config(args, args.minutes * 60, None)
    except ValueError as err:
        print(f"rulewatch: {err}", file=sys.stderr)
        return 2
    if problems := _check_rules_files(rules):
        return _refuse(problems)
    with exclusive(lakehouse, "rulewatch demo"):
        spark = get_spark("rulewatch-demo")
        _apply_rules(spark, lakehouse, rules, print)
        report = demo(spark, lakehouse, landing, labels, config, settings)
    print("\n".join(report.lines()))
    return 0 if report.caught_up else 1
