"""Transactions onto a topic with a real Kafka producer (confluent-kafka): the generator's other output."""

from __future__ import annotations

import json
from typing import Any, Iterable

from rulewatch.kafka.client import KafkaTopic, client_config


class ProduceError(RuntimeError):
    """Records the broker did not acknowledge: they are not on the topic."""


class TopicWriter:
    """An ``Emit`` for ``generate.run``: one record per event, keyed by its account, acknowledged by ``close``.

    Keyed so one payee's (or user's) events stay in order on one partition, as the original engine
    partitioned them. Idempotent producer: a retried send is not written twice.
    """

    def __init__(self, topic: KafkaTopic) -> None:
        from confluent_kafka import Producer

        self.topic = topic
        self._producer = Producer(client_config(topic) | {"enable.idempotence": True, "linger.ms": 5, "log_level": 3})
        self._failed: list[str] = []

    def _delivered(self, error: Any, _message: Any) -> None:
        if error is not None:
            self._failed.append(str(error))

    def send(self, value: bytes | str | None, key: str | None = None) -> None:
        while True:
            try:
                self._producer.produce(self.topic.topic, value=value, key=key, on_delivery=self._delivered)
                break
            except BufferError:  # the local queue is full: let deliveries drain, then retry
                self._producer.poll(0.1)
        self._producer.poll(0)

    def __call__(self, name: str, events: list[dict[str, Any]]) -> None:
        for event in events:
            key = event.get("payeeId") or event.get("userId")
            self.send(json.dumps(event, separators=(",", ":")), None if key is None else str(key))

    def close(self, timeout: float = 60) -> None:
        """Wait until every record is acknowledged; raise if any was refused or is still unsent."""
        unsent = self._producer.flush(timeout)
        if unsent or self._failed:
            raise ProduceError(
                f"{unsent} record(s) unsent and {len(self._failed)} refused by {self.topic.bootstrap} "
                f"(topic {self.topic.topic}); first error: {self._failed[0] if self._failed else 'timeout'}"
            )

    def __enter__(self) -> "TopicWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def send_all(topic: KafkaTopic, values: Iterable[bytes | str | None]) -> None:
    """Send raw record values (any bytes, even invalid JSON or UTF-8) and wait for every acknowledgement."""
    with TopicWriter(topic) as writer:
        for value in values:
            writer.send(value)
