"""The Kafka options shared by ``run``, ``stream``, ``demo`` and ``generate``, and ``rulewatch kafka
start|stop|status|topic``: the local broker for laptops and tests (never starts Spark)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING
from pathlib import Path

from rulewatch.cli import arguments
from rulewatch.kafka.arguments import source_of, topic_of
from rulewatch.kafka.client import KafkaConfigError, KafkaTopic, ensure_topic

if TYPE_CHECKING:
    from rulewatch.kafka.source import KafkaSource


def add_options(parser: argparse.ArgumentParser, source: bool = True, alerts: bool = True, sends: bool = False) -> None:
    """The Kafka flags of a command that reads transactions from a topic, or with ``sends`` writes them to one."""
    group = parser.add_argument_group("Kafka (instead of, or beside, files)")
    group.add_argument("--kafka-bootstrap", metavar="HOST:PORT[,...]", help="Kafka bootstrap servers (`rulewatch kafka start` prints a local one)")
    if sends:
        group.add_argument("--kafka-topic", help="send the transactions to this topic instead of a landing folder")
    elif source:
        group.add_argument("--kafka-topic", help="read transactions from this topic instead of a landing folder")
        group.add_argument("--kafka-starting-offsets", default="earliest", help="where a new checkpoint starts reading: earliest (default) or latest")
        group.add_argument("--kafka-max-offsets", type=arguments.count("max offsets", 10_000), metavar="N", help="at most N records per micro-batch (default: all available)")
    if alerts:
        group.add_argument("--alerts-topic", help="also publish every alert to this topic (at least once; dedupe on alert_id)")
    group.add_argument("--kafka-secret-scope", help="Databricks secret scope with kafka-sasl-username / kafka-sasl-password (locally: RULEWATCH_KAFKA_SASL_* env)")


def source(args: argparse.Namespace) -> KafkaSource | None:
    """The topic ``--kafka-topic`` names (a command that only sends has no reading flags: their defaults)."""
    return source_of(
        args.kafka_bootstrap, args.kafka_topic, args.kafka_secret_scope,
        getattr(args, "kafka_starting_offsets", "earliest"), getattr(args, "kafka_max_offsets", None), "--kafka-topic",
    )  # fmt: skip


def alerts_topic(args: argparse.Namespace) -> KafkaTopic | None:
    return topic_of(args.kafka_bootstrap, args.alerts_topic, args.kafka_secret_scope, "--alerts-topic")


def _start(args: argparse.Namespace) -> int:
    from rulewatch.kafka import broker

    started = broker.start(Path(args.dir), args.port)
    print(f"bootstrap {started.bootstrap}")
    print(f"pid {started.pid}, log {started.log}; stop with: rulewatch kafka stop --dir {args.dir}")
    return 0


def _stop(args: argparse.Namespace) -> int:
    from rulewatch.kafka import broker

    if broker.stop(Path(args.dir)):
        print(f"stopped the broker in {args.dir}")
    else:
        print(f"no broker was running in {args.dir}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from rulewatch.kafka import broker

    found = broker.running(Path(args.dir))
    print(f"running: bootstrap {found.bootstrap}, pid {found.pid}" if found else f"not running ({args.dir})")
    return 0 if found else 1


def _topic(args: argparse.Namespace) -> int:
    ensure_topic(KafkaTopic(args.bootstrap, args.name), args.partitions)
    print(f"topic {args.name} on {args.bootstrap}")
    return 0


def _alerts(args: argparse.Namespace) -> int:
    from rulewatch.kafka.consume import follow
    from rulewatch.kafka.health import check_topic

    topic = KafkaTopic(args.bootstrap, args.topic, args.kafka_secret_scope)
    check_topic(topic)  # a dead cluster or a mistyped topic: said now, not by waiting for ever
    idle = args.idle or None  # 0: never
    waiting = f"until {idle:g}s pass without one" if idle else "Ctrl-C stops"
    print(f"rulewatch kafka alerts: {args.topic} on {args.bootstrap}, {'from the beginning' if args.from_beginning else 'new alerts'}; {waiting}", file=sys.stderr)
    shown = 0
    try:
        for value in follow(topic, args.from_beginning, idle):
            print((value or b"").decode("utf-8", errors="replace"), flush=True)
            shown += 1
            if args.max and shown >= args.max:
                break
    except KeyboardInterrupt:
        return 130
    print(f"rulewatch kafka alerts: {shown} alert(s)", file=sys.stderr)
    return 0


def _run(handler):
    @arguments.needs
    def run(args: argparse.Namespace) -> int:
        from rulewatch.kafka import broker  # it finds the broker's jars through pyspark: not when parsing

        try:
            return handler(args)
        except (broker.BrokerError, KafkaConfigError) as err:
            if args.debug:
                raise
            print(f"rulewatch: {err}", file=sys.stderr)
            return 2

    return run


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    kafka = subparsers.add_parser("kafka", help="start / stop a local Apache Kafka broker (KRaft, loopback only)")
    commands = kafka.add_subparsers(dest="kafka_command", required=True)
    start = commands.add_parser("start", help="start a broker keeping its config, data and log in --dir; prints the bootstrap address")
    start.add_argument("--dir", required=True, help="the broker's folder (data survives a restart)")
    start.add_argument("--port", type=arguments.count("port", 9092, 1, 65535), help="client port on 127.0.0.1 (default: the folder's last one, else a free one)")
    start.set_defaults(func=_run(_start))
    stop = commands.add_parser("stop", help="stop the broker of --dir")
    stop.add_argument("--dir", required=True)
    stop.set_defaults(func=_run(_stop))
    status = commands.add_parser("status", help="is the broker of --dir running (exit 0) or not (exit 1)")
    status.add_argument("--dir", required=True)
    status.set_defaults(func=_run(_status))
    topic = commands.add_parser("topic", help="create a topic unless it exists")
    topic.add_argument("--bootstrap", required=True, metavar="HOST:PORT")
    topic.add_argument("--name", required=True)
    topic.add_argument("--partitions", type=arguments.count("partitions", 2), default=2)
    topic.set_defaults(func=_run(_topic))
    alerts = commands.add_parser("alerts", help="print the alerts published to an alert topic (--alerts-topic), one JSON object a line")
    alerts.add_argument("--bootstrap", required=True, metavar="HOST:PORT[,...]")
    alerts.add_argument("--topic", required=True, help="the alert topic")
    alerts.add_argument("--from-beginning", action="store_true", help="first every alert the topic still holds (default: only new ones)")
    alerts.add_argument("--max", type=arguments.count("max", 10), metavar="N", help="stop after N alerts")
    alerts.add_argument("--idle", type=arguments.seconds("idle", 30.0), metavar="SECONDS", help="stop once SECONDS pass without an alert (default, or 0: never)")
    alerts.add_argument("--kafka-secret-scope", help="Databricks secret scope with kafka-sasl-username / kafka-sasl-password (locally: RULEWATCH_KAFKA_SASL_* env)")
    alerts.set_defaults(func=_run(_alerts))
