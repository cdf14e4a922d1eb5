"""Live mode under SIGKILL: `rulewatch stream` killed and restarted ends where the batch job ends.

The same generated lines as test_crash.py, from a landing folder or a Kafka topic, through the live
queries (ingest: bronze + silver in one micro-batch; gold). Attempts are killed inside the ingest
batch (silver committed, the metrics row not; bronze, quarantine and duplicates maybe), inside a gold batch (from Kafka
after its alerts were published and appended; from files after its metrics row was kept in a file
for a later commit), and at a random moment; the last attempt runs until drained. Alerts must
equal the job's over the same lines, each once; every line must be in bronze once and in exactly
one of silver, quarantine, duplicates.
From Kafka the alerts also go to an alerts topic, which must hold every gold alert as committed (at
least once: a replayed batch publishes its alerts again, differing in their decision time alone).
"""

from __future__ import annotations

import json
import random
import signal
import time
import uuid
from pathlib import Path

import pytest

from conftest import consume_all
from rulewatch.cli.main import main
from rulewatch.spark.storage.checkpoints import last_planned_batch
from rulewatch.spark.storage.delta_log import newest_committed_batch
from rulewatch.kafka.alerts import records
from rulewatch.kafka.client import KafkaTopic, ensure_topic
from rulewatch.kafka.produce import send_all
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.storage.metrics import PENDING
from rulewatch.spark.layers.pipeline import summarize
from processes import RULES, crash_files, decided_alerts, land, run_cli

pytestmark = [pytest.mark.jvm, pytest.mark.subprocess, pytest.mark.slow]

# An attempt whose kill point never comes drains and ends by itself; this only bounds a stuck one.
DRAIN_SECONDS = 240


def _arguments(lakehouse: Lakehouse, source: list[str], seconds: float) -> list[str]:
    return ["stream", "--lakehouse", lakehouse.root, *source, "--rules", RULES, "--duration", str(seconds), "--drain"]


def _stream(lakehouse: Lakehouse, source: list[str], seconds: float, crash_at: str | None = None, kill_after: float | None = None) -> int:
    """One ``rulewatch stream --drain`` of at most ``seconds``; its exit code (-9 when killed)."""
    return run_cli(_arguments(lakehouse, source, seconds), crash_at, kill_after, timeout=seconds + 300)


@pytest.fixture(params=["files", pytest.param("kafka", marks=pytest.mark.kafka), pytest.param("kafka-direct", marks=pytest.mark.kafka)])
def source(request, tmp_path) -> tuple[list[str], KafkaTopic | None]:
    """The stream's source options, and the alerts topic it publishes to (Kafka only). ``kafka``: gold reads
    silver (``--gold-source silver``); ``kafka-direct``: the topic itself, a new gold's default over Kafka,
    its de-duplication state killed and restarted with it."""
    if request.param == "files":
        for name, lines in crash_files():
            land(tmp_path / "landing", name, lines)
        return ["--landing", str(tmp_path / "landing")], None
    bootstrap = request.getfixturevalue("kafka_broker")
    topic = KafkaTopic(bootstrap, f"live-crash-{uuid.uuid4().hex[:8]}")
    ensure_topic(topic, partitions=1)  # the files' order, so first-wins matches the job's
    send_all(topic, [line for _, lines in crash_files() for line in lines])
    alerts = KafkaTopic(bootstrap, f"live-crash-alerts-{uuid.uuid4().hex[:8]}")
    ensure_topic(alerts)
    gold_source = ["--gold-source", "silver"] if request.param == "kafka" else []
    return ["--kafka-bootstrap", bootstrap, "--kafka-topic", topic.topic, "--alerts-topic", alerts.topic, *gold_source], alerts


