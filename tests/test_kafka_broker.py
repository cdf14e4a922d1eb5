"""The local broker (`rulewatch kafka`): a real Apache Kafka in KRaft mode, started from the fetched jars."""

from __future__ import annotations

import json
import uuid

import pytest

from rulewatch.cli.main import main
from rulewatch.kafka import broker
from rulewatch.kafka.client import KafkaTopic, client_config, ensure_topic
from rulewatch.kafka.produce import send_all


def _read(topic: KafkaTopic, expected: int, timeout: float = 30) -> list[tuple[int, bytes | None]]:
    import time

    from confluent_kafka import Consumer

    consumer = Consumer(client_config(topic) | {"group.id": str(uuid.uuid4()), "auto.offset.reset": "earliest"})
    consumer.subscribe([topic.topic])
    out: list[tuple[int, bytes | None]] = []
    deadline = time.monotonic() + timeout
    while len(out) < expected and time.monotonic() < deadline:
        message = consumer.poll(0.5)
        if message is not None and message.error() is None:
            out.append((message.partition(), message.value()))
    consumer.close()
    return out


@pytest.mark.kafka
def test_records_survive_a_restart_of_the_broker(tmp_path):
    first = broker.start(tmp_path)
    try:
        assert broker.start(tmp_path) == first  # a second start finds the running one
        topic = KafkaTopic(first.bootstrap, "t")
        ensure_topic(topic, partitions=2)
        values = [f"record {i}".encode() for i in range(100)]
        send_all(topic, values)
        assert sorted(v for _, v in _read(topic, 100)) == sorted(values)
        assert broker.stop(tmp_path)
        assert broker.running(tmp_path) is None
        again = broker.start(tmp_path)
        assert again.bootstrap == first.bootstrap and again.pid != first.pid
        read = _read(topic, 100)
        assert sorted(v for _, v in read) == sorted(values)
    finally:
        broker.stop(tmp_path)
    assert not broker.stop(tmp_path)  # nothing left to stop


@pytest.mark.kafka
def test_the_cli_starts_reports_and_stops_a_broker(tmp_path, capsys):
    folder = str(tmp_path / "kafka")
    assert main(["kafka", "start", "--dir", folder]) == 0
    bootstrap = capsys.readouterr().out.split()[1]
    try:
        assert bootstrap.startswith("127.0.0.1:")
        assert main(["kafka", "status", "--dir", folder]) == 0
        assert main(["kafka", "topic", "--bootstrap", bootstrap, "--name", "alerts"]) == 0
        assert main(["kafka", "topic", "--bootstrap", bootstrap, "--name", "alerts"]) == 0  # exists: fine
    finally:
        assert main(["kafka", "stop", "--dir", folder]) == 0
    assert main(["kafka", "status", "--dir", folder]) == 1
    assert "not running" in capsys.readouterr().out


