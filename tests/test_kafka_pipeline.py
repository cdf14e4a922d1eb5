"""Kafka in and out, through a real broker: the job over a topic, alerts on a topic, kill -9 and restart.

The fixtures' lines go onto a one-partition topic in file order, each keyed, so the job over Kafka
must give exactly the alerts of the job over the landing folder (fixture_run); a few unkeyed records
no file could carry (invalid UTF-8, a tombstone) are quarantined with reasons. Alerts are read back
from the alerts topic with a real consumer and with Spark's Kafka source, and compared with the
``gold/alerts`` rows field by field. Starting offsets and the per-batch cap are checked on bronze
alone, over topics of a few records.
"""

from __future__ import annotations

import signal
import uuid
from collections import Counter

import pytest
from pyspark.sql import functions as F

from conftest import FIXTURES, ROOT, consume_all
from rulewatch.spark.layers.gold import GoldSettings
from rulewatch.kafka.alerts import records
from rulewatch.kafka.client import KafkaTopic, ensure_topic, spark_options
from rulewatch.kafka.produce import TopicWriter, send_all
from rulewatch.kafka.source import KafkaSource
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.layers.pipeline import run_all, run_bronze
from processes import PROCESSING_COLUMNS, RULES, attempt, finish, held_keysets

pytestmark = [pytest.mark.jvm, pytest.mark.kafka]

BAD_RECORDS = [b'{"transactionId": "k-bad-utf8", "eventTime": 1, "payeeId": "\xff\xfe"}', None]


def _fixture_lines() -> list[str]:
    return [line for path in sorted((FIXTURES / "transactions").glob("*.jsonl")) for line in path.read_text().splitlines()]


def _key(index: int) -> str:
    return f"line-{index}"


def _decisions(frame) -> list[tuple]:
    return sorted(tuple(r) for r in frame.drop(*PROCESSING_COLUMNS).collect())


def _published(spark, topic: KafkaTopic, schema):
    """Every record on ``topic`` read with Spark's Kafka source: its key and its value parsed as ``schema``'s row."""
    records = spark.read.format("kafka").options(**spark_options(topic)).option("subscribe", topic.topic).load()
    return records.select(
        F.col("key").cast("string").alias("key"),
        F.col("value").cast("string").alias("value"),
        F.from_json(F.col("value").cast("string"), schema).alias("row"),
    )


def _values(frame) -> set[str]:
    """The alert rows of ``frame`` as the topic's record values."""
    return {r.value for r in records(frame).collect()}


def _rows(frame, schema) -> list[tuple]:
    return sorted(tuple(r) for r in frame.select(*schema.fieldNames()).collect())


@pytest.fixture(scope="module")
def transactions_topic(kafka_broker) -> KafkaTopic:
    topic = KafkaTopic(kafka_broker, f"transactions-{uuid.uuid4().hex[:8]}")
    ensure_topic(topic, partitions=1)  # one partition: the files' order, so first-wins matches
    with TopicWriter(topic) as writer:
        for index, line in enumerate(_fixture_lines()):
            writer.send(line, _key(index))
        for value in BAD_RECORDS:
            writer.send(value)
    return topic


@pytest.fixture(scope="module")
def kafka_run(spark, kafka_broker, transactions_topic, tmp_path_factory):
    alerts = KafkaTopic(kafka_broker, f"alerts-{uuid.uuid4().hex[:8]}")
    ensure_topic(alerts)
    lakehouse = Lakehouse(str(tmp_path_factory.mktemp("kafka-run") / "lakehouse"))
    _, summary = run_all(
        spark, lakehouse, KafkaSource(transactions_topic), RULES, GoldSettings(alerts_topic=alerts), log=lambda _: None
    )
    return lakehouse, summary, alerts


def test_the_job_over_kafka_raises_exactly_the_alerts_of_the_landing_folder(spark, fixture_run, kafka_run):
    lakehouse, summary, _ = kafka_run
    read = lambda lh: spark.read.format("delta").load(lh.alerts)  # noqa: E731
    assert summary.alerts > 0
    assert _decisions(read(lakehouse)) == _decisions(read(fixture_run.lakehouse))
    assert summary.silver == fixture_run.summary.silver and summary.duplicates == fixture_run.summary.duplicates
    assert summary.ok and summary.bronze == len(_fixture_lines()) + len(BAD_RECORDS)
    assert any(line.startswith("source           Kafka topic") for line in summary.lines())


