"""The live queries seen from the driver: their progress, the new rows of ``gold/alerts``, and the
progress line and alert lines ``rulewatch stream`` and ``demo`` print."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from functools import cached_property
from typing import Any, Callable

from pyspark.sql import Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.streaming.listener import StreamingQueryProgress

from rulewatch.spark.control import rule_requests
from rulewatch.spark.storage import tables
from rulewatch.spark.storage.lakehouse import Lakehouse, is_table_name, table_ref
from rulewatch.spark.storage.checkpoints import batch_base
from rulewatch.spark.storage.metrics import kept_rows, percentile
from rulewatch.spark.layers.pipeline import ensure_all_tables


LAYERS = ("ingest", "gold")
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
Log = Callable[[str], None]


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
    completed_batch_id: int = -1  # newest batch that ran (an idle report names the next, unrun one), as the tables number it
    batch_base: int = 0  # what the tables add to the query's batch ids (a rescaled gold: checkpoints.batch_base)
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
                self.completed_batch_id = max(self.completed_batch_id, p.batchId + self.batch_base)
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
    decision_ms: int  # when gold committed the alert (its batch's end; without a metrics row, its decision time)
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
    moved: bool = False  # the last poll saw rows, alerts, a note or an error
    rules_version: int = -1  # the newest config/rules commit gold was seen running
    direct: bool = False  # gold reads the Kafka source itself, not silver (LiveSettings.gold_from_source)

    def __post_init__(self) -> None:
        self.layers["gold"].batch_base = batch_base(self.lakehouse.checkpoint("gold"))
        # Alerts of earlier runs on this lakehouse are not news.
        latest = tables.column_max(self.spark, self.lakehouse.alerts, "gold_batch_id")
        self._last_gold_batch = -1 if latest is None else latest

    def _new_alerts(self, kept: list[dict[str, Any]]) -> tuple[list[Alert], str]:
        """The alerts new since the last poll, and a note if where they come from changed (``kept``:
        gold's metrics rows waiting in files, ``metrics.kept_rows``)."""
        if self.feed is None:
            return self._read_alerts(kept), ""
        alerts = self._fed_alerts(self.feed)
        done = self.layers["gold"].completed_batch_id
        if done <= self._last_gold_batch:
            return alerts, ""
        # Gold reported a batch the feed was never told of: its foreachBatch runs in another
        # process (an isolated Python worker), so the feed would stay empty. Read from here on.
        self.feed = None
        return alerts + self._read_alerts(kept), f"gold batch {done} was not handed over in this process: alerts are read from gold/alerts from now on"

    def _fed_alerts(self, feed: AlertFeed) -> list[Alert]:
        alerts = []
        for batch_id, (committed_ms, rows) in sorted(feed.take().items()):
            if batch_id > self._last_gold_batch:  # not an earlier run's batch, replayed
                alerts += [_alert(r, committed_ms) for r in rows]
                self._last_gold_batch = batch_id
        return alerts

    def _read_alerts(self, kept: list[dict[str, Any]]) -> list[Alert]:
        """Alerts of the gold batches whose ``pipeline_metrics`` row has landed since the last poll.

        The row records when the batch's alerts committed (``batch_end``). Live queries append rows
        several batches at a time (metrics.Recorder) and keep them in files until then, so an alert
        is shown once its batch's row exists, in a file or in the table. The files are read first,
        the table for batches none of them holds, and ``gold/alerts`` only if a row counts alerts.
        ``kept``: the rows in the files (``metrics.kept_rows``).
        """
        done = self.layers["gold"].completed_batch_id
        if done <= self._last_gold_batch:
            return []
        batches = range(self._last_gold_batch + 1, done + 1)
        # Per batch: when its alerts committed (unix ms, floored) and how many there were.
        committed = {
            r["batch_id"]: (_unix_ms(r["batch_end"]), r.get("alerts"))
            for r in kept
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
        # A batch without a row (not expected): its alerts' decision time, taken before the batch's appends.
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
        rows = [layer.update(query.recentProgress) for layer, query in zip(self.layers.values(), self.queries)]
        rates = [f"{name} {n / seconds:7.0f} rows/s" for name, n in zip(self.layers, rows)]
        kept = kept_rows(self.lakehouse, "gold")  # read once a poll: both the alerts and the rules news use it
        new, note = self._new_alerts(kept)
        if rules := self._rules_news(kept):
            note = "\n".join(filter(None, (note, rules)))
        self.moved = any(rows) or bool(new or note or errors)
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

    def _rules_news(self, kept: list[dict[str, Any]]) -> str:
        """A line when gold's newest batch runs a newer config/rules commit than the last one said.

        Gold's metrics rows name the commit its shards run (``rules_version``) and how many rules
        are active then; rows wait in files between metrics commits, and any later batch's row names
        the same commit, so a poll a second sees each change. Only where the rows wait in this machine's
        files (foreachBatch here, ``--metrics-every`` above 0): otherwise no line, as the table is not
        read each second for it."""
        rows = [r for r in kept if r.get("rules_version") is not None]
        if not rows:
            return ""
        newest = max(rows, key=lambda r: (r["rules_version"], r["batch_id"]))
        if newest["rules_version"] <= self.rules_version:
            return ""
        self.rules_version = newest["rules_version"]
        return f"rules: gold now evaluates config/rules version {self.rules_version} ({newest.get('active_rules')} active) from batch {newest['batch_id']}"

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
        return not (status["isDataAvailable"] or status["isTriggerActive"]) and self._gold_read_all()

    def _gold_read_all(self) -> bool:
        """Gold's last report is past silver's newest commit; reading the source itself, it is where
        ingest's last report is in the topic."""
        if self.direct:  # the queries' newest reports, not the last poll's: ingest may have read more since
            ingest, gold = (_kafka_ends(query.lastProgress) for query in self.queries)
            return bool(ingest) and all(gold.get(p, -1) >= end for p, end in ingest.items())
        return self.layers["gold"].has_read(self._silver_location, self._latest_version(self.lakehouse.silver_transactions))

    @cached_property
    def _silver_location(self) -> str:
        """Silver as gold's Delta source names it in its progress reports: by its path, also for a catalog table."""
        silver = self.lakehouse.silver_transactions
        if not is_table_name(silver):
            return silver
        return self.spark.sql(f"DESCRIBE DETAIL {table_ref(silver)}").first()["location"]

    def caught_up(self, landed_events: int) -> bool:
        """Ingest has read every landed event, and gold every commit of silver (or, reading the topic itself, as far as ingest).

        Checked upstream first: ingest reports a batch after committing it, so once it has read
        every landed event, silver's latest commit holds all of them.
        """
        return self.layers["ingest"].rows >= landed_events and self._gold_read_all()


def _kafka_ends(progress: StreamingQueryProgress | None) -> dict[tuple[str, str], int]:
    """(topic, partition) -> the end offset of a query's newest batch, from its progress report."""
    ends: dict[tuple[str, str], int] = {}
    for source in progress.sources if progress else []:
        if source.description.startswith("KafkaV2") and source.endOffset:
            offsets = json.loads(source.endOffset) if isinstance(source.endOffset, str) else source.endOffset
            ends |= {(topic, p): int(end) for topic, parts in offsets.items() for p, end in parts.items()}
    return ends


def _alert(r: Row, decided: int) -> Alert:
    """An alert row (gold.ALERT_FIELDS) committed at ``decided`` (unix ms)."""
    latency = None if r.ingest_ms is None else decided - r.ingest_ms
    return Alert(r.rule_id, r.group_key, r.transaction_id, r.aggregate, r.event_count, decided, latency, decided - r.event_ms)


def latency_summary(values: list[int]) -> str:
    if not values:
        return "n/a (no alert carried the time stamps)"
    p = {q: percentile(values, q) / 1000 for q in (50, 95, 99, 100)}
    return f"p50 {p[50]:.2f}s  p95 {p[95]:.2f}s  p99 {p[99]:.2f}s  max {p[100]:.2f}s  ({len(values)} alerts)"


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


def follow(monitor: Monitor, until: Callable[[], bool], log: Log, every: float = 1.0, idle_every: float = 10.0) -> None:
    """Until ``until()``: a progress line (and the new alerts) every ``every`` seconds while rows or alerts
    move, and every ``idle_every`` seconds while nothing does (a line a second of "0 rows/s" says nothing)."""
    shown = float("-inf")
    while not until():
        time.sleep(every)
        for line in rule_requests.serve(monitor.spark, monitor.lakehouse):  # `rules apply` meanwhile: no Spark of its own
            log(line)
        polled = monitor.poll()
        if monitor.moved or time.monotonic() - shown >= idle_every:
            _show(polled, log)
            shown = time.monotonic()


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
