"""Live mode: the pipeline as continuous streams (``rulewatch stream``; ``demo.py`` feeds them a generator).

Two queries run on processing-time triggers: ingest (landing -> bronze + silver in one
micro-batch, layers/ingest.py) and gold, the same query the batch job uses. A monitor on the driver
(``monitor.py``) turns their progress and the new rows of ``gold/alerts`` into a progress line. Stopping (Ctrl-C, or the end
of a demo) stops each query between micro-batches, so the checkpoints stay usable and the next
start continues from them.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

from rulewatch.spark.layers.bronze import Source, check_source
from rulewatch.spark.storage.checkpoints import check_gold_layout, check_queries, gold_source
from rulewatch.spark.layers.gold import SHUFFLE_PARTITIONS, GoldSettings, gold_reads, start_gold
from rulewatch.spark.layers.ingest import start_ingest
from rulewatch.kafka.health import Watch
from rulewatch.kafka.source import KafkaSource
from rulewatch.spark.storage.lakehouse import Lakehouse, holding
from rulewatch.spark.storage.metrics import Recorder, flush_pending
from rulewatch.spark.runtime.session import is_connect, session_confs
from rulewatch.spark.live.monitor import LAYERS, AlertFeed, Log, Monitor, _monitor, _show, follow


@dataclass(frozen=True)
class LiveSettings:
    trigger: str = "0 seconds"  # each query starts its next micro-batch as soon as the last one ends
    gold: GoldSettings = GoldSettings()
    shuffle_partitions: int | None = None  # for these queries; a stateful checkpoint keeps the value it began with
    metrics_every: float = 30.0  # seconds between pipeline_metrics commits; 0: each batch commits its own rows
    # Gold reads a Kafka source itself, de-duplicating as silver does, instead of reading silver
    # (layers/gold.py): an alert then waits for one query's batch, not ingest's and then gold's.
    # Ingest still writes bronze and silver beside it. Fixed per gold checkpoint; None: as the
    # checkpoint began, and for a new one, from the topic whenever the source is Kafka.
    gold_from_source: bool | None = None


@dataclass
class Streams:
    """The running queries, in data-flow order, and what gathers their metrics rows."""

    spark: SparkSession
    queries: list[StreamingQuery]
    recorders: list[Recorder]
    feed: AlertFeed | None = None  # gold's alerts as they commit (a classic session)
    direct: bool = False  # gold reads the Kafka source itself (LiveSettings.gold_from_source)

    def watched_by(self, monitor: Monitor) -> None:
        """Hand the queries, the alert feed and what gold reads to ``monitor``."""
        monitor.queries, monitor.feed, monitor.direct = self.queries, self.feed, self.direct


def start_streams(spark: SparkSession, lakehouse: Lakehouse, source: Source, settings: LiveSettings) -> Streams:
    """Ingest and gold as continuous queries, in data-flow order (the tables must exist: ``ensure_all_tables``)."""
    check_queries(lakehouse, "ingest", "gold", spark=spark)  # a lost checkpoint would silently skip data
    began = gold_source(lakehouse.checkpoint("gold"))
    direct = _direct_source(source, settings, began)
    if direct and direct.starting_offsets == "latest" and began is None:
        source = direct = direct.pinned()  # a new gold and ingest from one point, or one would see lines the other never does
    check_gold_layout(lakehouse.checkpoint("gold"), settings.gold.layout, source=gold_reads(direct))  # before ingest starts, not after
    check_source(lakehouse, source)
    partitions = {SHUFFLE_PARTITIONS: str(settings.shuffle_partitions)} if settings.shuffle_partitions else {}
    recorders = [Recorder.gathered(lakehouse, query, settings.metrics_every) for query in LAYERS]
    feed = None if is_connect(spark) else AlertFeed()
    with session_confs(spark, partitions):
        ingest = start_ingest(spark, source, lakehouse, settings.trigger, recorders[0])
        gold = start_gold(
            spark, lakehouse, settings.gold, available_now=False, processing_time=settings.trigger, recorder=recorders[1], on_alerts=feed,
            source=direct,
        )
        return Streams(spark, [ingest, gold], recorders, feed, direct is not None)


def _direct_source(source: Source, settings: LiveSettings, began: str | None) -> KafkaSource | None:
    """The Kafka source gold reads itself, or None: gold reads silver (``LiveSettings.gold_from_source``;
    ``began``: what gold's checkpoint reads, ``checkpoints.gold_source``)."""
    wanted = settings.gold_from_source
    if wanted is None:
        wanted = isinstance(source, KafkaSource) if began is None else began != "silver"
    if not wanted:
        return None
    if not isinstance(source, KafkaSource):
        raise ValueError("gold straight from the source reads a Kafka topic: give --kafka-bootstrap and --kafka-topic, or --gold-source silver")
    return source


def stop_streams(streams: Streams) -> None:
    """Stop upstream first; each ``stop`` lets the running micro-batch's commit finish or not start.
    Then the metrics rows gathered since the last commit are appended, so what a run reports is complete."""
    for query in streams.queries:
        query.stop()
    if streams.recorders:  # every query's rows in one commit (each costs ~0.5-1 s)
        flush_pending(streams.spark, streams.recorders[0].lakehouse, *(recorder.query for recorder in streams.recorders))


def stream(
    spark: SparkSession,
    lakehouse: Lakehouse,
    source: Source,
    settings: LiveSettings = LiveSettings(),
    duration: float | None = None,
    log: Log = print,
    drain: bool = False,
) -> Monitor:
    """Run the streams until Ctrl-C (or ``duration`` seconds), printing progress (``monitor.follow``).

    ``drain``: stop as soon as everything available has gone through (``Monitor.drained``), within
    ``duration`` if given: a catch-up run of the live queries that ends by itself, as the job does.
    ``monitor.drained_in`` then holds the seconds it took (None: it had not drained when it stopped).
    A Kafka source is probed beside the streams (kafka.health.Watch): an outage is logged when it
    starts and ends, a stream whose cluster is not answering has not drained, and
    ``monitor.source_outage`` says how long the cluster was gone.
    """
    with holding(lakehouse, "rulewatch stream"):  # a notebook's streams hold the lakehouse as the command's do
        return _streamed(spark, lakehouse, source, settings, duration, log, drain)


def _streamed(
    spark: SparkSession, lakehouse: Lakehouse, source: Source, settings: LiveSettings, duration: float | None, log: Log, drain: bool
) -> Monitor:
    monitor = _monitor(spark, lakehouse)
    streams = start_streams(spark, lakehouse, source, settings)
    streams.watched_by(monitor)
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
