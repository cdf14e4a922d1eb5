"""``rulewatch generate``, ``stream`` and ``demo``: live mode from the command line (rulewatch.spark.live)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pyspark.sql import SparkSession

from rulewatch.cli import arguments, kafka_cli
from rulewatch.kafka.produce import TopicWriter
from rulewatch.kafka.source import KafkaSource
from rulewatch.kafka.health import check_topic
from rulewatch.spark.layers.bronze import Source
from rulewatch.spark.layers.gold import GoldSettings
from rulewatch.spark.live import generate
from rulewatch.spark.live.demo import DEMO_RULES, demo
from rulewatch.spark.live.monitor import Log
from rulewatch.spark.live.streams import LiveSettings, stream
from rulewatch.spark.storage.lakehouse import Lakehouse



def _settings(args: argparse.Namespace, lakehouse: Lakehouse) -> LiveSettings:
    return LiveSettings(
        trigger=args.trigger,
        gold=GoldSettings(
            **arguments.gold_layout(args, lakehouse.checkpoint("gold")),
            allowed_lateness=args.allowed_lateness,
            alerts_topic=kafka_cli.alerts_topic(args),
            no_data_batches=args.gold_no_data_batches,
            window_metrics=args.window_metrics,
        ),
        shuffle_partitions=args.shuffle_partitions,
        metrics_every=args.metrics_every,
        gold_from_source=None if args.gold_source is None else args.gold_source == "topic",
    )


def _source_problems(args: argparse.Namespace, kafka: KafkaSource | None) -> list[str]:
    if args.gold_source == "topic" and not kafka:
        return ["--gold-source topic reads a Kafka topic: give --kafka-bootstrap and --kafka-topic too, or --gold-source silver"]
    return []


def _apply_rules(spark: SparkSession, lakehouse: Lakehouse, files: list[str], log: Log) -> None:
    from rulewatch.spark.control.rules_table import apply_rules_file

    for path in files:
        for change in apply_rules_file(spark, lakehouse, path):
            log(f"rules: {change}")


def _check_rules_files(files: list[str]) -> list[str]:
    """Every problem of every rules file, found before Spark starts (as `rulewatch run` does)."""
    from rulewatch.engine.rules import RuleSetError, load_rules_file

    problems = []
    for path in files:
        try:
            load_rules_file(path)
        except RuleSetError as err:
            problems.append(str(err))
    return problems


def _refuse(problems: list[str]) -> int:
    for problem in problems:
        print(f"rulewatch: {problem}", file=sys.stderr)
    print("rulewatch: nothing was started or written", file=sys.stderr)
    return 2


def _config(args: argparse.Namespace, duration: float, run_id: str | None) -> generate.GeneratorConfig:
    return generate.GeneratorConfig(
        args.rate, duration, args.seed, run_id or generate.new_run_id(), args.file_interval, args.pattern_every
    )


def cmd_generate(args: argparse.Namespace) -> int:
    kafka = kafka_cli.source(args)
    if bool(kafka) == bool(args.landing):
        print("rulewatch: give where the traffic goes: --landing FOLDER or --kafka-topic TOPIC (with --kafka-bootstrap)", file=sys.stderr)
        return 2
    landing = Path(args.landing) if args.landing else None
    labels = Path(args.labels) if args.labels else (landing.with_name(f"{landing.name}-labels") if landing else Path("labels"))
    try:
        config = _config(args, args.duration, args.run_id)
        if landing:
            generate.check_folders(landing, labels)
    except ValueError as err:
        print(f"rulewatch: {err}", file=sys.stderr)
        return 2
    target = landing or f"Kafka topic {kafka.topic.topic} at {kafka.topic.bootstrap}"
    print(f"rulewatch generate: run {config.run_id}, {config.rate:,.0f} events/s for {config.duration:.0f}s into {target}, labels in {labels}")
    try:
        if landing:
            result = generate.run(config, landing, labels)
        else:
            with TopicWriter(kafka.topic) as writer:
                result = generate.run(config, writer, labels)
    except KeyboardInterrupt:
        print("interrupted")
        return 130
    print(f"{result.events:,} events in {result.files} {'files' if landing else 'sends'}, {result.labels} pattern instance(s), {result.rate:,.0f} events/s achieved")
    return 0


def cmd_stream(args: argparse.Namespace) -> int:
    from rulewatch.spark.storage.lakehouse import exclusive
    from rulewatch.spark.runtime.session import get_spark

    lakehouse = Lakehouse(args.lakehouse)
    kafka = kafka_cli.source(args)
    if kafka and args.landing:
        print("rulewatch: give either --landing FOLDER or --kafka-topic TOPIC, not both", file=sys.stderr)
        return 2
    landing = Path(args.landing or Path(lakehouse.root, "landing"))
    settings = _settings(args, lakehouse)
    if problems := _source_problems(args, kafka) + _check_rules_files(args.rules):
        return _refuse(problems)
    if kafka:
        check_topic(kafka.topic)  # a dead cluster or a mistyped topic: said now, not after Spark has started
    with exclusive(lakehouse, "rulewatch stream"):  # before the landing folder: by default it lies inside the lakehouse, whose problems the lock reports
        if not kafka:
            landing.mkdir(parents=True, exist_ok=True)
        spark = get_spark("rulewatch-stream")
        _apply_rules(spark, lakehouse, args.rules, print)
        source: Source = kafka or str(landing.resolve())
        described = f"Kafka topic {kafka.topic.topic}" if kafka else str(landing)
        until = "until everything available has gone through" if args.drain else "Ctrl-C stops cleanly"
        print(f"rulewatch stream: {described} -> {lakehouse.root}, trigger {args.trigger!r}; {until}")
        monitor = stream(spark, lakehouse, source, settings, args.duration, drain=args.drain)
    if monitor.interrupted:
        return 130
    if monitor.source_outage:
        print(f"rulewatch stream: {monitor.source_outage}: what was sent meanwhile was read only once it answered", file=sys.stderr)
        return 1
    if not args.drain:
        return 0
    if monitor.drained_in is None:
        print(f"rulewatch stream: NOT drained within --duration {args.duration:g}s: input was still arriving or being processed", file=sys.stderr)
        return 1
    print(f"rulewatch stream: drained in {monitor.drained_in:.1f}s: everything available has gone through")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from rulewatch.spark.storage.lakehouse import exclusive
    from rulewatch.spark.runtime.session import get_spark

    lakehouse = Lakehouse(args.lakehouse)
    kafka = kafka_cli.source(args)
    landing: Path | KafkaSource = kafka or Path(lakehouse.root, "landing")
    labels = Path(lakehouse.root, "labels")
    rules = args.rules or [str(p) for p in DEMO_RULES]
    try:
        settings = _settings(args, lakehouse)
        config = _config(args, args.minutes * 60, None)
    except ValueError as err:
        print(f"rulewatch: {err}", file=sys.stderr)
        return 2
    if problems := _source_problems(args, kafka) + _check_rules_files(rules):
        return _refuse(problems)
    with exclusive(lakehouse, "rulewatch demo"):
        spark = get_spark("rulewatch-demo")
        _apply_rules(spark, lakehouse, rules, print)
        report = demo(spark, lakehouse, landing, labels, config, settings)
    print("\n".join(report.lines()))
    return 0 if report.caught_up else 1
