"""Rules are data: hostile text in a rule is rejected or stored as text, never run; the repo holds no secret.

SQL injection strings go into every rule field an analyst controls, both through
``rulewatch rules apply`` and through a plain SQL INSERT into ``config/rules`` (which the running
evaluator validates into ``config/rule_errors``). A filter value that looks like SQL must match only
events carrying exactly that text (up to the surrounding whitespace the identity rule trims from every
key and filter value, docs/reliability.md).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from pyspark.sql import functions as F

from conftest import ROOT
from rulewatch.cli.main import main
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.layers.pipeline import run_all

INJECTION = "x' OR '1'='1"
DROP = "'; DROP TABLE delta.`{table}`; --"
T0 = 1793527200000  # 2026-11-01T10:00:00Z


def _rule(rule_id: int, **fields) -> dict:
    return {"ruleId": rule_id, "ruleState": "ACTIVE", "groupingKeyNames": ["userId"], "aggregateFieldName": "COUNT_FLINK",
            "aggregatorFunctionType": "COUNT", "limitOperatorType": "GREATER", "limit": 0, "window": "1h", **fields}  # fmt: skip


def _apply(path: Path, rules: list[dict], lakehouse: Lakehouse) -> int:
    path.write_text(json.dumps(rules))
    return main(["rules", "apply", str(path), "--lakehouse", lakehouse.root])


def _quoted(text: str) -> str:
    """``text`` as a Spark SQL string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _version(spark, path: str) -> int:
    return spark.sql(f"DESCRIBE HISTORY delta.`{path}` LIMIT 1").first().version


@pytest.fixture(scope="module")
def hostile(spark, tmp_path_factory):
    root = tmp_path_factory.mktemp("rule-safety")
    lakehouse = Lakehouse(str(root / "lakehouse"))
    good = [
        _rule(10, filter={"action": INJECTION}, description=DROP.format(table=lakehouse.silver_transactions)),
        _rule(11, groupingKeyNames=["ip"], filter={"action": "login"}, description="'); DELETE FROM x; --"),
    ]
    assert _apply(root / "good.json", good, lakehouse) == 0
    # An analyst's SQL edit, hostile text written as properly quoted SQL strings: the only place it
    # could turn into code is rulewatch itself.
    for rule_id, key, field, filter_key in [
        (20, "userId`) OR 1=1 --", "COUNT_FLINK", "action"),
        (21, "userId", "paymentAmount) OR (1=1", "action"),
        (22, "userId", "COUNT_FLINK", "action' OR '1'='1"),
    ]:
        spark.sql(
            f"INSERT INTO delta.`{lakehouse.rules}` (ruleId, ruleState, groupingKeyNames, aggregateFieldName, "
            "aggregatorFunctionType, limitOperatorType, limit, window, filter) "
            f"VALUES ({rule_id}, 'ACTIVE', array({_quoted(key)}), {_quoted(field)}, 'COUNT', 'GREATER', 0, '1h', "
            f"map({_quoted(filter_key)}, 'login'))"
        )
    landing = root / "landing"
    landing.mkdir()
    events = [("e1", "u-1", INJECTION), ("e2", "u-1", INJECTION), ("e3", "u-2", "login"), ("e4", "u-3", "x"),
              ("e5", "u-4", INJECTION + " "), ("e6", "u-5", "X' OR '1'='1"), ("e7", "u-6", "x' OR '1'='1' --"),
              ("e8", "u-7", INJECTION.replace(" ", "  ", 1))]  # fmt: skip
    lines = [json.dumps({"transactionId": t, "eventTime": T0 + i * 1000, "userId": u, "ip": f"203.0.113.{i}", "action": a})
             for i, (t, u, a) in enumerate(events)]  # fmt: skip
    (landing / "events.jsonl").write_text("\n".join(lines) + "\n")
    run_all(spark, lakehouse, str(landing), log=lambda _: None)
    return root, lakehouse


def test_a_filter_value_that_looks_like_sql_matches_only_that_exact_text(spark, hostile):
    _, lakehouse = hostile
    alerts = spark.read.format("delta").load(lakehouse.alerts).where("rule_id = 10")
    # e5 differs only by a trailing space, which the identity rule trims; e6-e8 differ inside the text.
    assert sorted(r.transaction_id for r in alerts.collect()) == ["e1", "e2", "e5"]


