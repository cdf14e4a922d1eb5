"""``rulewatch`` console command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rulewatch import arguments
from rulewatch.checkpoints import CheckpointError
from rulewatch.jobs import add_cli as add_job_cli
from rulewatch.kafka import arguments as kafka_arguments
from rulewatch.kafka.cli import add_cli as add_kafka_cli
from rulewatch.kafka.client import KafkaConfigError
from rulewatch.kafka.source import KafkaSource
from rulewatch.lakehouse import LakehouseBusy, LakehouseUnwritable
from rulewatch.landing import LandingError
from rulewatch.live import add_cli as add_live_cli
from rulewatch.remote import add_cli as add_remote_cli
from rulewatch.report import add_cli as add_report_cli
from rulewatch.rules import RuleSetError, load_rules_file
from rulewatch.rules_cli import add_cli as add_rules_cli
from rulewatch.rules_table import RulesConflict


def _cmd_run(args: argparse.Namespace) -> int:
    from rulewatch.gold import GoldSettings
    from rulewatch.lakehouse import Lakehouse, exclusive
    from rulewatch.pipeline import latest_alerts, run_all
    from rulewatch.session import get_spark

    source: str | KafkaSource | None = kafka_arguments.source(args)
    if bool(source) == bool(args.transactions):
        print("rulewatch: give the transactions either as --transactions FOLDER or as --kafka-topic TOPIC (with --kafka-bootstrap)", file=sys.stderr)
        return 2
    if source is None:
        landing = Path(args.transactions)
        if not landing.exists():
            print(f"rulewatch: --transactions {landing} does not exist; point it at a folder of JSON-lines files", file=sys.stderr)
            return 2
        if not landing.is_dir():
            print(f"rulewatch: --transactions {landing} is a file, not a folder; point it at the folder that holds it", file=sys.stderr)
            return 2
        source = str(landing.resolve())
    if args.rules:
        load_rules_file(args.rules)  # every mistake in the file reported now, not after Spark has started
    settings = GoldSettings(shards=args.shards, allowed_lateness=args.allowed_lateness, alerts_topic=kafka_arguments.alerts_topic(args))
    lakehouse = Lakehouse(args.lakehouse)
    with exclusive(lakehouse):
        spark = get_spark()
        print(f"rulewatch: lakehouse {lakehouse.root}")
        _, summary = run_all(spark, lakehouse, source, args.rules, settings)
    print("\n".join(summary.lines()))
    if summary.alerts:
        print("alerts (the latest 20 by event time):")
        for row in latest_alerts(spark, lakehouse).collect():
            print(
                f"  rule {row.rule_id}  key {row.group_key:<22} txn {row.transaction_id:<10} "
                f"{row.event_time:%Y-%m-%d %H:%M:%S}  {row.aggregate_value.normalize():f} {row.operator} "
                f"{row.limit.normalize():f}  ({row.event_count} events)"
            )
    return 0 if summary.ok else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    from rulewatch.bench import bench
    from rulewatch.session import get_spark

    if args.scale_curve:
        from rulewatch.bench import scale_curve

        print("rulewatch bench: engine only, 1h SUM window, 100 keys: microseconds per event as the window fills")
        print(f"  {'events/key/window':>18} {'exact':>9} {'bucketed 1m':>12} {'raw rows/key exact':>19} {'bucketed':>9}")
        for p in scale_curve(args.scale_curve):
            print(f"  {p.window_events:>18,} {p.exact_us:>8.1f}us {p.bucketed_us:>10.1f}us {p.exact_rows:>19,} {p.bucketed_rows:>9,}")
        return 0
    spark = get_spark("rulewatch-bench")
    if args.pipeline:
        from rulewatch.bench import bench_pipeline

        print(f"rulewatch bench --pipeline: {args.events:,} payments over 24 h in 10 files, {args.keys:,} payee keys, the real job")
        result = bench_pipeline(spark, args.events, args.keys)
        floor = result.passthrough
        print(f"  {floor.name:<24} {floor.seconds:7.1f}s  {floor.rate:10,.0f} events/s")
        for m in result.layers:
            print(f"  {m.name:<24} {m.seconds:7.1f}s  {m.rate:10,.0f} events/s  ratio {m.rate / floor.rate:4.2f}")
        print(f"  alerts {result.alerts:,}")
        return 0
    if args.rule_propagation:
        from rulewatch.bench import rule_propagation

        print(f"rulewatch bench: rule change -> first alert with it, continuous mode, {args.rule_propagation} trials")
        latencies = sorted(rule_propagation(spark, args.rule_propagation))
        for seconds in latencies:
            print(f"  {seconds:6.2f}s")
        if latencies:
            print(f"  median {latencies[len(latencies) // 2]:.2f}s, max {latencies[-1]:.2f}s")
        return 0 if len(latencies) == args.rule_propagation else 1
    print(
        f"rulewatch bench: {args.events:,} events, {args.keys:,} keys, {args.batch_events:,} events per batch, "
        f"{args.shards} shards, SUM over 1h > {args.limit:,}"
    )
    results = bench(spark, args.events, args.keys, args.batch_events, args.shards, args.state_slots, args.limit)
    floor = results[0].rate
    batches = max(1, args.events // args.batch_events)
    for m in results:
        print(
            f"  {m.name:<34} {m.seconds:7.1f}s  {m.rate:10,.0f} events/s  ratio {m.rate / floor:4.2f}"
            f"  state rows written/batch {m.state_rows_updated / batches:,.0f}  state {m.state_bytes / args.keys:,.0f} B/key"
        )
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rulewatch")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rulewatch", description="Dynamic-rule fraud alerting on Spark + Delta")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error instead of one line")
    parser.add_argument("--version", action="version", version=f"rulewatch {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="process everything landed once (bronze -> silver -> gold) and summarise")
    run.add_argument("--lakehouse", required=True, help="folder holding every Delta table and checkpoint")
    run.add_argument("--transactions", help="landing folder of JSON-lines transaction files (or --kafka-topic)")
    run.add_argument("--rules", help="rules file (JSON array or JSON lines) to MERGE into config/rules first")
    run.add_argument("--shards", type=arguments.shards, default=16, help="hash shards of the key evaluated per Python call")
    run.add_argument("--allowed-lateness", type=arguments.allowed_lateness, default="1h", help="events older than the watermark by more are recorded, not evaluated")
    kafka_arguments.add_options(run)
    run.set_defaults(func=_cmd_run)
    bench = sub.add_parser("bench", help="evaluator vs a stateless grouped pass-through on the same generated input")
    bench.add_argument("--events", type=int, default=200_000)
    bench.add_argument("--keys", type=int, default=10_000)
    bench.add_argument("--batch-events", type=int, default=50_000)
    bench.add_argument("--shards", type=arguments.shards, default=16)
    bench.add_argument("--limit", type=int, default=12_500, help="the SUM rule's limit (lower: more events alert)")
    bench.add_argument("--state-slots", type=int, nargs="+", default=[0, 64], help="evaluator state layouts to measure (0 = per key)")
    bench.add_argument("--scale-curve", type=int, nargs="+", metavar="N", help="instead: exact vs bucketed cost with N events per key per window")
    bench.add_argument("--pipeline", action="store_true", help="instead: the whole job per layer on generated landing files (issue #14's shape)")
    bench.add_argument("--rule-propagation", type=int, metavar="TRIALS", help="instead: time rule changes reaching a running stream")
    bench.set_defaults(func=_cmd_bench)
    add_rules_cli(sub)
    add_job_cli(sub)
    add_remote_cli(sub)
    add_report_cli(sub)
    add_live_cli(sub)
    add_kafka_cli(sub)
    return parser


# Errors that say what is wrong and how to fix it: the message is all the user needs, not a traceback.
USER_ERRORS = (RuleSetError, RulesConflict, LakehouseBusy, LakehouseUnwritable, LandingError, CheckpointError, KafkaConfigError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as err:
        if args.debug:
            raise
        print(f"rulewatch: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