def test_bronze_keeps_each_record_with_its_coordinates(spark, kafka_run, transactions_topic):
    lakehouse, _, _ = kafka_run
    bronze = spark.read.format("delta").load(lakehouse.bronze_transactions)
    rows = bronze.orderBy("kafka_offset").collect()
    assert [r.kafka_offset for r in rows] == list(range(len(rows)))
    assert {r.kafka_topic for r in rows} == {transactions_topic.topic} and {r.kafka_partition for r in rows} == {0}
    assert all(r.kafka_timestamp is not None and r.ingest_seq == r.kafka_offset for r in rows)
    assert [r.value for r in rows[: len(_fixture_lines())]] == _fixture_lines()
    keys = [None if r.kafka_key is None else bytes(r.kafka_key).decode() for r in rows]
    assert keys == [_key(i) for i in range(len(_fixture_lines()))] + [None] * len(BAD_RECORDS)
    bad_utf8 = rows[len(_fixture_lines())]
    assert bytes(bad_utf8.value_bytes) == BAD_RECORDS[0] and "\ufffd" in bad_utf8.value


def test_records_no_file_could_carry_are_quarantined_with_reasons(spark, fixture_run, kafka_run):
    lakehouse, summary, _ = kafka_run
    assert summary.quarantined == fixture_run.summary.quarantined + len(BAD_RECORDS)
    quarantine = spark.read.format("delta").load(lakehouse.silver_quarantine)
    kafka_only = quarantine.where(F.col("source_file").startswith("kafka:")).join(
        spark.read.format("delta").load(fixture_run.lakehouse.silver_quarantine).select("value"), "value", "left_anti"
    )
    reasons = [r.reason for r in kafka_only.collect()]
    assert len(reasons) == len(BAD_RECORDS) and all(reasons), reasons


def test_every_alert_is_on_the_alerts_topic_keyed_by_rule_and_group(spark, kafka_run):
    lakehouse, summary, topic = kafka_run
    published = consume_all(topic, summary.alerts)
    table = spark.read.format("delta").load(lakehouse.alerts).collect()
    assert sorted(r["alert_id"] for r in published) == sorted(r.alert_id for r in table)
    assert all(r["key"] == f"{r['rule_id']}:{r['group_key']}" for r in published)


def test_each_record_on_the_alerts_topic_is_its_gold_alerts_row(spark, kafka_run):
    lakehouse, _, topic = kafka_run
    table = spark.read.format("delta").load(lakehouse.alerts)
    published = _published(spark, topic, table.schema).select("row.*")
    by_id = {r.alert_id: r for r in table.collect()}
    records = published.collect()
    assert len(records) == len(by_id) and {r.alert_id for r in records} == set(by_id)
    for record in records:
        row = by_id[record.alert_id]
        # What the evaluator decided and when: the topic must carry the table's time, to the microsecond.
        assert (record.decision_time, record.latency_ms, record.gold_batch_id) == (row.decision_time, row.latency_ms, row.gold_batch_id)
    assert _rows(published, table.schema) == _rows(table, table.schema)  # every other field too


# Killed in this order on one lakehouse, each restart resuming what the kill before left: bronze
# committed but not its offsets; gold's alerts on the topic but not in Delta; then in Delta too but gold's
# batch not committed. The run after the last kill must leave what one uninterrupted run leaves.
KILL_POINTS = [
    "rulewatch.bronze.transactions:0:after",
    "rulewatch.kafka.alerts:0:after",
    "rulewatch.gold.alerts:0:after",
]


