"""``rulewatch report``: the HTML report (rulewatch.spark.present.report) of a lakehouse, written to a file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rulewatch.cli.arguments import progress
from rulewatch.spark.present.report import build_report
from rulewatch.spark.storage.lakehouse import Lakehouse


def cmd_report(args: argparse.Namespace) -> int:
    from rulewatch.spark.runtime.session import get_spark

    lakehouse = Lakehouse(args.lakehouse)
    if not Path(lakehouse.alerts, "_delta_log").is_dir():
        print(
            f"rulewatch report: no gold/alerts table under {lakehouse.root}; "
            f"run `rulewatch run --lakehouse {args.lakehouse} --landing ...` first",
            file=sys.stderr,
        )
        return 2
    progress("rulewatch report", "starting Spark")
    spark = get_spark("rulewatch-report")
    progress("rulewatch report", f"reading the gold, silver and rules tables of {lakehouse.root}")
    html = build_report(spark, lakehouse, mask=args.mask)
    out = Path(args.out)
    out.write_text(html, encoding="utf-8")
    print(f"rulewatch report: wrote {out.resolve()}")
    return 0