def test_a_taken_port_is_a_one_line_error(tmp_path, kafka_broker, capsys):
    port = kafka_broker.rsplit(":", 1)[1]
    assert main(["kafka", "start", "--dir", str(tmp_path), "--port", port]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rulewatch: port {port} on 127.0.0.1 is in use") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["with space", "", "x" * 250])
def test_an_invalid_topic_name_is_refused_before_any_connection(name):
    with pytest.raises(ValueError, match="not a valid topic name"):
        KafkaTopic("127.0.0.1:9", name)


def test_sasl_credentials_come_from_the_environment_for_spark_and_python_clients(monkeypatch):
    from rulewatch.kafka.client import KafkaConfigError, spark_options

    topic = KafkaTopic("broker.example:9093", "payments")
    assert spark_options(topic) == {"kafka.bootstrap.servers": "broker.example:9093"}  # plaintext without credentials
    monkeypatch.setenv("RULEWATCH_KAFKA_SASL_USERNAME", 'fraud"team')
    with pytest.raises(KafkaConfigError, match="set both RULEWATCH_KAFKA_SASL_USERNAME and RULEWATCH_KAFKA_SASL_PASSWORD"):
        spark_options(topic)
    monkeypatch.setenv("RULEWATCH_KAFKA_SASL_PASSWORD", "s3cr\\et")
    options = spark_options(topic)
    assert options["kafka.security.protocol"] == "SASL_SSL" and options["kafka.sasl.mechanism"] == "PLAIN"
    # Quotes and backslashes escaped, so a password cannot end the JAAS string early.
    assert options["kafka.sasl.jaas.config"] == (
        'org.apache.kafka.common.security.plain.PlainLoginModule required username="fraud\\"team" password="s3cr\\\\et";'
    )
    assert client_config(topic) == {
        "bootstrap.servers": "broker.example:9093", "security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN",
        "sasl.username": 'fraud"team', "sasl.password": "s3cr\\et",
    }  # fmt: skip
    monkeypatch.setenv("RULEWATCH_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    assert "scram.ScramLoginModule" in spark_options(topic)["kafka.sasl.jaas.config"]


def test_job_parameters_as_text_give_the_source_settings_and_empty_means_the_default():
    from rulewatch.kafka.arguments import source_of
    from rulewatch.kafka.client import KafkaConfigError

    default = source_of("127.0.0.1:9092", "payments", "", "", "")
    assert (default.starting_offsets, default.max_offsets_per_trigger) == ("earliest", None)
    capped = source_of("127.0.0.1:9092", "payments", "", "latest", "500")
    assert (capped.starting_offsets, capped.max_offsets_per_trigger) == ("latest", 500)
    with pytest.raises(KafkaConfigError, match="max offsets per trigger 'lots' is not a whole number"):
        source_of("127.0.0.1:9092", "payments", "", "earliest", "lots")
    with pytest.raises(KafkaConfigError, match="starting offsets 'newest'"):
        source_of("127.0.0.1:9092", "payments", "", "newest", "")


@pytest.mark.parametrize("bootstrap", ["", "nohostport", "host:port", ":9092"])
def test_a_malformed_bootstrap_is_refused_naming_it(bootstrap):
    with pytest.raises(ValueError, match="bootstrap"):
        KafkaTopic(bootstrap, "t")


def test_generate_produces_labelled_traffic_to_a_topic(tmp_path, kafka_broker, capsys):
    import json

    from rulewatch.spark.live.generate import read_labels

    topic = KafkaTopic(kafka_broker, "generated")
    ensure_topic(topic)
    argv = ["generate", "--kafka-bootstrap", kafka_broker, "--kafka-topic", topic.topic, "--labels", str(tmp_path / "labels"),
            "--rate", "100", "--duration", "6", "--pattern-every", "1", "--run-id", "abc"]  # fmt: skip
    assert main(argv) == 0
    events = int(capsys.readouterr().out.splitlines()[-1].split()[0].replace(",", ""))
    records = [json.loads(v) for _, v in _read(topic, events)]
    assert len(records) == events >= 600 and all(r["transactionId"].startswith("abc-") for r in records)
    labelled = {t for label in read_labels(tmp_path / "labels") for t in label.transaction_ids}
    assert labelled and labelled <= {r["transactionId"] for r in records}  # every injected event is on the topic


@pytest.mark.kafka
def test_a_cluster_id_starting_with_a_dash_still_formats_the_storage(tmp_path, monkeypatch):
    # A random id begins with "-" one time in 64 (urlsafe base64); CI once failed every Kafka test on it.
    monkeypatch.setattr(broker.uuid, "uuid4", lambda: uuid.UUID(bytes=b"\xf8" + bytes(15)))
    started = broker.start(tmp_path)
    try:
        assert (tmp_path / "data" / "meta.properties").read_text().count("cluster.id=-") == 1
        assert broker.running(tmp_path) == started
    finally:
        broker.stop(tmp_path)


def test_kafka_alerts_prints_the_topics_alerts_and_stops_after_max_or_when_idle(kafka_broker, capsys):
    import json

    topic = KafkaTopic(kafka_broker, f"alerts-{uuid.uuid4().hex[:8]}")
    ensure_topic(topic, partitions=1)
    values = [json.dumps({"alert_id": f"a{i}", "rule_id": 1, "group_key": "payee-Ä"}, ensure_ascii=False) for i in range(3)]
    send_all(topic, values)
    follow = ["kafka", "alerts", "--bootstrap", kafka_broker, "--topic", topic.topic, "--from-beginning"]
    assert main([*follow, "--max", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == values[:2]
    assert main([*follow, "--idle", "3"]) == 0  # every alert the topic holds, then three quiet seconds
    shown = capsys.readouterr()
    assert shown.out.splitlines() == values and shown.err.endswith("rulewatch kafka alerts: 3 alert(s)\n")
    assert main(["kafka", "alerts", "--bootstrap", kafka_broker, "--topic", topic.topic, "--idle", "2"]) == 0  # only new ones: none
    assert capsys.readouterr().out == ""


def test_a_source_starting_at_latest_is_pinned_to_the_ends_it_has_now(kafka_broker):
    from rulewatch.kafka.source import KafkaSource

    topic = KafkaTopic(kafka_broker, f"pinned-{uuid.uuid4().hex[:8]}")
    ensure_topic(topic, partitions=2)
    send_all(topic, [f'{{"n": {i}}}' for i in range(5)])  # unkeyed: spread over the partitions
    pinned = KafkaSource(topic, starting_offsets="latest").pinned()
    ends = json.loads(pinned.starting_offsets)[topic.topic]
    assert sorted(ends) == ["0", "1"] and sum(ends.values()) == 5
    assert pinned.identity == KafkaSource(topic).identity  # the same source, from one place
