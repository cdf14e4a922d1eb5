"""Live mode under SIGKILL: `rulewatch stream` killed and restarted ends where the batch job ends.

The same generated lines as test_crash.py, from a landing folder or a Kafka topic, through the live
queries (ingest: bronze + silver in one micro-batch; gold, from silver's table or, over Kafka, from the
topic itself with silver's de-duplication as its own state). Attempts are killed inside the ingest
batch (silver committed, the metrics row not; bronze, quarantine and duplicates maybe), inside a gold batch (from Kafka
after its alerts were published and appended; from files after its metrics row was kept in a file
for a later commit), and at a random moment; the last attempt runs until drained. Alerts must
equal the job's over the same lines, each once; every line must be in bronze once and in exactly
one of silver, quarantine, duplicates.
Gold publishes to an alerts topic from either source, which must hold every gold alert as committed (at
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
from rulewatch.spark.storage.delta_log import newest_committed_batch
from rulewatch.kafka.alerts import records
from rulewatch.kafka.client import KafkaTopic, ensure_topic
from rulewatch.kafka.produce import send_all
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.storage.metrics import PENDING
from rulewatch.spark.layers.pipeline import summarize
from processes import RULES, crash_files, decided_alerts, land, next_batch, run_cli

pytestmark = [pytest.mark.jvm, pytest.mark.subprocess, pytest.mark.slow]

# An attempt whose kill point never comes drains and ends by itself; this only bounds a stuck one.
DRAIN_SECONDS = 240


def _arguments(lakehouse: Lakehouse, source: list[str], seconds: float) -> list[str]:
    return ["stream", "--lakehouse", lakehouse.root, *source, "--rules", RULES, "--duration", str(seconds), "--drain"]


def _stream(lakehouse: Lakehouse, source: list[str], seconds: float, crash_at: str | None = None, kill_after: float | None = None) -> int:
    """One ``rulewatch stream --drain`` of at most ``seconds``; its exit code (-9 when killed)."""
    return run_cli(_arguments(lakehouse, source, seconds), crash_at, kill_after, timeout=seconds + 300)


@pytest.fixture(params=["files", "kafka"])
def source(request, tmp_path, kafka_broker) -> tuple[list[str], KafkaTopic, Callable[[], None], str]:
    """The stream's source options, the alerts topic it publishes to, what sends the rest of the lines
    after the first kill, and gold's kill point (a format string taking the batch id).

    From the landing folder gold reads silver's table, and every file lands up front. From Kafka gold
    reads the topic itself (a new gold's default there), its de-duplication state killed and restarted
    with it; the topic holds the first file alone until the first kill, so gold's kill has lines still
    to come whether or not gold planned a batch before that kill (gold and ingest read the topic side
    by side). Both publish to an alerts topic, each at one of gold's two points: from Kafka after the
    batch's alerts were published and appended, from the landing folder the later one, after its
    metrics row was kept in a file for a later commit; a replay of either publishes the batch again."""
    files = crash_files()
    alerts = KafkaTopic(kafka_broker, f"live-crash-alerts-{uuid.uuid4().hex[:8]}")
    ensure_topic(alerts)
    publish = ["--kafka-bootstrap", kafka_broker, "--alerts-topic", alerts.topic]
    if request.param == "files":
        for name, lines in files:
            land(tmp_path / "landing", name, lines)
        return ["--landing", str(tmp_path / "landing"), *publish], alerts, lambda: None, "rulewatch.metrics.gold:{}:kept"
    topic = KafkaTopic(kafka_broker, f"live-crash-{uuid.uuid4().hex[:8]}")
    ensure_topic(topic, partitions=1)  # the files' order, so first-wins matches the job's
    send_all(topic, files[0][1])
    rest = [line for _, lines in files[1:] for line in lines]
    return ["--kafka-topic", topic.topic, *publish], alerts, lambda: send_all(topic, rest), "rulewatch.gold.alerts:{}:after"


def test_live_mode_killed_and_restarted_gives_the_jobs_alerts_exactly_once(spark, uninterrupted, source, tmp_path):
    expected_lakehouse, landed = uninterrupted, sum(len(lines) for _, lines in crash_files())
    options, alerts_topic, send_the_rest, gold_point = source
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    kills = []
    started = time.monotonic()

    # Silver committed inside the first ingest batch; the metrics row not, and bronze, quarantine and
    # duplicates (written at the same time) maybe. Bronze's append has the same sink name as silver's,
    # so the point names the table: from the landing folder, a kill after bronze alone left gold's batch 0
    # free to run before the restart's ingest wrote silver, with no alert for the gold kill below to publish.
    assert _stream(lakehouse, options, DRAIN_SECONDS, crash_at="rulewatch.ingest.transactions@silver/transactions:0:after") == -signal.SIGKILL
    assert newest_committed_batch(lakehouse.silver_transactions, "rulewatch.ingest.transactions") == 0
    kills.append("ingest batch 0 after silver")
    reached = time.monotonic() - started
    send_the_rest()
    # Inside gold's next batch (a batch the killed attempt planned is replayed first), while its lines are
    # still to evaluate, so this kill comes whatever the random one below leaves.
    gold_batch = next_batch(lakehouse, "gold")
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