def test_hostile_descriptions_are_stored_as_text_and_the_tables_are_intact(spark, hostile):
    _, lakehouse = hostile
    rules = {r.ruleId: r for r in spark.read.format("delta").load(lakehouse.rules).collect()}
    assert rules[10].description == DROP.format(table=lakehouse.silver_transactions)
    assert rules[10].filter == {"action": INJECTION}
    assert spark.read.format("delta").load(lakehouse.silver_transactions).count() == 8  # not dropped
    assert spark.read.format("delta").load(lakehouse.alerts).where("rule_id = 11").count() == 1  # e3, the one login


def test_sql_inserted_rows_with_hostile_fields_are_quarantined_naming_the_field(spark, hostile):
    _, lakehouse = hostile
    errors = {r.rule_id: r for r in spark.read.format("delta").load(lakehouse.rule_errors).collect()}
    assert {rule_id: r.field for rule_id, r in errors.items()} == {
        20: "groupingKeyNames", 21: "aggregateFieldName", 22: "filter",
    }  # fmt: skip
    assert "userId`) OR 1=1 --" in errors[20].reason and "allowed:" in errors[20].reason
    alerts = spark.read.format("delta").load(lakehouse.alerts)
    assert alerts.where(F.col("rule_id").isin(20, 21, 22)).count() == 0  # never executed


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"groupingKeyNames": ["userId; DROP TABLE x"]}, "groupingKeyNames"),
        ({"aggregateFieldName": "paymentAmount) OR 1=1 --", "aggregatorFunctionType": "SUM"}, "aggregateFieldName"),
        ({"filter": {"action = action OR 1": "x"}}, "filter"),
        ({"filter": {"action": {"$ne": None}}}, "filter"),
        ({"aggregatorFunctionType": "COUNT); DROP TABLE x; --"}, "aggregatorFunctionType"),
        ({"window": "1h; DROP TABLE x"}, "window"),
        ({"limit": "0 OR 1=1"}, "limit"),
        ({"ruleState": "ACTIVE' --"}, "ruleState"),
    ],
)  # fmt: skip
def test_rules_apply_rejects_hostile_fields_and_writes_nothing(spark, hostile, capsys, change, field):
    root, lakehouse = hostile
    before = _version(spark, lakehouse.rules)
    assert _apply(root / "bad.json", [_rule(30, **change)], lakehouse) == 2
    err = capsys.readouterr().err
    assert f"rule 30: field '{field}'" in err and "nothing was written" in err
    assert _version(spark, lakehouse.rules) == before


# ---------------------------------------------------------------------------------- no secrets in repo

SECRETS = {
    "Databricks token": r"dapi[0-9a-f]{32}",
    "GitHub token": r"gh[pousr]_[A-Za-z0-9]{36}",
    "AWS access key": r"AKIA[0-9A-Z]{16}",
    "private key": r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
    "Slack token": r"xox[abprs]-[A-Za-z0-9-]{10,}",
    "Azure storage key": r"AccountKey=[A-Za-z0-9+/=]{20,}",
    "credential assignment": r"(?i)\b(token|secret|password|client_secret)\b[\"']?\s*[:=]\s*[\"']?[A-Za-z0-9_\-/+=]{16,}",
    "AWS workspace host": r"\b(?!accounts\.)[a-z0-9-]+\.cloud\.databricks\.com",
    "Azure workspace host": r"adb-[0-9]+\.[0-9]+\.azuredatabricks\.net",
    "GCP workspace host": r"[0-9]+\.[0-9]+\.gcp\.databricks\.com",
}


def test_the_repository_holds_no_secret_and_no_workspace_host():
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert len(files) > 50
    found = []
    for name in files:
        path = ROOT / name
        if not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="ignore")
        found += [f"{name}: {what}" for what, pattern in SECRETS.items() if re.search(pattern, text)]
    assert found == [], "move these to the environment or a secret scope: " + ", ".join(found)


def test_the_secret_patterns_catch_what_they_are_for():
    samples = {
        "Databricks token": "dapi" + "0123456789abcdef" * 2,
        "credential assignment": 'client_secret: "' + "Zm9vYmFyYmF6cXV4" * 2 + '"',
        "AWS workspace host": "host: https://dbc-1234abcd-5678" + ".cloud.databricks.com",
        "Azure workspace host": "https://adb-1234567890123456.7" + ".azuredatabricks.net",
    }
    for what, sample in samples.items():
        assert re.search(SECRETS[what], sample), what
    assert not re.search(SECRETS["AWS workspace host"], "https://accounts" + ".cloud.databricks.com")
