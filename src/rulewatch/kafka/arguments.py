"""Kafka topics and sources as flags, job parameters and widgets name them ("" for unset)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rulewatch.kafka.client import KafkaConfigError, KafkaTopic

if TYPE_CHECKING:  # the source reads through Spark; the parser must not import it
    from rulewatch.kafka.source import KafkaSource


def topic_of(bootstrap: str | None, topic: str | None, secret_scope: str | None = None, flag: str = "topic") -> KafkaTopic | None:
    """The topic named, or None when ``topic`` is empty (job parameters and widgets pass "" for unset)."""
    if not topic:
        return None
    if not bootstrap:
        raise KafkaConfigError(f"{flag} {topic} needs Kafka bootstrap servers HOST:PORT (--kafka-bootstrap, or the job parameter kafka_bootstrap)")
    return KafkaTopic(bootstrap, topic, secret_scope or None)


def source_of(
    bootstrap: str | None,
    topic: str | None,
    secret_scope: str | None = None,
    starting_offsets: str | None = "earliest",
    max_offsets: int | str | None = None,
    flag: str = "Kafka topic",
) -> KafkaSource | None:
    """The Kafka source named, or None for the landing folder.

    Job parameters and widgets are text and "" for unset: empty ``starting_offsets`` means earliest,
    empty ``max_offsets`` no cap."""
    from rulewatch.kafka.source import KafkaSource

    named = topic_of(bootstrap, topic, secret_scope, flag)
    if not named:
        return None
    return KafkaSource(named, starting_offsets or "earliest", _count(max_offsets))


def _count(value: int | str | None) -> int | None:
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            return int(value)
        except ValueError:
            raise KafkaConfigError(f"max offsets per trigger {value!r} is not a whole number (empty: no cap)") from None
    return value
