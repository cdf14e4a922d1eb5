"""``rulewatch kafka start|stop|status|topic``: the local broker for laptops and tests (never starts Spark)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rulewatch.cli import arguments
from rulewatch.kafka.client import KafkaConfigError, KafkaTopic, ensure_topic


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
