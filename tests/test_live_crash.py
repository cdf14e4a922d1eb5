"""Live mode under SIGKILL: `rulewatch stream` killed and restarted ends where the batch job ends.

The same generated lines as test_crash.py, from a landing folder or a Kafka topic, through the live
queries (ingest: bronze + silver in one micro-batch; gold, from silver's table or, over Kafka, from the
topic itself with silver's de-duplication as its own state). Attempts are killed inside the ingest
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
from collections.abc import Callable
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


@pytest.fixture(params=["files", pytest.param("kafka", marks=pytest.mark.kafka)])
def source(request, tmp_path) -> tuple[list[str], KafkaTopic | None, Callable[[], None]]:
    """The stream's source options, the alerts topic it publishes to (Kafka only), and what lands the rest
    of the lines after the first kill. From the landing folder gold reads silver; from Kafka it reads the
    topic itself (a new gold's default there), its de-duplication state killed and restarted with it, and
    the topic holds the first file alone until the first kill, so gold's kill below has lines of its own
    to come (gold and ingest read the topic side by side)."""
    files = crash_files()
    if request.param == "files":
        for name, lines in files:
            land(tmp_path / "landing", name, lines)
        return ["--landing", str(tmp_path / "landing")], None, lambda: None
    bootstrap = request.getfixturevalue("kafka_broker")
    topic = KafkaTopic(bootstrap, f"live-crash-{uuid.uuid4().hex[:8]}")
    ensure_topic(topic, partitions=1)  # the files' order, so first-wins matches the job's
    send_all(topic, files[0][1])
    alerts = KafkaTopic(bootstrap, f"live-crash-alerts-{uuid.uuid4().hex[:8]}")
    ensure_topic(alerts)
    return (["--kafka-bootstrap", bootstrap, "--kafka-topic", topic.topic, "--alerts-topic", alerts.topic], alerts,
            lambda: send_all(topic, [line for _, lines in files[1:] for line in lines]))  # fmt: skip


def test_live_mode_killed_and_restarted_gives_the_jobs_alerts_exactly_once(spark, uninterrupted, source, tmp_path):
    expected_lakehouse, landed = uninterrupted, sum(len(lines) for _, lines in crash_files())
    options, alerts_topic, land_the_rest = source
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    kills = []
    started = time.monotonic()

    # Silver committed inside the first ingest batch; the metrics row not, and bronze, quarantine and
    # duplicates (written at the same time) maybe. Bronze's append has the same sink name as silver's,
    # so the point names the table: a kill after bronze alone left gold's batch 0 free to run before
    # the restart's ingest wrote silver, with no alert for the gold kill below to publish.
    assert _stream(lakehouse, options, DRAIN_SECONDS, crash_at="rulewatch.ingest.transactions@silver/transactions:0:after") == -signal.SIGKILL
    assert newest_committed_batch(lakehouse.silver_transactions, "rulewatch.ingest.transactions") == 0
    kills.append("ingest batch 0 after silver")
    reached = time.monotonic() - started
    land_the_rest()
    # Inside gold's next batch, while its lines are still to evaluate, so this kill comes whatever the
    # random one below leaves: from files gold's lines are silver's batch 0, from Kafka the lines just sent.
    # Kafka takes the point after the batch's alerts were published and appended (its replay publishes
    # them again), the landing folder the later one, after the metrics row was kept in a file.
    gold_point = "rulewatch.gold.alerts:{}:after" if alerts_topic else "rulewatch.metrics.gold:{}:kept"
    gold_batch = last_planned_batch(lakehouse.checkpoint("gold")) + 1 if Path(lakehouse.checkpoint("gold")).exists() else 0
    assert _stream(lakehouse, options, DRAIN_SECONDS, crash_at=gold_point.format(gold_batch)) == -signal.SIGKILL
    kills.append(gold_point.format(gold_batch))
    seconds = random.Random(time.time_ns()).uniform(0.5, 1.5) * reached
    if _stream(lakehouse, options, DRAIN_SECONDS, kill_after=seconds) == -signal.SIGKILL:
        kills.append(f"random kill after {seconds:.0f}s")
    # The restart after the kills in this process, on the tests' session: it resumes from what is on disk, as a new process would.
    assert main(_arguments(lakehouse, options, DRAIN_SECONDS)) == 0

    assert len(kills) >= 2, kills
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
