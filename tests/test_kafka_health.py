"""A Kafka source that is down is an error the operator sees in bounded time, never "no traffic".

Before: `run` against a dead bootstrap printed nothing and never ended, `stream` with its broker
killed printed "ingest 0 rows/s" for minutes and exited 0, and a mistyped topic on a lakehouse's
first run bound the lakehouse to that topic.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from rulewatch.cli.main import main
from rulewatch.kafka import broker
from rulewatch.kafka.client import KafkaTopic, ensure_topic
from rulewatch.kafka.health import TIMEOUT_ENV, Watch
from rulewatch.kafka.produce import send_all


def _dead_bootstrap() -> str:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("command", ["run", "stream"])
def test_a_dead_cluster_is_an_error_naming_it_within_the_timeout(command, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RULEWATCH_KAFKA_TIMEOUT", "2s")
    bootstrap, lakehouse = _dead_bootstrap(), tmp_path / "lakehouse"
    started = time.monotonic()
    code = main([command, "--lakehouse", str(lakehouse), "--kafka-bootstrap", bootstrap, "--kafka-topic", "transactions"])
    assert (code, time.monotonic() - started < 15) == (2, True)
    assert f"rulewatch: Kafka at {bootstrap} did not answer within 2s" in capsys.readouterr().err
    assert not (lakehouse / "_landing").exists()  # not bound to a topic it never saw


def test_a_bad_timeout_setting_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RULEWATCH_KAFKA_TIMEOUT", "soon")
    code = main(["run", "--lakehouse", str(tmp_path), "--kafka-bootstrap", _dead_bootstrap(), "--kafka-topic", "t"])
    assert code == 2 and "RULEWATCH_KAFKA_TIMEOUT='soon': bad duration" in capsys.readouterr().err


def test_the_watch_records_an_outage_and_tells_it_once(monkeypatch):
    told: list[str] = []
    watch = Watch(KafkaTopic(_dead_bootstrap(), "t"), told.append, timeout=1)
    watch.check()
    watch.check()
    assert watch.down is not None and len(watch.outages) == 1
    assert len(told) == 1 and told[0].startswith("WARNING: Kafka at") and "nothing is ingested while it is down" in told[0]
    assert watch.summary().endswith("in 1 outage(s) and is still not answering")


def test_a_mistyped_topic_is_refused_and_binds_nothing(kafka_broker, tmp_path, capsys):
    real = KafkaTopic(kafka_broker, f"payments-{uuid.uuid4().hex[:6]}")
    ensure_topic(real, partitions=1)
    lakehouse = tmp_path / "lakehouse"
    code = main(["run", "--lakehouse", str(lakehouse), "--kafka-bootstrap", kafka_broker, "--kafka-topic", real.topic + "s"])
    err = capsys.readouterr().err
    assert code == 2 and f"Kafka topic {real.topic}s does not exist at {kafka_broker}" in err and real.topic in err.split("topics there:")[1]
    assert not (lakehouse / "_landing").exists()


@pytest.mark.slow
def test_a_stream_whose_broker_goes_away_warns_says_when_it_is_back_and_exits_1(spark, tmp_path, capsys, stream_ends_when, monkeypatch):
    """A broker of its own, stopped for ~6 s once the stream has ingested its first records, then started
    again; the stream ends once it has said so and bronze holds every record. The watch probes every second
    and gives up on a probe after 3 s (5 s and 10 s by default), so a short outage is seen."""
    from rulewatch.spark.live import streams
    from rulewatch.spark.storage import delta_log
    from rulewatch.spark.storage.lakehouse import Lakehouse

    monkeypatch.setattr(streams, "Watch", functools.partial(streams.Watch, every=1.0))
    monkeypatch.setenv(TIMEOUT_ENV, "3s")

    folder = tmp_path / "kafka"
    first = broker.start(folder)
    topic = KafkaTopic(first.bootstrap, "payments")
    ensure_topic(topic, partitions=1)
    lines = [f'{{"transactionId": "k-{i}", "eventTime": 1793527200000, "payeeId": "p", "paymentAmount": 1}}' for i in range(20)]
    send_all(topic, lines[:10])
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))

    def outage() -> None:
        deadline = time.monotonic() + 60
        while not Path(lakehouse.bronze_transactions, "_delta_log", "00000000000000000001.json").exists() and time.monotonic() < deadline:
            time.sleep(0.5)  # until the first records are in bronze (commit 0 creates the table)
        broker.stop(folder)
        time.sleep(6)
        broker.start(folder)
        send_all(topic, lines[10:])

    printed: list[pytest.CaptureResult] = []  # the Kafka watch prints beside the progress loop's lines

    def back_and_all_in(_lines: list[str]) -> bool:
        printed.append(capsys.readouterr())
        if thread.is_alive() or "answers again after" not in "".join(p.out for p in printed):
            return False
        try:
            return sum(f["numRecords"] for f in delta_log.live_files(lakehouse.bronze_transactions) or []) == len(lines)
        except delta_log.UNREADABLE:  # a commit being written
            return False

    stream_ends_when(back_and_all_in)
    thread = threading.Thread(target=outage)
    thread.start()
    try:
        code = main(["stream", "--lakehouse", lakehouse.root, "--kafka-bootstrap", topic.bootstrap, "--kafka-topic", topic.topic,
                     "--duration", "150"])  # fmt: skip
    finally:
        thread.join()
        broker.stop(folder)
    printed.append(capsys.readouterr())
    out, err = "".join(p.out for p in printed), "".join(p.err for p in printed)
    assert f"WARNING: Kafka at {topic.bootstrap} is not answering" in out
    assert f"Kafka at {topic.bootstrap} answers again after" in out
    assert code == 1 and f"rulewatch stream: Kafka at {topic.bootstrap} did not answer for" in err
    bronze = spark.read.format("delta").load(lakehouse.bronze_transactions)
    assert sorted(r.value for r in bronze.collect()) == sorted(lines)  # nothing sent during the outage is lost
