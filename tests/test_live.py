"""Live mode: a real continuous run catches every injected pattern; a stop leaves checkpoints the next run continues from."""

from __future__ import annotations

import calendar
import re
from datetime import datetime, timezone

import pytest
from pyspark import cloudpickle
from pyspark.sql import functions as F
from pyspark.sql.streaming.listener import StreamingQueryProgress

from rulewatch.spark.storage.checkpoints import CheckpointError, check_queries
from rulewatch.spark.live.generate import GeneratorConfig, Label
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.storage.metrics import kept_rows
from rulewatch.spark.layers.gold import ensure_gold_tables
from rulewatch.spark.live.demo import DEMO_RULES, demo, score
from rulewatch.spark.live.monitor import Alert, AlertFeed, LayerProgress, Monitor, _alert_line
from rulewatch.spark.live.streams import LiveSettings
from rulewatch.spark.control.rules_table import apply_rules_file


def alert(rule_id: int, key: str, decided: int = 5_000) -> Alert:
    return Alert(rule_id, key, "t", "1", 1, decided, 100, 200)


def test_score_counts_caught_missed_and_unlabelled_alerts():
    labels = [Label("burst", 0, 2, {"payeeId": "b0"}, ["x"], 1_000), Label("burst", 1, 2, {"payeeId": "b1"}, ["y"], 1_000),
              Label("drain", 2, 1, {"payeeId": "d", "beneficiaryId": "m|1"}, ["z"], 2_000)]  # fmt: skip
    result = score([alert(2, "b0", 4_000), alert(2, "b0", 3_000), alert(1, "d|m\\|1"), alert(1, "b1"), alert(3, "u")], labels)
    assert (result.patterns["burst"].caught, result.patterns["burst"].missed) == (1, 1)
    assert result.patterns["burst"].detection_ms == [2_000]  # from the instance's start to its first alert
    assert (result.patterns["drain"].caught, result.patterns["login_attack"].injected) == (1, 0)
    # Rule 1 on a burst payer's key was not meant to fire there: a false positive like any unlabelled key.
    assert sorted((a.rule_id, a.group_key) for a in result.false_positives) == [(1, "b1"), (3, "u")]


def progress(batch_id: int, started: str, rows: int, ran: bool) -> StreamingQueryProgress:
    """A progress report as Spark writes it: an idle trigger has no addBatch and names the next batch."""
    source = {"description": "s", "startOffset": "0", "endOffset": str(rows), "latestOffset": str(rows),
              "numInputRows": rows, "inputRowsPerSecond": 0.0, "processedRowsPerSecond": 0.0}  # fmt: skip
    return StreamingQueryProgress.fromJson({
        "id": "00000000-0000-0000-0000-000000000001", "runId": "00000000-0000-0000-0000-000000000002",
        "name": "q", "timestamp": started, "batchId": batch_id, "batchDuration": 5, "numInputRows": rows,
        "durationMs": {"triggerExecution": 900, **({"addBatch": 800} if ran else {})},
        "stateOperators": [], "sources": [source], "sink": {"description": "k", "numOutputRows": -1},
    })  # fmt: skip


def test_progress_folds_each_trigger_once_by_its_start_to_the_millisecond():
    layer = LayerProgress()
    idle = progress(3, "2026-11-30T20:17:05.998Z", 0, ran=False)
    ran = progress(3, "2026-11-30T20:17:05.999Z", 120, ran=True)  # same batch id, 1 ms later
    assert layer.update([idle]) == 0 and layer.completed_batch_id == -1
    assert layer.update([idle, ran]) == 120
    assert layer.update([idle, ran]) == 0  # nothing new
    assert (layer.rows, layer.completed_batch_id, layer.batch_ms) == (120, 3, [900])
    assert layer.last_start_ms == calendar.timegm((2026, 11, 30, 20, 17, 5)) * 1000 + 999


def test_an_alert_feed_pickled_with_foreach_batch_leaves_the_original_untold():
    # Where foreachBatch runs in another process its function is pickled, feed included: that must
    # work (a lock cannot be pickled), and the copy's calls never reach the monitor's feed.
    feed = AlertFeed()
    feed(1, datetime(2026, 11, 30, tzinfo=timezone.utc), [])
    write = cloudpickle.loads(cloudpickle.dumps(lambda batch_id: feed(batch_id, datetime(2026, 11, 30, tzinfo=timezone.utc), [])))
    write(2)
    assert feed.take() == {1: (1_795_996_800_000, [])} and feed.take() == {}


def _fail(batch, batch_id):
    raise ValueError("the batch was interrupted")


