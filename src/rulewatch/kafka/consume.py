"""Records off a topic with a real Kafka consumer (confluent-kafka): ``rulewatch kafka alerts`` follows the alert topic."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from rulewatch.kafka.client import KafkaConfigError, KafkaTopic, client_config


def follow(topic: KafkaTopic, from_beginning: bool = False, idle_s: float | None = None, poll_s: float = 0.5) -> Iterator[bytes]:
    """Each record's value as it arrives, in each partition's order, until ``idle_s`` pass without one
    (None: until the caller stops).

    A consumer group of its own that commits nothing: following never moves anyone else's offsets, and
    ``from_beginning`` reads what the topic still holds first.
    """
    return (value for _, value in timed(topic, from_beginning, idle_s, poll_s))


def timed(topic: KafkaTopic, from_beginning: bool = False, idle_s: float | None = None, poll_s: float = 0.5) -> Iterator[tuple[int, bytes]]:
    """As :func:`follow`, each value with its record's timestamp (ms since the epoch: when the producer sent
    it, unless the topic stamps append times)."""
    from confluent_kafka import Consumer, KafkaError

    consumer = Consumer(client_config(topic) | {
        "group.id": f"rulewatch-follow-{uuid.uuid4().hex[:12]}",
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest" if from_beginning else "latest",
        "log_level": 0,
    })  # fmt: skip
    try:
        consumer.subscribe([topic.topic])
        last = time.monotonic()
        while idle_s is None or time.monotonic() - last < idle_s:
            message = consumer.poll(poll_s)
            if message is None:
                continue
            if message.error() is not None:
                if message.error().code() == KafkaError._PARTITION_EOF:
                    continue
                raise KafkaConfigError(f"reading {topic.topic} on {topic.bootstrap}: {message.error().str()}")
            last = time.monotonic()
            yield message.timestamp()[1], message.value()
    finally:
        consumer.close()


def end_offsets(topic: KafkaTopic, timeout_s: float = 60) -> dict[int, int]:
    """Each partition's end offset now (the offset its next record will get)."""
    consumer = _assigning(topic)
    try:
        return _ends(consumer, topic, timeout_s)
    finally:
        consumer.close()


def _assigning(topic: KafkaTopic) -> Any:
    """A consumer for assigned partitions (no group to join; its id only names it)."""
    from confluent_kafka import Consumer

    return Consumer(client_config(topic) | {"group.id": f"rulewatch-held-{uuid.uuid4().hex[:12]}", "enable.auto.commit": False, "log_level": 0})


def _ends(consumer: Any, topic: KafkaTopic, timeout_s: float) -> dict[int, int]:
    from confluent_kafka import TopicPartition

    partitions = consumer.list_topics(topic.topic, timeout=timeout_s).topics[topic.topic].partitions
    return {p: consumer.get_watermark_offsets(TopicPartition(topic.topic, p), timeout=timeout_s)[1] for p in partitions}


def held(topic: KafkaTopic, timeout_s: float = 60) -> Iterator[tuple[int, bytes]]:
    """Every record the topic holds now, with its timestamp (as :func:`timed`), then stop: read from each
    partition's start up to its end offset as of the call. Assigned, not subscribed: no group to join."""
    from confluent_kafka import OFFSET_BEGINNING, TopicPartition

    consumer = _assigning(topic)
    try:
        ends = _ends(consumer, topic, timeout_s)
        pending = {p for p, end in ends.items() if end > 0}
        consumer.assign([TopicPartition(topic.topic, p, OFFSET_BEGINNING) for p in pending])
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None or message.error() is not None:
                continue
            if message.offset() >= ends[message.partition()] - 1:
                pending.discard(message.partition())
            if message.offset() < ends[message.partition()]:
                yield message.timestamp()[1], message.value()
        if pending:
            raise KafkaConfigError(f"reading {topic.topic} on {topic.bootstrap}: partitions {sorted(pending)} not read to their end within {timeout_s:.0f}s")
    finally:
        consumer.close()
