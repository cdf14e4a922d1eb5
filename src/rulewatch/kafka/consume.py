"""Records off a topic with a real Kafka consumer (confluent-kafka): ``rulewatch kafka alerts`` follows the alert topic."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

from rulewatch.kafka.client import KafkaConfigError, KafkaTopic, client_config


def follow(topic: KafkaTopic, from_beginning: bool = False, idle_s: float | None = None, poll_s: float = 0.5) -> Iterator[bytes]:
    """Each record's value as it arrives, in each partition's order, until ``idle_s`` pass without one
    (None: until the caller stops).

    A consumer group of its own that commits nothing: following never moves anyone else's offsets, and
    ``from_beginning`` reads what the topic still holds first.
    """
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
            yield message.value()
    finally:
        consumer.close()