def test_a_querys_error_is_raised_while_running_and_named_after_the_stop(spark, tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    ensure_gold_tables(spark, lakehouse)
    queries = [
        spark.readStream.format("rate").load().writeStream.queryName(name).foreachBatch(write)
        .option("checkpointLocation", str(tmp_path / name)).start()
        for name, write in [("rulewatch_ingest", lambda batch, batch_id: None), ("rulewatch_gold", _fail)]
    ]  # fmt: skip
    try:
        with pytest.raises(Exception, match="the batch was interrupted"):
            queries[1].awaitTermination(120)
    finally:
        for query in queries:
            query.stop()
    monitor = Monitor(spark, lakehouse, queries)
    with pytest.raises(RuntimeError, match="rulewatch_gold stopped with an error"):
        monitor.poll()
    line, new = monitor.poll(stopped=True)  # as the last poll after stop_streams
    assert "\nrulewatch_gold stopped with an error: " in line and line.endswith("(as it was stopped; the next start replays its batch)")
    assert new == []


@pytest.mark.slow
def test_demo_catches_every_pattern_and_a_second_run_continues(spark, tmp_path, monkeypatch):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    landing, labels = tmp_path / "landing", tmp_path / "labels"
    for path in DEMO_RULES:
        apply_rules_file(spark, lakehouse, path)
    settings = LiveSettings(trigger="200 milliseconds")
    lines: list[str] = []
    # Patterns start every second: drain at 1 s (ends at 10 s), burst, spray, attack, then burst, spray, attack again.
    first = demo(spark, lakehouse, landing, labels, GeneratorConfig(rate=40, duration=10, pattern_every=1, run_id="1"),
                 settings, drain_timeout=240, log=lines.append)  # fmt: skip
    assert first.caught_up, "\n".join(lines)
    assert {p: (s.injected, s.caught) for p, s in first.score.patterns.items()} == {
        "drain": (1, 1), "burst": (2, 2), "password_spray": (2, 2), "login_attack": (2, 2)
    }  # fmt: skip
    assert first.score.false_positives == []
    assert first.latency_ms and all(0 < ms < 240_000 for ms in first.latency_ms)
    assert first.topic_latency_ms is None and not any("on the topic" in line for line in first.lines())
    # Where the batches' seconds went, step by step, for each layer (pipeline_metrics.step_ms).
    assert list(first.steps) == ["bronze", "silver", "gold"] and {"parse", "dedup"} <= set(first.steps["silver"])
    assert 0 < len(first.steps["gold"]["evaluate"]) <= len(first.layers["gold"].batch_ms)
    assert any(re.match(r"  gold   (\w+ [0-9.]+/[0-9.]+s, )*evaluate [0-9.]+/[0-9.]+s", line) for line in first.lines())
    # Each alert is printed as its batch commits, up to five a poll and the rest counted: however
    # the batches fell (a loaded host lands more alerts per poll), every alert is accounted for once.
    printed = [line for line in lines if line.startswith("  ALERT rule ")]
    counted = sum(int(m.group(1)) for line in lines if (m := re.fullmatch(r"  \.\.\. and (\d+) more alert\(s\)", line)))
    assert printed and len(printed) + counted == len(first.alerts), "\n".join(lines)
    assert set(printed) <= {_alert_line(a) for a in first.alerts}
    # The monitor had the alerts from gold's batches as they committed (a classic session); read
    # back from gold/alerts and pipeline_metrics (as under Spark Connect) they are the same.
    reader = Monitor(spark, lakehouse, [])
    reader._last_gold_batch = -1
    reader.layers["gold"].completed_batch_id = spark.read.format("delta").load(lakehouse.alerts).agg(F.max("gold_batch_id")).first()[0]
    assert sorted(first.alerts, key=repr) == sorted(reader._read_alerts(kept_rows(lakehouse, "gold")), key=repr) and len(first.alerts) == len(first.latency_ms)
    # Halfway through, a rule was edited; the first gold batch running with that commit, and the
    # first evaluating events with it, are timed from it.
    change = first.rule_change
    assert change is not None and change.applied and change.evaluated, "\n".join(lines)
    assert change.applied.batch_id <= change.evaluated.batch_id
    assert change.committed_ms < change.applied.end_ms <= change.evaluated.end_ms < change.committed_ms + 240_000
    assert any(line.startswith(f"rule change -> evaluator: rule {change.rule_id} edited") for line in first.lines())
    # The stream said when gold took the edit, as it says every new config/rules commit it runs.
    said = [line for entry in lines for line in entry.splitlines() if line.startswith("rules: gold now evaluates config/rules version ")]
    assert any(line.startswith(f"rules: gold now evaluates config/rules version {change.version} (") for line in said), "\n".join(lines)
    edited = spark.read.format("delta").load(lakehouse.rules).where(F.col("ruleId") == change.rule_id).first()
    assert edited.description.endswith("]") and "[edited live " in edited.description

    # The stop left checkpoints behind: the next start reads only the new files (no row read twice).
    # This run's feed is never told of a batch, as where foreachBatch runs in another process: the
    # monitor notices gold's first batch missing from it and reads the alerts from the tables.
    monkeypatch.setattr(AlertFeed, "__call__", lambda feed, batch_id, batch_end, alerts: None)
    lines.clear()
    second = demo(spark, lakehouse, landing, labels, GeneratorConfig(rate=40, duration=3, pattern_every=0.5, run_id="2"),
                  settings, drain_timeout=240, log=lines.append)  # fmt: skip
    assert second.caught_up and second.score.patterns["burst"].caught == 1 and not second.score.false_positives
    assert sum("alerts are read from gold/alerts from now on" in line for line in lines) == 1, "\n".join(lines)
    assert spark.read.format("delta").load(lakehouse.rules).where(F.col("ruleId") == change.rule_id).first().description.count("[edited live") == 1
    bronze = spark.read.format("delta").load(lakehouse.bronze_transactions)
    assert bronze.count() == first.generated.events + second.generated.events == 520
    assert spark.read.format("delta").load(lakehouse.silver_duplicates).count() == 0
    alerts = spark.read.format("delta").load(lakehouse.alerts)
    assert alerts.where(F.col("transaction_id").startswith("2-")).count() == 4  # burst events 5..8 of run 2

    # One ingest query wrote bronze and silver: both layers' metrics rows share its batch ids.
    metrics = spark.read.format("delta").load(lakehouse.pipeline_metrics)
    batches = {layer: sorted(r.batch_id for r in metrics.where(F.col("layer") == layer).collect()) for layer in ("bronze", "silver")}
    assert batches["bronze"] == batches["silver"] and batches["bronze"]
    landed = metrics.where(F.col("layer") == "bronze").agg(F.sum("rows_in")).first()[0]
    assert landed == bronze.count()
    with pytest.raises(CheckpointError, match="ingested by live mode"):
        check_queries(lakehouse, "bronze")  # the batch job would read every landed file again


@pytest.mark.slow
def test_demo_over_kafka_catches_every_pattern_and_publishes_every_alert(spark, tmp_path, kafka_broker):
    from conftest import consume_all

    from rulewatch.spark.layers.gold import GoldSettings
    from rulewatch.kafka.client import KafkaTopic
    from rulewatch.kafka.source import KafkaSource
    from rulewatch.spark.storage.checkpoints import gold_source

    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    for path in DEMO_RULES:
        apply_rules_file(spark, lakehouse, path)
    alerts_topic = KafkaTopic(kafka_broker, "demo-alerts")
    settings = LiveSettings(trigger="200 milliseconds", gold=GoldSettings(shards=4, alerts_topic=alerts_topic))
    lines: list[str] = []
    report = demo(spark, lakehouse, KafkaSource(KafkaTopic(kafka_broker, "demo-payments")), tmp_path / "labels",
                  GeneratorConfig(rate=40, duration=11, pattern_every=1, run_id="3"), settings, drain_timeout=240, log=lines.append)  # fmt: skip
    assert report.caught_up, "\n".join(lines)
    assert all(s.caught == s.injected > 0 for s in report.score.patterns.values()), report.score.patterns
    assert report.score.false_positives == []
    assert gold_source(lakehouse.checkpoint("gold")) == "kafka:demo-payments"  # a new gold over Kafka reads the topic itself
    bronze = spark.read.format("delta").load(lakehouse.bronze_transactions)
    assert bronze.count() == report.generated.events and bronze.where("kafka_topic = 'demo-payments'").count() == bronze.count()
    table = {r.alert_id for r in spark.read.format("delta").load(lakehouse.alerts).collect()}
    assert {r["alert_id"] for r in consume_all(alerts_topic, len(table))} == table
    # The first hop downstream, timed per alert from the topic's own record timestamps.
    assert report.topic_latency_ms is not None and len(report.topic_latency_ms) == len(table)
    assert all(0 < ms < 240_000 for ms in report.topic_latency_ms)
    assert any(line.startswith("ingest -> alert on the topic: p50 ") for line in report.lines())


def test_a_stream_that_has_not_drained_when_its_duration_ends_says_so_and_exits_1(spark, tmp_path, capsys):
    from rulewatch.cli.main import main

    landing = tmp_path / "landing"
    landing.mkdir()
    (landing / "a.jsonl").write_text('{"transactionId": "t1", "eventTime": 1, "payeeId": "p", "paymentAmount": 1}\n')
    # One second is less than the queries' first micro-batches take: the backlog is still going through.
    assert main(["stream", "--lakehouse", str(tmp_path / "lakehouse"), "--landing", str(landing), "--duration", "1", "--drain"]) == 1
    assert "rulewatch stream: NOT drained within --duration 1s" in capsys.readouterr().err