@pytest.mark.subprocess
@pytest.mark.slow
def test_kills_at_every_point_over_kafka_lose_no_alert_and_duplicate_none_in_delta(
    spark, kafka_run, kafka_broker, transactions_topic, tmp_path
):
    alerts = KafkaTopic(kafka_broker, f"alerts-crash-{uuid.uuid4().hex[:8]}")
    ensure_topic(alerts)
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    source = ["--kafka-bootstrap", kafka_broker, "--kafka-topic", transactions_topic.topic]
    extra = ["--alerts-topic", alerts.topic]
    for point in KILL_POINTS:
        assert attempt(lakehouse, source, crash_at=point, extra=extra) == -signal.SIGKILL, f"{point} was not reached"
    assert finish(lakehouse, source, extra) == 0

    table = spark.read.format("delta").load(lakehouse.alerts)
    reference = spark.read.format("delta").load(kafka_run[0].alerts)
    assert _decisions(table) == _decisions(reference)
    ids = [r.alert_id for r in table.collect()]
    assert len(ids) == len(set(ids))
    assert held_keysets(spark, lakehouse) == held_keysets(spark, kafka_run[0])  # each once, whether or not a killed batch 0 wrote them
    published = Counter(r["alert_id"] for r in consume_all(alerts, 3 * len(ids)))
    # At least once: gold's batch 0 ran three times (killed twice after publishing, then finished), and
    # each time published every alert again with the same id.
    assert published == {alert_id: 3 for alert_id in ids}
    # The topic is written first, each attempt with its own decision time: every gold/alerts row is on
    # the topic as it is (published by the attempt that committed it), and a repeat differs from it in
    # that time alone.
    on_topic = _published(spark, alerts, table.schema)
    assert _values(table) <= {r.value for r in on_topic.collect()}
    undecided = [c for c in table.columns if c not in ("decision_time", "latency_ms")]
    assert _values(on_topic.select("row.*").select(undecided)) == _values(table.select(undecided))
    bronze = spark.read.format("delta").load(lakehouse.bronze_transactions)
    assert bronze.count() == bronze.select("kafka_partition", "kafka_offset").distinct().count() == len(_fixture_lines()) + len(BAD_RECORDS)


def test_a_lakehouse_that_ingests_a_folder_refuses_a_topic(spark, fixture_run, transactions_topic):
    from rulewatch.spark.layers.bronze import check_source
    from rulewatch.spark.layers.landing import LandingError

    with pytest.raises(LandingError, match=f"ingests the landing folder .*, not Kafka topic {transactions_topic.topic}"):
        check_source(fixture_run.lakehouse, KafkaSource(transactions_topic))


def _small_topic(bootstrap: str, prefix: str, values: list[str]) -> KafkaTopic:
    topic = KafkaTopic(bootstrap, f"{prefix}-{uuid.uuid4().hex[:8]}")
    ensure_topic(topic, partitions=1)
    send_all(topic, values)
    return topic


def test_starting_offsets_latest_skips_the_records_already_on_the_topic(spark, kafka_broker, tmp_path):
    old, new = [f'{{"transactionId": "old-{i}"}}' for i in range(5)], [f'{{"transactionId": "new-{i}"}}' for i in range(3)]
    topic = _small_topic(kafka_broker, "latest", old)
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    source = KafkaSource(topic, starting_offsets="latest")
    run_bronze(spark, lakehouse, source, log=lambda _: None)  # a new checkpoint: starts at the end, reads nothing
    send_all(topic, new)
    run_bronze(spark, lakehouse, source, log=lambda _: None)  # the checkpoint continues where it started
    rows = spark.read.format("delta").load(lakehouse.bronze_transactions).orderBy("kafka_offset").collect()
    assert [(r.kafka_offset, r.value) for r in rows] == list(enumerate(new, start=len(old)))


@pytest.mark.notebook
def test_the_bronze_notebook_passes_kafka_max_offsets_and_each_batch_keeps_to_it(spark, kafka_broker, tmp_path, notebook_kernel):
    import nbformat

    values = [f'{{"transactionId": "capped-{i}"}}' for i in range(7)]
    topic = _small_topic(kafka_broker, "capped", values)
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    widgets = {"lakehouse": lakehouse.root, "kafka_bootstrap": kafka_broker, "kafka_topic": topic.topic, "kafka_max_offsets": "3"}
    notebook = nbformat.read(ROOT / "notebooks" / "01_bronze.ipynb", as_version=4)
    notebook_kernel.run(notebook, widgets, timeout=600)

    batches = spark.read.format("delta").load(lakehouse.pipeline_metrics).where("layer = 'bronze'").orderBy("batch_id")
    assert [r.rows_in for r in batches.collect()] == [3, 3, 1]
    bronze = spark.read.format("delta").load(lakehouse.bronze_transactions).orderBy("kafka_offset")
    assert [r.value for r in bronze.collect()] == values
