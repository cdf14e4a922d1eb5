"""``rulewatch sql``: SQL over a lakehouse's tables and dashboard views, as a prompt or with ``-e``.

Each Delta table of the lakehouse is a temp view named as in Unity Catalog (``gold_alerts``,
``config_rules``, ...), beside the dashboard's views (``alerts_per_rule_hour``, ...), so a query reads
the same here as in a Databricks SQL editor, changes included: ``UPDATE config_rules SET limit = 500
WHERE ruleId = 1`` writes to the Delta table under the view.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO

from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

from rulewatch.cli.arguments import progress
from rulewatch.spark.present.views import VIEW_NAMES, register_views
from rulewatch.spark.storage.lakehouse import Lakehouse

MAX_ROWS = 50
PROMPT = "rulewatch> "


def register(spark: SparkSession, lakehouse: Lakehouse) -> list[str]:
    """Make the lakehouse's tables (those it has) and the dashboard's views queryable by name; their names."""
    names = []
    for path in lakehouse.tables():
        if not Path(path, "_delta_log").is_dir():
            continue
        name = lakehouse.name_of(path).replace("/", "_")
        spark.sql(f"CREATE OR REPLACE TEMP VIEW {name} AS SELECT * FROM delta.{_quoted_path(path)}")
        names.append(name)
    register_views(spark, lakehouse, viewer_in_pii_group=True)
    return sorted(names) + list(VIEW_NAMES)


def _quoted_path(path: str) -> str:
    return "`" + path.replace("`", "``") + "`"


def statements(lines: Iterable[str]) -> Iterator[str]:
    """The statements in ``lines``, each ended by a ``;`` at the end of a line (or by the end of input)."""
    pending: list[str] = []
    for line in lines:
        pending.append(line.rstrip("\n"))
        if line.rstrip().endswith(";"):
            text = "\n".join(pending).strip().rstrip(";").strip()
            pending = []
            if text:
                yield text
    if rest := "\n".join(pending).strip().rstrip(";").strip():
        yield rest


def execute(spark: SparkSession, statement: str, out: TextIO | None = None, max_rows: int = MAX_ROWS) -> None:
    """Run one statement; print its rows (at most ``max_rows``, and how many more there were) to ``out``
    (default: standard output as it is when called)."""
    out = out or sys.stdout
    frame = spark.sql(statement)
    if not frame.columns:
        print("OK", file=out)
        return
    rows = frame.limit(max_rows + 1).collect()
    shown = rows[:max_rows]
    widths = [max([len(c), *(len(_text(r[i])) for r in shown)]) for i, c in enumerate(frame.columns)]
    print(" | ".join(c.ljust(w) for c, w in zip(frame.columns, widths)).rstrip(), file=out)
    print("-+-".join("-" * w for w in widths), file=out)
    for row in shown:
        print(" | ".join(_text(v).ljust(w) for v, w in zip(row, widths)).rstrip(), file=out)
    more = ", more not shown (add LIMIT, or query a count)" if len(rows) > max_rows else ""
    print(f"({len(shown)} row{'s' if len(shown) != 1 else ''}{more})", file=out)


def _text(value: object) -> str:
    if value is None:
        return "NULL"
    if hasattr(value, "normalize"):  # Decimal: no trailing zeros of decimal(38, 10)
        return f"{value.normalize():f}"
    return str(value)


def _quiet_query_errors() -> None:
    """pyspark logs every failed query with its context as a JSON line on stderr before raising it; the
    command says the error once, in one line of its own."""
    from pyspark.logger import PySparkLogger

    for name in ("SQLQueryContextLogger", "DataFrameQueryContextLogger"):
        PySparkLogger.getLogger(name).setLevel(logging.CRITICAL)


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def cmd_sql(args: argparse.Namespace) -> int:
    from rulewatch.spark.runtime.session import get_spark

    lakehouse = Lakehouse(args.lakehouse)
    if not Path(lakehouse.root).is_dir():
        print(f"rulewatch sql: --lakehouse {lakehouse.root} does not exist; run `rulewatch run --lakehouse {args.lakehouse} ...` first", file=sys.stderr)
        return 2
    progress("rulewatch sql", "starting Spark")
    spark = get_spark("rulewatch-sql")
    _quiet_query_errors()
    names = register(spark, lakehouse)
    if args.execute:
        for statement in args.execute:
            try:
                execute(spark, statement)
            except PySparkException as err:
                print(f"rulewatch sql: {_first_line(err)}", file=sys.stderr)
                return 1
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"tables and views: {', '.join(names)}")
        print("end each statement with ; (a change writes to the table: UPDATE config_rules SET limit = 500 WHERE ruleId = 1;); quit with Ctrl-D")
    failed = False
    for statement in statements(_lines(sys.stdin, interactive)):
        if statement.lower() in ("quit", "exit"):
            break
        try:
            execute(spark, statement)
        except PySparkException as err:
            failed = True
            print(f"error: {_first_line(err)}", file=sys.stderr)
    return 1 if failed and not interactive else 0


def _lines(stream: TextIO, interactive: bool) -> Iterator[str]:
    while True:
        if interactive:
            print(PROMPT, end="", flush=True)
        line = stream.readline()
        if not line:
            return
        yield line

