"""``rulewatch`` console command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Only modules free of Spark, Delta, pyarrow and the Databricks SDK: the parser is built for every command
# (the heavy ones load when their command runs, through arguments.command).
from rulewatch.cli import arguments
from rulewatch.cli import gold_cli, kafka_cli
from rulewatch.bundle import DEFAULT_JOB
from rulewatch.cli.remote import add_cli as add_remote_cli
from rulewatch.engine.rules import load_rules_file
from rulewatch.cli.rules_cli import add_cli as add_rules_cli
from rulewatch.spark.evaluator.settings import GoldSettings
from rulewatch.spark.runtime.env import use_master


def _cmd_run(args: argparse.Namespace) -> int:
    from rulewatch.spark.layers.gold import GoldSettings  # first: without pyspark, the error names the extra to install
    from rulewatch.spark.storage.checkpoints import check_gold_layout
    from rulewatch.spark.storage.lakehouse import Lakehouse, exclusive
    from rulewatch.spark.layers.pipeline import latest_alerts, run_all
    from rulewatch.spark.runtime.session import get_spark

    source = kafka_cli.source(args)
    if bool(source) == bool(args.landing):
        print("rulewatch: give the transactions either as --landing FOLDER or as --kafka-topic TOPIC (with --kafka-bootstrap)", file=sys.stderr)
        return 2
    if source is None:
        landing = Path(args.landing)
        if not landing.exists():
            print(f"rulewatch: --landing {landing} does not exist; point it at a folder of JSON-lines files", file=sys.stderr)
            return 2
        if not landing.is_dir():
            print(f"rulewatch: --landing {landing} is a file, not a folder; point it at the folder that holds it", file=sys.stderr)
            return 2
        source = str(landing.resolve())
    else:
        from rulewatch.kafka.health import check_topic

        check_topic(source.topic)  # a dead cluster or a mistyped topic: said now, not after Spark has started
    if args.rules:
        load_rules_file(args.rules)  # every mistake in the file reported now, not after Spark has started
    lakehouse = Lakehouse(args.lakehouse)
    settings = GoldSettings(
        **arguments.gold_layout(args, lakehouse.checkpoint("gold")),
        allowed_lateness=args.allowed_lateness,
        alerts_topic=kafka_cli.alerts_topic(args),
        window_metrics=args.window_metrics,
    )
    with exclusive(lakehouse, "rulewatch run"):
        check_gold_layout(lakehouse.checkpoint("gold"), settings.layout)  # before bronze and silver run, not after
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
    from rulewatch.cli.bench import bench, time_split
    from rulewatch.spark.runtime.session import get_spark

    if args.scale_curve:
        from rulewatch.cli.bench import scale_curve

        print("rulewatch bench: engine only, 1h SUM window, 100 keys: microseconds per event as the window fills")
        print(f"  {'events/key/window':>18} {'exact':>9} {'bucketed 1m':>12} {'raw rows/key exact':>19} {'bucketed':>9}")
        for p in scale_curve(args.scale_curve):
            print(f"  {p.window_events:>18,} {p.exact_us:>8.1f}us {p.bucketed_us:>10.1f}us {p.exact_rows:>19,} {p.bucketed_rows:>9,}")
        return 0
    if args.pipeline and len(set(args.state_slots or [])) > 1:
        print("rulewatch: bench --pipeline runs the job with one state layout; give one --state-slots value", file=sys.stderr)
        return 2
    if args.rounds > 1 and not args.pipeline:
        print("rulewatch: bench --rounds repeats the whole job: give --pipeline with it", file=sys.stderr)
        return 2
    spark = get_spark("rulewatch-bench")
    if args.pipeline:
        from rulewatch.cli.bench import bench_pipeline, layout_name

        (slots,) = set(args.state_slots or [0])
        print(
            f"rulewatch bench --pipeline: {args.events:,} payments over 24 h in 10 files, {args.keys:,} payee keys, "
            f"the real job, {layout_name(slots)}"
        )
        for n, result in enumerate(bench_pipeline(spark, args.events, args.keys, state_slots=slots, rounds=args.rounds), 1):
            if args.rounds > 1:
                print(f" round {n} of {args.rounds}" + (" (this process's first: its JIT compiles the job's code as it runs)" if n == 1 else ""))
            floor = result.passthrough
            print(f"  {floor.name:<24} {floor.seconds:7.1f}s  {floor.rate:10,.0f} events/s")
            for m in result.layers:
                print(f"  {m.name:<24} {m.seconds:7.1f}s  {m.rate:10,.0f} events/s  ratio {m.rate / floor.rate:4.2f}")
            print(f"  alerts {result.alerts:,}")
        return 0
    if args.rule_propagation:
        from rulewatch.cli.bench import rule_propagation

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
    results = bench(spark, args.events, args.keys, args.batch_events, args.shards, args.state_slots or [0, 16], args.limit)
    floor = results[0].rate
    batches = max(1, args.events // args.batch_events)
    for m in results:
        print(
            f"  {m.name:<34} {m.seconds:7.1f}s  {m.rate:10,.0f} events/s  ratio {m.rate / floor:4.2f}"
            f"  state rows written/batch {m.state_rows_updated / batches:,.0f}  state {m.state_bytes / args.keys:,.0f} B/key"
        )
        print(f"    {time_split(m)}")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rulewatch")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _add_job_cli(subparsers: argparse._SubParsersAction) -> None:
    job = subparsers.add_parser("job", help="the asset bundle job")
    job_sub = job.add_subparsers(dest="job_command", required=True)
    run = job_sub.add_parser("run", help="run the bundle job's task DAG locally, one notebook execution per task")
    run.add_argument("job", nargs="?", help=f"job key under resources.jobs (default: {DEFAULT_JOB}; rulewatch_live runs live mode until cancelled)")
    run.add_argument("--target", "-t", default="local", help="only 'local'; remote runs use `databricks bundle run -t <target>`")
    run.add_argument("--lakehouse", help="job parameter lakehouse: folder for every Delta table and checkpoint")
    run.add_argument("--landing", help="job parameter landing (default: fixtures/transactions in the bundle root)")
    run.add_argument("--rules", help="job parameter rules_file (default: fixtures/rules.json in the bundle root)")
    run.add_argument("--var", type=arguments.key_value, action="append", default=[], metavar="NAME=VALUE", help="override a bundle variable")
    run.add_argument("--param", type=arguments.key_value, action="append", default=[], metavar="NAME=VALUE", help="set a job parameter (as `databricks bundle run --params`), e.g. duration=60 for rulewatch_live")
    arguments.master_option(run)
    run.set_defaults(func=arguments.command("rulewatch.cli.jobs:cmd_job_run"))


def _add_sql_cli(subparsers: argparse._SubParsersAction) -> None:
    sql = subparsers.add_parser("sql", help="SQL over the lakehouse's tables and dashboard views: a prompt, or -e STATEMENT")
    sql.add_argument("--lakehouse", required=True, help="folder holding the Delta tables (as given to `rulewatch run`)")
    sql.add_argument("-e", "--execute", action="append", metavar="STATEMENT",
                     help="run STATEMENT, print its rows and exit (repeatable); without it, statements are read from the "
                          "terminal or standard input, each ended by ;")  # fmt: skip
    arguments.master_option(sql)
    sql.set_defaults(func=arguments.command("rulewatch.cli.sql_cli:cmd_sql"))


def _add_report_cli(subparsers: argparse._SubParsersAction) -> None:
    report = subparsers.add_parser("report", help="a self-contained HTML report with charts from the gold tables")
    report.add_argument("--lakehouse", required=True, help="folder holding the Delta tables (as given to `rulewatch run`)")
    report.add_argument("--out", default="report.html", help="HTML file to write (default: report.html)")
    report.add_argument("--mask", action="store_true", help="pseudonymise account identifiers, as the dashboard does for non-members")
    arguments.master_option(report)
    report.set_defaults(func=arguments.command("rulewatch.cli.report_cli:cmd_report"))


STATE_SLOTS_HELP = (
    "evaluator state layout, fixed per checkpoint (default: what gold's checkpoint began with; 0 for a new one): "
    "0 a batch's keys in one entry when it touches or "
    "reads many (or finds its shard empty), else one entry per key; N hashes the keys of a shard into N entries "
    "(docs/journal/benchmarks.md)"
)


def _stream_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lakehouse", required=True, help="folder holding every Delta table and checkpoint")
    arguments.master_option(parser)
    parser.add_argument("--trigger", type=arguments.trigger, default="0 seconds", help="processing-time trigger of every layer (default: '0 seconds', back to back)")
    arguments.layout_options(parser, STATE_SLOTS_HELP)
    parser.add_argument("--shuffle-partitions", type=arguments.count("shuffle partitions", 8), help="spark.sql.shuffle.partitions for new checkpoints")
    parser.add_argument("--allowed-lateness", type=arguments.allowed_lateness, default="1h", help="events older than the watermark by more are recorded, not evaluated")
    arguments.window_metrics_option(parser)
    parser.add_argument("--gold-no-data-batches", action="store_true", help="let gold run timer-only batches between data batches (slower)")
    parser.add_argument(
        "--gold-source", choices=("topic", "silver"),
        help="what gold reads: 'topic', the Kafka topic itself, de-duplicating as silver does (an alert waits for one "
        "query's batch, not two; ingest still writes bronze and silver beside it), or 'silver'. Fixed per gold checkpoint "
        "(default: what it began with; for a new one 'topic' over Kafka, else silver; docs/design.md)",
    )  # fmt: skip
    parser.add_argument(
        "--metrics-every", type=arguments.seconds("metrics every", 30), default=30.0, metavar="SECONDS",
        help="seconds between the commits that append live batches' pipeline_metrics rows (default 30; 0: every batch "
        "commits its own row, so dashboards are current to the batch, and batches take longer: docs/journal/benchmarks.md)",
    )  # fmt: skip


def _generator_options(parser: argparse.ArgumentParser, rate: float) -> None:
    parser.add_argument("--rate", type=arguments.generator("rate", 1000), default=rate, help=f"events per second (default {rate:,.0f})")
    parser.add_argument("--seed", type=arguments.count("seed", 7, minimum=0), default=7)
    parser.add_argument("--file-interval", type=arguments.generator("file_interval", 0.2), default=0.2, help="seconds between landing files (default 0.2)")
    parser.add_argument("--pattern-every", type=arguments.generator("pattern_every", 5), default=5.0, help="seconds between injected pattern instances; 0: none")


def _add_live_cli(subparsers: argparse._SubParsersAction) -> None:
    gen = subparsers.add_parser("generate", help="land labelled live traffic (JSON lines) at a steady rate")
    gen.add_argument("--landing", help="landing folder the stream reads (or --kafka-topic)")
    gen.add_argument("--labels", help="folder for the injected patterns' labels (default: <landing>-labels, beside it)")
    gen.add_argument("--duration", type=arguments.generator("duration", 60), default=60, help="seconds of traffic (default 60)")
    gen.add_argument("--run-id", help="hex id prefixed to every id of this run (default: from the clock)")
    _generator_options(gen, 1000)
    kafka_cli.add_options(gen, alerts=False, sends=True)
    gen.set_defaults(func=arguments.command("rulewatch.cli.live_cli:cmd_generate"))

    live = subparsers.add_parser("stream", help="run ingest (bronze + silver) -> gold continuously until Ctrl-C")
    _stream_options(live)
    live.add_argument("--landing", help="landing folder to follow (default: <lakehouse>/landing)")
    live.add_argument("--rules", action="append", default=[], help="rules file to MERGE first (repeatable)")
    live.add_argument("--duration", type=arguments.generator("duration", 60), help="stop after this many seconds (default: run until Ctrl-C)")
    live.add_argument(
        "--drain", action="store_true",
        help="stop once everything available has gone through (landed files or the topic's records so far), within --duration "
        "if given: a catch-up run that ends by itself; exit 1 if it had not drained by then",
    )  # fmt: skip
    kafka_cli.add_options(live)
    live.set_defaults(func=arguments.command("rulewatch.cli.live_cli:cmd_stream"))

    dem = subparsers.add_parser("demo", help="generator + stream together, alerts as they land, detection score and latency")
    _stream_options(dem)
    dem.add_argument("--minutes", type=arguments.minutes, default=2, help="minutes of generated traffic (default 2)")
    dem.add_argument("--rules", action="append", help="rules file to MERGE first (repeatable; default: fixtures/rules.json + live_rules.json)")
    _generator_options(dem, 1000)
    kafka_cli.add_options(dem)
    dem.set_defaults(func=arguments.command("rulewatch.cli.live_cli:cmd_demo"))


def build_parser() -> argparse.ArgumentParser:
    parser = arguments.Parser(prog="rulewatch", description="Dynamic-rule fraud alerting on Spark + Delta")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error instead of one line")
    parser.add_argument("--version", action="version", version=f"rulewatch {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="process everything landed once (bronze -> silver -> gold) and summarise")
    run.add_argument("--lakehouse", required=True, help="folder holding every Delta table and checkpoint")
    run.add_argument("--landing", help="landing folder of JSON-lines transaction files (or --kafka-topic)")
    # The flag's name before it matched stream, generate and job run; still accepted, no longer shown.
    run.add_argument("--transactions", dest="landing", help=argparse.SUPPRESS)
    run.add_argument("--rules", help="rules file (JSON array or JSON lines) to MERGE into config/rules first")
    arguments.layout_options(run, STATE_SLOTS_HELP)
    run.add_argument("--allowed-lateness", type=arguments.allowed_lateness, default="1h", help="events older than the watermark by more are recorded, not evaluated")
    arguments.window_metrics_option(run)
    kafka_cli.add_options(run)
    arguments.master_option(run)
    run.set_defaults(func=arguments.command("rulewatch.cli.main:_cmd_run"))
    bench = sub.add_parser("bench", help="evaluator vs a stateless grouped pass-through on the same generated input")
    bench.add_argument("--events", type=arguments.count("events", 200_000), default=200_000)
    bench.add_argument("--keys", type=arguments.count("keys", 10_000), default=10_000)
    bench.add_argument("--batch-events", type=arguments.count("batch events", 50_000), default=50_000)
    bench.add_argument("--shards", type=arguments.shards, default=GoldSettings.shards)
    bench.add_argument("--limit", type=arguments.count("limit", 12_500), default=12_500, help="the SUM rule's limit (lower: more events alert)")
    bench.add_argument("--state-slots", type=arguments.state_slots, nargs="+", help="evaluator state layouts to measure (0 = the batch layout; default: 0 16); with --pipeline, the job's one layout (default 0)")
    bench.add_argument("--scale-curve", type=arguments.count("events per key", 1000), nargs="+", metavar="N", help="instead: exact vs bucketed cost with N events per key per window")
    bench.add_argument("--pipeline", action="store_true", help="instead: the whole job per layer on generated landing files (issue #14's shape)")
    bench.add_argument(
        "--rounds", type=arguments.count("rounds", 1), default=1,
        help="with --pipeline: run the job this many times in one process, each on a fresh lakehouse (the first pays the JIT's warm-up; default 1)",
    )  # fmt: skip
    bench.add_argument("--rule-propagation", type=arguments.count("trials", 5), metavar="TRIALS", help="instead: time rule changes reaching a running stream")
    arguments.master_option(bench)
    bench.set_defaults(func=arguments.command("rulewatch.cli.main:_cmd_bench"))
    add_rules_cli(sub)
    _add_job_cli(sub)
    add_remote_cli(sub)
    _add_report_cli(sub)
    _add_sql_cli(sub)
    _add_live_cli(sub)
    kafka_cli.add_cli(sub)
    gold_cli.add_cli(sub)
    return parser


# Errors that say what is wrong and how to fix it: the message is all the user needs, not a traceback.
# Named by module so that checking for them imports nothing: an error whose module was never imported
# cannot have been raised.
USER_ERRORS = {
    "rulewatch.cli.arguments": ("MissingExtra",),
    "rulewatch.engine.rules": ("RuleSetError",),
    "rulewatch.spark.control.rules_table": ("RulesConflict",),
    "rulewatch.spark.storage.lakehouse": ("LakehouseBusy", "LakehouseUnwritable"),
    "rulewatch.spark.layers.landing": ("LandingError",),
    "rulewatch.spark.storage.delta_log": ("CheckpointError",),
    "rulewatch.spark.runtime.session": ("ConnectPortBusy",),
    "rulewatch.spark.runtime.env": ("SettingError",),
    "rulewatch.kafka.client": ("KafkaConfigError",),
    "rulewatch.kafka.health": ("KafkaUnreachable",),
}


def _user_error(err: BaseException) -> bool:
    loaded = [getattr(sys.modules[m], n) for m, names in USER_ERRORS.items() if m in sys.modules for n in names]
    return isinstance(err, tuple(loaded))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "master", None):
            use_master(args.master)
        return args.func(args)
    except Exception as err:
        if args.debug or not _user_error(err):
            raise
        print(f"rulewatch: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
