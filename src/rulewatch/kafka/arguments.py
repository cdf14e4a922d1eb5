"""The Kafka options shared by ``run``, ``stream``, ``demo`` and ``generate``."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rulewatch.cli import arguments
from rulewatch.kafka.client import KafkaConfigError, KafkaTopic

if TYPE_CHECKING:  # the source reads through Spark; the parser must not import it
    from rulewatch.kafka.source import KafkaSource


def add_options(parser: argparse.ArgumentParser, source: bool = True, alerts: bool = True) -> None:
    group = parser.add_argument_group("Kafka (instead of, or beside, files)")
    group.add_argument("--kafka-bootstrap", metavar="HOST:PORT[,...]", help="Kafka bootstrap servers (`rulewatch kafka start` prints a local one)")
    if source:
        group.add_argument("--kafka-topic", help="read transactions from this topic instead of a landing folder")
        group.add_argument("--kafka-starting-offsets", default="earliest", help="where a new checkpoint starts reading: earliest (default) or latest")
        group.add_argument("--kafka-max-offsets", type=arguments.count("max offsets", 10_000), metavar="N", help="at most N records per micro-batch (default: all available)")
    if alerts:
        group.add_argument("--alerts-topic", help="also publish every alert to this topic (at least once; dedupe on alert_id)")
    group.add_argument("--kafka-secret-scope", help="Databricks secret scope with kafka-sasl-username / kafka-sasl-password (locally: RULEWATCH_KAFKA_SASL_* env)")


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


def source(args: argparse.Namespace) -> KafkaSource | None:
    return source_of(
        args.kafka_bootstrap, args.kafka_topic, args.kafka_secret_scope, args.kafka_starting_offsets, args.kafka_max_offsets, "--kafka-topic"
    )


def alerts_topic(args: argparse.Namespace) -> KafkaTopic | None:
    return topic_of(args.kafka_bootstrap, args.alerts_topic, args.kafka_secret_scope, "--alerts-topic")
