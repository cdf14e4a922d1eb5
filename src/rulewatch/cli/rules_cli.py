"""``rulewatch rules apply|export|history|clear-state``: the rules table from the command line.

``add_cli(subparsers)`` registers the ``rules`` command on the main parser; every handler takes the
parsed arguments and returns the process exit code (0 ok, 1 no such table, 2 invalid rules file).
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from rulewatch.cli import arguments
from rulewatch.engine.rules import RuleError, RuleSetError, parse_rule


def _spark_and_lakehouse(args: argparse.Namespace):
    from rulewatch.spark.storage.lakehouse import Lakehouse
    from rulewatch.spark.runtime.session import get_spark

    arguments.progress("rulewatch rules", "starting Spark")
    return get_spark(), Lakehouse(args.lakehouse)


def _no_table(lakehouse) -> int:
    print(f"rulewatch: no rules table at {lakehouse.rules}; apply a rules file first (rulewatch rules apply)", file=sys.stderr)
    return 1


def running_notice(holder: str) -> str:
    """One line for ``rules apply`` while ``holder`` (the lock file's text) holds the lakehouse: when that
    process's evaluator takes the change. A live stream's rules source is read afresh each micro-batch; a
    run's gold reads it once, when it starts."""
    if "(rulewatch stream)" in holder or "(rulewatch demo)" in holder:
        when = "its gold stream applies this change from its next micro-batch"
    elif "(rulewatch run)" in holder:
        when = (
            "that run's evaluator takes this change only if its gold layer had not started yet, otherwise the next run's "
            "(the run's summary names the config/rules version it evaluated with)"
        )
    else:  # a job run, or a release that did not name its command
        when = "a live stream applies this change from its next micro-batch; a run whose gold layer has started, from the next run"
    return f"rulewatch: lakehouse in use by {holder}: {when}"


def cmd_rules_apply(args: argparse.Namespace) -> int:
    """Validate FILE, MERGE it into config/rules and print each rule's change."""
    from rulewatch.engine.rules import load_rules_file
    from rulewatch.spark.storage.lakehouse import Lakehouse, lock_holder
    from rulewatch.spark.control.rules_table import apply_rules

    try:
        rules = load_rules_file(args.file)  # before Spark starts: a bad file fails fast
        lakehouse = Lakehouse(args.lakehouse)
        holder = lock_holder(lakehouse)
        # Apply takes no lock, so that rules can change under a running stream; a stream applies them itself.
        answer = _handed_to_stream(lakehouse, holder, rules, args.updated_by or getpass.getuser())
        if answer is not None and answer.error:
            print(f"rulewatch: the stream holding the lakehouse ({answer.server}) wrote nothing: {answer.error}", file=sys.stderr)
            return 2
        if answer is None:
            spark, lakehouse = _spark_and_lakehouse(args)
            arguments.progress("rulewatch rules", f"merging {len(rules)} rule(s) into {lakehouse.rules}")
            changes = apply_rules(spark, lakehouse, rules, args.updated_by)
        else:
            changes = answer.changes
    except RuleSetError as err:
        source = err.source or args.file
        print(f"rulewatch: {RuleSetError(err.errors, err.locations, source)}", file=sys.stderr)
        print("rulewatch: nothing was written", file=sys.stderr)
        return 2
    for change in changes:
        print(change)
    counts = Counter(change.action for change in changes)
    written = counts["added"] + counts["updated"] + counts["deleted"]
    summary = ", ".join(f"{counts[a]} {a}" for a in ("added", "updated", "deleted", "unchanged") if counts[a])
    by = f" by the stream holding the lakehouse ({answer.server})" if answer is not None else ""
    print(f"rules: {summary or 'no rules in file'}; " + (f"written to {lakehouse.rules}{by}" if written else "nothing written"))
    # A run may have read them already: say when the holder takes the change.
    if written and holder:
        print(running_notice(holder), file=sys.stderr)
    return 0


def _handed_to_stream(lakehouse, holder: str | None, rules: list, updated_by: str):
    """The stream's answer when a stream holds ``lakehouse`` and applied ``rules`` (rule_requests.py);
    None when there is none, or it did not take them in time: then this process applies them."""
    from rulewatch.spark.control import rule_requests

    if not rule_requests.serves_requests(holder):
        return None
    arguments.progress("rulewatch rules", f"handing {len(rules)} rule(s) to {holder}")
    answer = rule_requests.ask(lakehouse, rules, updated_by)
    if answer is None:
        print(f"rulewatch: {holder} did not take the rules within {rule_requests.CLAIM_TIMEOUT_S:.0f}s; applying them here "
              "(a Spark of its own)", file=sys.stderr)  # fmt: skip
    return answer


def cmd_rules_export(args: argparse.Namespace) -> int:
    """Write config/rules as a rules file (stdout unless --out)."""
    from rulewatch.spark.control.rules_table import export_rules, rules_table_exists, rules_to_json_text

    spark, lakehouse = _spark_and_lakehouse(args)
    if not rules_table_exists(spark, lakehouse):
        return _no_table(lakehouse)
    arguments.progress("rulewatch rules", f"reading {lakehouse.rules}")
    rules = export_rules(spark, lakehouse)
    for rule in rules:
        try:
            parse_rule(rule)
        except RuleError as err:
            print(f"rulewatch: warning: exported as stored, but not a valid rule: {err}", file=sys.stderr)
    text = rules_to_json_text(rules)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"rulewatch: {len(rules)} rule(s) written to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _history_line(row) -> str:
    from rulewatch.spark.control.rules_table import field_diff

    when = f"{row.commit_timestamp:%Y-%m-%d %H:%M:%S}" if row.commit_timestamp else "?"
    head = f"v{row.commit_version:<4} {when}  rule {row.rule_id:<5} {row.change:<8} by {row.updated_by or '(unknown)'}"
    if row.change == "updated":
        detail = field_diff(json.loads(row.before), json.loads(row.after)) or "no field changed"
    else:
        detail = row.after if row.change == "inserted" else row.before
    return f"{head}  {detail}"


def cmd_rules_history(args: argparse.Namespace) -> int:
    """Bring gold/rule_history up to date from the change feed, then print the last changes."""
    from rulewatch.spark.control.rules_table import latest_rule_history, rules_table_exists, run_rule_history

    spark, lakehouse = _spark_and_lakehouse(args)
    if not rules_table_exists(spark, lakehouse):
        return _no_table(lakehouse)
    arguments.progress("rulewatch rules", f"updating {lakehouse.rule_history} from the change feed")
    run_rule_history(spark, lakehouse)
    rows = latest_rule_history(spark, lakehouse, args.last)
    print(f"rules history: last {len(rows)} change(s) of {lakehouse.rules}")
    for row in rows:
        print(f"  {_history_line(row)}")
    return 0


def cmd_rules_clear_state(args: argparse.Namespace) -> int:
    """Ask the evaluator to forget one rule's (or every rule's) window state up to a point in event time."""
    from rulewatch.spark.control.commands import CommandError, as_utc, future_clear_point, request_clear_state
    from rulewatch.spark.control.rules_table import rules_table_exists
    from rulewatch.spark.runtime.env import future_tolerance

    before = None
    if args.before:
        try:
            before = as_utc(datetime.fromisoformat(args.before))
        except ValueError:
            print(f"rulewatch: --before {args.before!r} is not an ISO-8601 time such as 2026-11-01T12:00:00Z", file=sys.stderr)
            return 2
        future = future_clear_point(before, datetime.now(timezone.utc), future_tolerance())
        if future is not None:  # known without silver: refused before Spark starts
            print(f"rulewatch: {future}", file=sys.stderr)
            return 2
    spark, lakehouse = _spark_and_lakehouse(args)
    if not rules_table_exists(spark, lakehouse):
        return _no_table(lakehouse)
    try:
        request = request_clear_state(spark, lakehouse, args.rule, before, args.updated_by)
    except CommandError as err:
        print(f"rulewatch: {err}", file=sys.stderr)
        return 2
    print(f"clear-state requested: {request}")
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``rules apply|export|history|clear-state`` on the main parser's subparsers."""
    rules = subparsers.add_parser("rules", help="apply, export or audit the rules table (config/rules)")
    sub = rules.add_subparsers(dest="rules_command", required=True)

    apply = sub.add_parser("apply", help="validate a rules file and MERGE it into config/rules")
    apply.add_argument("file", help="rules file: a JSON array or JSON lines")
    apply.add_argument("--lakehouse", required=True, help="folder holding every Delta table and checkpoint")
    apply.add_argument("--updated-by", help="name recorded in updated_by (default: the OS user)")
    arguments.master_option(apply)
    apply.set_defaults(func=arguments.needs(cmd_rules_apply))

    export = sub.add_parser("export", help="write config/rules as a rules file")
    export.add_argument("--lakehouse", required=True, help="folder holding every Delta table and checkpoint")
    export.add_argument("--out", help="file to write (default: stdout)")
    arguments.master_option(export)
    export.set_defaults(func=arguments.needs(cmd_rules_export))

    history = sub.add_parser("history", help="update gold/rule_history from the change feed and show the last changes")
    history.add_argument("--lakehouse", required=True, help="folder holding every Delta table and checkpoint")
    history.add_argument("--last", type=arguments.count("changes", 20), default=20, help="how many changes to show (default 20)")
    arguments.master_option(history)
    history.set_defaults(func=arguments.needs(cmd_rules_history))

    clear = sub.add_parser("clear-state", help="make one rule (or every rule) start its windows over")
    clear.add_argument("--lakehouse", required=True, help="folder holding every Delta table and checkpoint")
    which = clear.add_mutually_exclusive_group(required=True)
    which.add_argument("--rule", type=arguments.rule_id, help="the rule id to clear")
    which.add_argument("--all", action="store_true", help="clear every current rule")
    clear.add_argument(
        "--before",
        help="forget events up to this event time, between the oldest and newest in silver (ISO-8601, no zone: UTC; default: the newest)",
    )
    clear.add_argument("--updated-by", help="name recorded as requested_by (default: the OS user)")
    arguments.master_option(clear)
    clear.set_defaults(func=arguments.needs(cmd_rules_clear_state))
    return rules
