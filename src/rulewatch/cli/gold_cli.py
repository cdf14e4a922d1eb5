"""``rulewatch gold rescale``: move gold's evaluator state to another shard count (spark/layers/rescale.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rulewatch.cli import arguments, kafka_cli


def cmd_rescale(args: argparse.Namespace) -> int:
    from rulewatch.spark.evaluator.settings import GoldSettings
    from rulewatch.spark.layers.rescale import rescale_gold, staged
    from rulewatch.spark.runtime.session import get_spark
    from rulewatch.spark.storage.lakehouse import Lakehouse, exclusive

    lakehouse = Lakehouse(args.lakehouse)
    checkpoint = lakehouse.checkpoint("gold")
    if not Path(checkpoint).is_dir() and not staged(checkpoint).is_dir():  # said before Spark starts
        print(f"rulewatch: gold has not run on {lakehouse.root}: nothing to rescale (give --shards to its first run)", file=sys.stderr)
        return 2
    # The catch-up before the move and the new query's first batch evaluate what silver holds: with the
    # settings the lakehouse's runs use, so their alerts reach the topic and metrics rows as any run's do.
    settings = GoldSettings(allowed_lateness=args.allowed_lateness, alerts_topic=kafka_cli.alerts_topic(args), window_metrics=args.window_metrics)
    with exclusive(lakehouse, "rulewatch gold rescale"):
        arguments.progress("rulewatch gold rescale", "starting Spark")
        spark = get_spark()
        done = rescale_gold(
            spark, lakehouse, args.shards, settings, args.shuffle_partitions,
            say=lambda line: arguments.progress("rulewatch gold rescale", line),
        )  # fmt: skip
    print(
        f"gold rescaled from {done.shards_before} to {done.shards} shards: {done.keys:,} keys moved with their windows; "
        f"its batches go on from {done.batch + 1}. The old checkpoint is kept at {done.kept_at} (delete it once satisfied)."
    )
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    gold = subparsers.add_parser("gold", help="gold's evaluator: rescale its state to another shard count")
    sub = gold.add_subparsers(dest="gold_command", required=True)
    rescale = sub.add_parser(
        "rescale", help="move gold's state (every key's windows, the rules) to --shards shards, losing no window and repeating no alert"
    )
    rescale.add_argument("--lakehouse", required=True, help="folder holding every Delta table and checkpoint")
    rescale.add_argument("--shards", type=arguments.shards, required=True, help="the new shard count")
    rescale.add_argument(
        "--shuffle-partitions", type=arguments.count("shuffle partitions", 8),
        help="state partitions of the new checkpoint (default: one per shard)",
    )  # fmt: skip
    rescale.add_argument(
        "--allowed-lateness", type=arguments.allowed_lateness, default="1h",
        help="the lateness gold runs with (default 1h): gold first finishes what is available with it",
    )  # fmt: skip
    arguments.window_metrics_option(rescale)
    kafka_cli.add_options(rescale, source=False)
    arguments.master_option(rescale)
    rescale.set_defaults(func=arguments.command("rulewatch.cli.gold_cli:cmd_rescale"))