def test_live_mode_killed_and_restarted_gives_the_jobs_alerts_exactly_once(spark, uninterrupted, source, tmp_path):
    expected_lakehouse, landed = uninterrupted, sum(len(lines) for _, lines in crash_files())
    options, alerts_topic = source
    direct = alerts_topic is not None and "--gold-source" not in options
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    kills = []
    started = time.monotonic()

    def next_gold_batch() -> int:
        return last_planned_batch(lakehouse.checkpoint("gold")) + 1 if Path(lakehouse.checkpoint("gold")).exists() else 0

    # Gold reads silver's table (or, direct, the same lines from the topic), so each source takes one of
    # gold's two points: Kafka the one after the batch's alerts were published and appended (its replay
    # publishes them again), the landing folder the later one, after the metrics row was kept in a file.
    gold_point = "rulewatch.gold.alerts:{}:after" if alerts_topic else "rulewatch.metrics.gold:{}:kept"
    if direct:
        # Gold's first batch reads every line from the topic itself, alerts included, so its kill comes
        # first (with the de-duplication state); the ingest kill is [kafka]'s, the same code.
        assert _stream(lakehouse, options, DRAIN_SECONDS, crash_at=gold_point.format(0)) == -signal.SIGKILL
        kills.append(gold_point.format(0))
        reached = time.monotonic() - started
    else:
        # Silver committed inside the first ingest batch; the metrics row not, and bronze, quarantine and
        # duplicates (written at the same time) maybe. Bronze's append has the same sink name as silver's,
        # so the point names the table: a kill after bronze alone left gold's batch 0 free to run before
        # the restart's ingest wrote silver, with no alert for the gold kill below to publish.
        assert _stream(lakehouse, options, DRAIN_SECONDS, crash_at="rulewatch.ingest.transactions@silver/transactions:0:after") == -signal.SIGKILL
        assert newest_committed_batch(lakehouse.silver_transactions, "rulewatch.ingest.transactions") == 0
        kills.append("ingest batch 0 after silver")
        reached = time.monotonic() - started
        # Inside gold's first batch, while its lines are still to evaluate, so this kill comes whatever the
        # random one below leaves.
        gold_batch = next_gold_batch()
        assert _stream(lakehouse, options, DRAIN_SECONDS, crash_at=gold_point.format(gold_batch)) == -signal.SIGKILL
        kills.append(gold_point.format(gold_batch))
    seconds = random.Random(time.time_ns()).uniform(0.5, 1.5) * reached
    if _stream(lakehouse, options, DRAIN_SECONDS, kill_after=seconds) == -signal.SIGKILL:
        kills.append(f"random kill after {seconds:.0f}s")
    # The restart after the kills in this process, on the tests' session: it resumes from what is on disk, as a new process would.
    assert main(_arguments(lakehouse, options, DRAIN_SECONDS)) == 0

    assert len(kills) >= (1 if direct else 2), kills
    # Every gold batch the checkpoint committed has its metrics row, once (none left in a file).
    metrics = spark.read.format("delta").load(lakehouse.pipeline_metrics).where("layer = 'gold'")
    committed = max(int(p.name) for p in Path(lakehouse.checkpoint("gold"), "commits").iterdir() if p.name.isdigit())
    assert sorted(r.batch_id for r in metrics.where(f"batch_id <= {committed}").collect()) == list(range(committed + 1)), kills
    assert not any(Path(lakehouse.checkpoint("gold"), PENDING).glob("*.json"))
    expected, actual = decided_alerts(spark, expected_lakehouse), decided_alerts(spark, lakehouse)
    assert len(expected) > 20
    assert actual == expected, kills  # none missing, none twice
    after, before = summarize(spark, lakehouse), summarize(spark, expected_lakehouse)
    assert after.bronze == landed and after.balanced
    assert (after.silver, after.quarantined, after.duplicates, after.late) == (before.silver, before.quarantined, before.duplicates, before.late)
    if alerts_topic:
        rows = [json.loads(r.value) for r in records(spark.read.format("delta").load(lakehouse.alerts)).collect()]
        published: dict[str, list[dict]] = {}
        for record in consume_all(alerts_topic, len(rows)):
            published.setdefault(record["alert_id"], []).append({k: v for k, v in record.items() if k != "key"})
        assert set(published) == {row["alert_id"] for row in rows}, kills  # every gold alert, and nothing gold does not hold
        assert all(row in published[row["alert_id"]] for row in rows), kills  # the committed row, as it is
        # A repeat (a replayed batch published again) carries its own decision time, nothing else of its own.
        undecided = [{json.dumps({k: v for k, v in r.items() if k not in ("decision_time", "latency_ms")}, sort_keys=True) for r in repeats}
                     for repeats in published.values()]  # fmt: skip
        assert all(len(kinds) == 1 for kinds in undecided), kills
        assert any(len(repeats) > 1 for repeats in published.values()), kills  # the gold kill came after its batch published
