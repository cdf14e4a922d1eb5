"""``rulewatch sql``: the lakehouse's tables and views by name, with -e or from standard input."""

from __future__ import annotations

import io
import shutil
import sys
from collections import Counter

import pytest

from rulewatch.cli.main import main
from rulewatch.cli.sql_cli import statements
from rulewatch.spark.storage.lakehouse import Lakehouse


def test_statements_end_at_a_semicolon_closing_a_line_or_at_the_end():
    lines = ["SELECT 1;\n", "SELECT a,\n", "  b FROM t;\n", "\n", ";\n", "SELECT 'x;y'\n", "FROM u"]
    assert list(statements(lines)) == ["SELECT 1", "SELECT a,\n  b FROM t", "SELECT 'x;y'\nFROM u"]


def _results(out: str) -> list[list[list[str]]]:
    """Each printed result's rows (its header, rule and closing count line left out); "OK" is no rows."""
    results, block = [], []
    for line in out.splitlines():
        if line == "OK":
            results.append([])
        elif line.startswith("(") and line.endswith(")"):
            results.append([[cell.strip() for cell in row.split(" | ")] for row in block[2:]])
            block = []
        else:
            block.append(line)
    return results


@pytest.mark.jvm
def test_tables_and_views_answer_by_their_catalog_names(fixture_run, expected_alerts, capsys):
    root = fixture_run.lakehouse.root
    code = main(["sql", "--lakehouse", root, "-e", "SELECT rule_id, count(*) AS alerts FROM gold_alerts GROUP BY rule_id ORDER BY rule_id",
                 "-e", "SELECT sum(alerts) AS alerts FROM alerts_per_rule_hour"])  # fmt: skip
    want = sorted(Counter(a["rule_id"] for a in expected_alerts).items())
    assert code == 0
    assert _results(capsys.readouterr().out) == [[[str(rule), str(n)] for rule, n in want], [[str(len(expected_alerts))]]]


@pytest.mark.jvm
def test_statements_from_standard_input_run_in_order_and_a_failing_one_is_named(fixture_run, capsys, monkeypatch):
    script = "SELECT count(*) AS n\nFROM silver_transactions;\nSELECT nonsense FROM gold_alerts;\nSELECT count(*) AS n FROM config_rules;\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    code = main(["sql", "--lakehouse", fixture_run.lakehouse.root])
    captured = capsys.readouterr()
    assert code == 1  # not a terminal: a failed statement fails the command, after the others ran
    assert _results(captured.out) == [[["42"]], [["4"]]]
    said = captured.err.splitlines()
    assert said[0] == "rulewatch sql: starting Spark ..." and len(said) == 2  # the error once, no logged context
    assert said[1].startswith("error: ") and "nonsense" in said[1]


@pytest.mark.jvm
def test_a_rule_changed_through_its_view_or_by_path_is_changed_in_the_table(spark, fixture_run, tmp_path, capsys):
    root = tmp_path / "lakehouse"
    shutil.copytree(fixture_run.lakehouse.root, root)  # the shared run stays as it is
    rules = Lakehouse(str(root)).rules
    code = main(["sql", "--lakehouse", str(root), "-e", "UPDATE config_rules SET limit = 500 WHERE ruleId = 1",
                 "-e", f"UPDATE delta.`{rules}` SET limit = 700 WHERE ruleId = 2",
                 "-e", "SELECT ruleId, limit FROM config_rules WHERE ruleId <= 2 ORDER BY ruleId"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("num_affected_rows")
    assert _results(out) == [[["1"]], [["1"]], [["1", "500"], ["2", "700"]]]
    stored = {r.ruleId: r.limit for r in spark.read.format("delta").load(rules).where("ruleId <= 2").collect()}
    assert stored == {1: 500, 2: 700}
    # Through the view too, the change is in the feed the running gold stream follows.
    changed = spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", 0).load(rules)
    assert changed.where("_change_type = 'update_postimage' AND ruleId = 1 AND limit = 500").count() == 1


def test_a_missing_lakehouse_is_named_before_spark_starts(tmp_path, capsys, monkeypatch):
    import rulewatch.spark.runtime.session

    monkeypatch.setattr(rulewatch.spark.runtime.session, "get_spark", lambda *_: pytest.fail("Spark was started"))
    assert main(["sql", "--lakehouse", str(tmp_path / "none"), "-e", "SELECT 1"]) == 2
    assert capsys.readouterr().err == f"rulewatch sql: --lakehouse {tmp_path / 'none'} does not exist; run `rulewatch run --lakehouse {tmp_path / 'none'} ...` first\n"
