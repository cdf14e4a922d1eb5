"""Gold straight from the Kafka source (``--gold-source topic``) decides exactly as gold from silver.

One topic (one partition: a line's place is its offset in both queries) holds the fixtures' lines and
repeats that would each push a key over rule 1's limit if counted twice: the same id in NFC's two
forms, an id with the Kelvin sign against its ASCII K, and a conflicting repeat. The live stream with
gold reading the topic itself must raise the alerts the batch job raises from silver, no more.
"""

from __future__ import annotations

import json
import uuid

import pytest

from rulewatch.kafka.client import KafkaTopic, ensure_topic
from rulewatch.kafka.produce import TopicWriter
from rulewatch.kafka.source import KafkaSource
from rulewatch.spark.control.rules_table import apply_rules_file
from rulewatch.spark.layers.gold import GoldSettings
from rulewatch.spark.layers.pipeline import run_all
from rulewatch.spark.layers.rescale import rescale_gold
from rulewatch.spark.live.streams import LiveSettings, stream
from rulewatch.spark.storage.checkpoints import check_gold_layout
from rulewatch.spark.storage.delta_log import CheckpointError
from rulewatch.spark.storage.lakehouse import Lakehouse
from conftest import FIXTURES
from processes import PROCESSING_COLUMNS, RULES

pytestmark = [pytest.mark.slow]


def _line(tid: str, payee: str, amount: object, at: str = "2026-11-01T10:30:00Z") -> str:
    return json.dumps({"transactionId": tid, "eventTime": at, "payeeId": payee, "beneficiaryId": "ben-r",
                       "paymentAmount": amount, "paymentType": "CRD"}, ensure_ascii=False)  # fmt: skip


# Each pair is one payment to silver: counted twice, its key would pass rule 1's 1000.
REPEATS = [
    _line("nfc-caf\u00e9", "payee-N", 700), _line("nfc-cafe\u0301", "payee-N", 700),
    _line("\u212a-7", "payee-K", 700), _line("K-7", "payee-K", 700),
    _line("conflict-1", "payee-C", 600), _line("conflict-1", "payee-C", 500),
]  # fmt: skip


@pytest.fixture(scope="module")
def topic(kafka_broker) -> KafkaTopic:
    topic = KafkaTopic(kafka_broker, f"direct-{uuid.uuid4().hex[:8]}")
    ensure_topic(topic, partitions=1)
    lines = [line for path in sorted((FIXTURES / "transactions").glob("*.jsonl")) for line in path.read_text().splitlines()]
    with TopicWriter(topic) as writer:
        for line in [*lines, *REPEATS, "not json"]:
            writer.send(line)
    return topic


# Sent once both have read the rest: hours behind the watermark by then, so late, and recorded.
LATE = [_line("late-1", "payee-L", 5, "2026-11-01T07:00:00Z"), _line("late-2", "payee-L", 7, "2026-11-01T07:01:00Z")]


def _decisions(spark, lakehouse: Lakehouse) -> list[tuple]:
    return sorted(tuple(r) for r in spark.read.format("delta").load(lakehouse.alerts).drop(*PROCESSING_COLUMNS).collect())


def _late(spark, lakehouse: Lakehouse) -> list[tuple]:
    return sorted((r.transaction_id, r.reason) for r in spark.read.format("delta").load(lakehouse.late_events).collect())


def test_gold_from_the_topic_raises_the_alerts_gold_from_silver_raises(spark, topic, tmp_path):
    from_silver, direct = Lakehouse(str(tmp_path / "from-silver")), Lakehouse(str(tmp_path / "direct"))
    apply_rules_file(spark, direct, RULES)

    def both() -> None:
        run_all(spark, from_silver, KafkaSource(topic), RULES, GoldSettings(), log=lambda _: None)
        monitor = stream(spark, direct, KafkaSource(topic), LiveSettings(gold_from_source=True), duration=240, log=lambda _: None, drain=True)
        assert monitor.drained_in is not None, "the stream did not drain"

    both()
    with TopicWriter(topic) as writer:
        for line in LATE:
            writer.send(line)
    both()
    late = _late(spark, from_silver)
    assert {tid for tid, _ in late} >= {"late-1", "late-2"} and _late(spark, direct) == late  # none dropped unseen

    expected = _decisions(spark, from_silver)
    assert expected and _decisions(spark, direct) == expected
    alerted = {r.group_key for r in spark.read.format("delta").load(direct.alerts).collect()}
    assert not alerted & {"payee-N|ben-r", "payee-K|ben-r", "payee-C|ben-r"}  # no repeat counted twice
    # Silver is written beside it as before, with the repeats and the bad line where silver puts them.
    duplicates = spark.read.format("delta").load(direct.silver_duplicates)
    assert {r.transaction_id for r in duplicates.collect()} >= {"nfc-caf\u00e9", "K-7", "conflict-1"}

    # The checkpoint's offsets are the topic's: gold cannot be pointed back at silver, nor rescaled
    # (a rescale carries silver's versions over).
    with pytest.raises(CheckpointError, match="reads kafka:"):
        check_gold_layout(direct.checkpoint("gold"), GoldSettings().layout, source="silver")
    with pytest.raises(CheckpointError, match="a rescale moves only a gold that reads silver"):
        rescale_gold(spark, direct, 2, say=lambda _: None)
