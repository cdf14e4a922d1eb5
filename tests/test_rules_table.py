"""config/rules on real Spark + Delta: apply, export, SQL edits and the rule history."""

from __future__ import annotations

import argparse
import json
import shutil
from datetime import datetime
from decimal import Decimal
from pathlib import Path

import pytest

from conftest import FIXTURES
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.engine.rules import RuleSetError, parse_rules
from rulewatch.spark.control.rules_table import (
    apply_rules,
    apply_rules_file,
    export_rules,
    history_rows,
    latest_rule_history,
    row_to_rule_json,
    rules_table_exists,
    rules_to_json_text,
    run_rule_history,
)
from rulewatch.spark.storage.tables import table_ref

FIXTURE_RULES = json.loads((FIXTURES / "rules.json").read_text())
INJECTION = "x'); DROP TABLE rules; -- \" `ruleId` = 1 OR 1=1; DELETE FROM delta.`/tmp`"


def version(spark, path: str) -> int:
    return spark.sql(f"DESCRIBE HISTORY {table_ref(path)} LIMIT 1").collect()[0]["version"]


def table_rules(spark, lakehouse: Lakehouse) -> dict[int, dict]:
    return {r["ruleId"]: r for r in export_rules(spark, lakehouse)}


def write_rules(path: Path, rules: list[dict]) -> str:
    path.write_text(json.dumps(rules, indent=1))
    return str(path)


def edited(**changes: dict) -> list[dict]:
    """The fixture rules with some rules' fields replaced (None: rule left out)."""
    out = []
    for rule in FIXTURE_RULES:
        change = changes.get(f"r{rule['ruleId']}", {})
        if change is not None:
            out.append({**rule, **change})
    return out


def history(spark, lakehouse: Lakehouse) -> list[tuple]:
    rows = spark.read.format("delta").load(lakehouse.rule_history).orderBy("commit_version", "rule_id").collect()
    return [
        (r.commit_version, r.rule_id, r.change, r.updated_by,
         r.before and json.loads(r.before), r.after and json.loads(r.after))
        for r in rows
    ]  # fmt: skip


@pytest.fixture(scope="module")
def applied_once(spark, tmp_path_factory) -> Lakehouse:
    """fixtures/rules.json applied by alice to a new lakehouse (version 0 the CREATE, 1 the MERGE); only copied."""
    lakehouse = Lakehouse(str(tmp_path_factory.mktemp("applied") / "lh"))
    apply_rules_file(spark, lakehouse, FIXTURES / "rules.json", updated_by="alice")
    return lakehouse


@pytest.fixture
def applied(spark, applied_once, tmp_path) -> Lakehouse:
    """A private copy of ``applied_once``: a table folder copies in milliseconds, an apply costs a CREATE and a MERGE."""
    shutil.copytree(applied_once.root, tmp_path / "lh")
    lakehouse = Lakehouse(str(tmp_path / "lh"))
    assert version(spark, lakehouse.rules) == 1
    return lakehouse


# ---------------------------------------------------------------------------------- apply / export


def test_apply_reports_changes_and_writes_only_real_ones(spark, tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "lh"))
    first = apply_rules_file(spark, lakehouse, FIXTURES / "rules.json", updated_by="alice")
    assert [str(c) for c in first] == [f"rule {i}: added" for i in (1, 2, 3, 4)]
    v1 = version(spark, lakehouse.rules)

    # The same file again: every rule unchanged, no commit.
    again = apply_rules_file(spark, lakehouse, FIXTURES / "rules.json")
    assert {c.action for c in again} == {"unchanged"}
    assert version(spark, lakehouse.rules) == v1

    # Update one, pause one, delete one, add one, keep one; absent DELETE targets are no-ops.
    new_rule = {"ruleId": 5, "groupingKeyNames": ["payeeId"], "aggregateFieldName": "paymentAmount",
                "aggregatorFunctionType": "AVG", "limitOperatorType": "<=", "limit": "0.25", "window": "90d",
                "cooldown": "1h", "description": INJECTION, "filter": {"paymentType": INJECTION}}  # fmt: skip
    changes = apply_rules_file(
        spark,
        lakehouse,
        write_rules(tmp_path / "v2.json", [
            *edited(r1={"limit": 1200}, r3={"ruleState": "PAUSE", "window": "5m"}, r4={"ruleState": "DELETE"}),
            new_rule,
            {**FIXTURE_RULES[0], "ruleId": 99, "ruleState": "DELETE"},
        ]),
        updated_by="bob",
    )  # fmt: skip
    assert [str(c) for c in changes] == [
        "rule 1: updated (limit 1000 -> 1200)",
        "rule 2: unchanged",
        "rule 3: updated (ruleState ACTIVE -> PAUSE, window 3m -> 5m)",
        "rule 4: deleted",
        "rule 5: added",
        "rule 99: unchanged (not in the table)",
    ]
    assert version(spark, lakehouse.rules) == v1 + 1  # one MERGE for all of it
    stored = table_rules(spark, lakehouse)
    assert sorted(stored) == [1, 2, 3, 5]
    assert stored[1]["limit"] == 1200 and stored[3]["ruleState"] == "PAUSE"
    # Hostile-looking strings are data: stored and exported verbatim, never spliced into SQL.
    assert stored[5]["description"] == INJECTION and stored[5]["filter"] == {"paymentType": INJECTION}
    assert stored[5]["limit"] == 0.25
    who = spark.read.format("delta").load(lakehouse.rules).select("ruleId", "updated_by").collect()
    assert {r.ruleId: r.updated_by for r in who} == {1: "bob", 2: "alice", 3: "bob", 5: "bob"}

    # A bad file writes nothing: every problem is reported, the table keeps its version.
    bad = write_rules(tmp_path / "bad.json", [
        {**FIXTURE_RULES[0], "limit": 7},
        {**FIXTURE_RULES[1], "aggregatorFunctionType": "FOO"},
        {**FIXTURE_RULES[2], "window": "-5m"},
        {**FIXTURE_RULES[3], "filter": {"country": "NL"}},
    ])  # fmt: skip
    with pytest.raises(RuleSetError) as caught:
        apply_rules_file(spark, lakehouse, bad)
    assert [(e.rule_id, e.field) for e in caught.value.errors] == [(2, "aggregatorFunctionType"), (3, "window"), (4, "filter")]
    # A limit the decimal(38,10) column cannot hold exactly is refused too, before any write.
    with pytest.raises(RuleSetError, match="limit") as caught:
        apply_rules_file(spark, lakehouse, write_rules(tmp_path / "tiny.json", edited(r1={"limit": "0.00000000001"})))
    assert caught.value.source.endswith("tiny.json")
    assert version(spark, lakehouse.rules) == v1 + 1
    assert table_rules(spark, lakehouse)[1]["limit"] == 1200
    # On a fresh lakehouse a bad file does not even create the table.
    fresh = Lakehouse(str(tmp_path / "fresh"))
    with pytest.raises(RuleSetError):
        apply_rules_file(spark, fresh, bad)
    assert not Path(fresh.rules).exists()


def test_export_round_trips(spark, tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "lh"))
    extra = {**FIXTURE_RULES[2], "ruleId": 7, "limit": "1234567890123456789.0123456789", "bucket": "1m",
             "cooldown": "30s", "reportNewValuesOnly": True, "description": "multi\nline ünïcode"}  # fmt: skip
    source = parse_rules([*FIXTURE_RULES, extra])
    apply_rules(spark, lakehouse, source)
    exported = export_rules(spark, lakehouse)
    assert [r["ruleId"] for r in exported] == [1, 2, 3, 4, 7]
    # Normalised reference JSON: windowMinutes becomes window, COUNT_FLINK becomes COUNT.
    assert exported[0] == {
        "ruleId": 1, "ruleState": "ACTIVE", "groupingKeyNames": ["payeeId", "beneficiaryId"],
        "aggregateFieldName": "paymentAmount", "aggregatorFunctionType": "SUM", "limitOperatorType": "GREATER",
        "limit": 1000, "window": "1h", "description": FIXTURE_RULES[0]["description"],
    }  # fmt: skip
    assert exported[1]["aggregateFieldName"] == "transactionId" and exported[1]["aggregatorFunctionType"] == "COUNT"
    assert exported[4]["limit"] == "1234567890123456789.0123456789"  # beyond a float: exact as text

    text = rules_to_json_text(reversed(exported))
    assert text == rules_to_json_text(exported) and text.startswith("[\n  {\n    \"ruleId\": 1,\n")
    assert parse_rules(text) == source  # the same rules, exactly
    before = version(spark, lakehouse.rules)
    (tmp_path / "export.json").write_text(text)
    changes = apply_rules_file(spark, lakehouse, tmp_path / "export.json")
    assert {c.action for c in changes} == {"unchanged"}
    assert version(spark, lakehouse.rules) == before
    assert rules_to_json_text([]) == "[]\n"
    assert export_rules(spark, Lakehouse(str(tmp_path / "nothing-here"))) == []


# ------------------------------------------------------------------------------ SQL edits + history


def test_sql_edits_and_rule_history(spark, applied, tmp_path):
    lakehouse = applied  # v1: the fixture rules, applied by alice
    rules = table_ref(lakehouse.rules)
    spark.sql(f"UPDATE {rules} SET limit = 1200 WHERE ruleId = 1")  # v2
    spark.sql(f"DELETE FROM {rules} WHERE ruleId = 4")  # v3
    # Hostile-looking text written as SQL string literals (backslash-escaped) is stored verbatim.
    literal = "'" + INJECTION.replace("\\", "\\\\").replace("'", "\\'") + "'"
    spark.sql(
        f"INSERT INTO {rules} (ruleId, ruleState, groupingKeyNames, aggregateFieldName, aggregatorFunctionType, "
        f"limitOperatorType, limit, window, filter, description, updated_by) VALUES (9, 'ACTIVE', array('userId'), "
        f"'ip', 'UNIQUE_COUNT', '>', 3, '10m', map('action', {literal}), {literal}, 'carol')"
    )  # v4
    # Valid SQL, invalid rules: still writable (the evaluator quarantines them, never runs them).
    spark.sql(f"UPDATE {rules} SET aggregatorFunctionType = 'FOO' WHERE ruleId = 2")  # v5
    spark.sql(f"UPDATE {rules} SET window = '-5m', filter = map('country', 'NL'), updated_by = 'dave' WHERE ruleId = 3")  # v6
    stored = table_rules(spark, lakehouse)
    assert stored[1]["limit"] == 1200 and 4 not in stored
    assert stored[2]["aggregatorFunctionType"] == "FOO"
    assert (stored[3]["window"], stored[3]["filter"]) == ("-5m", {"country": "NL"})
    assert stored[9]["description"] == INJECTION and stored[9]["filter"] == {"action": INJECTION}

    run_rule_history(spark, lakehouse)
    fixture = {r["ruleId"]: row_to_rule_json(r) for r in export_after_apply(FIXTURE_RULES)}
    rows = history(spark, lakehouse)
    assert [r[:4] for r in rows] == [
        (1, 1, "inserted", "alice"), (1, 2, "inserted", "alice"), (1, 3, "inserted", "alice"), (1, 4, "inserted", "alice"),
        (2, 1, "updated", None),  # SQL left updated_by alone: not blamed on alice
        (3, 4, "deleted", None),
        (4, 9, "inserted", "carol"),
        (5, 2, "updated", None),
        (6, 3, "updated", "dave"),
    ]  # fmt: skip
    by_key = {(r[0], r[1]): r for r in rows}
    assert by_key[1, 1][4:] == (None, fixture[1])
    assert by_key[2, 1][4:] == (fixture[1], {**fixture[1], "limit": 1200})
    assert by_key[3, 4][4:] == (fixture[4], None)
    assert by_key[4, 9][5]["description"] == INJECTION
    assert by_key[5, 2][5]["aggregatorFunctionType"] == "FOO"
    assert by_key[6, 3][5] == {**fixture[3], "window": "-5m", "filter": {"country": "NL"}}
    timestamps = [r.commit_timestamp for r in spark.read.format("delta").load(lakehouse.rule_history).collect()]
    assert all(isinstance(t, datetime) for t in timestamps)

    # A file repairs the invalid rows (stored invalid -> always rewritten) and deletes rule 9; the
    # history continues from its checkpoint and names who deleted (from the MERGE's commit tag).
    changes = apply_rules_file(
        spark, lakehouse, write_rules(tmp_path / "fix.json", [*FIXTURE_RULES[:3], {**FIXTURE_RULES[2], "ruleId": 9, "ruleState": "DELETE"}]),
        updated_by="erin",
    )  # fmt: skip
    assert [str(c) for c in changes] == [
        "rule 1: updated (limit 1200 -> 1000)",
        "rule 2: updated (aggregatorFunctionType FOO -> COUNT)",
        'rule 3: updated (window -5m -> 3m, filter {"country": "NL"} -> {"action": "login"})',
        "rule 9: deleted",
    ]
    run_rule_history(spark, lakehouse)
    rows = history(spark, lakehouse)
    assert len(rows) == 13  # nothing from the first run repeated
    assert [r[:4] for r in rows[9:]] == [(7, 1, "updated", "erin"), (7, 2, "updated", "erin"), (7, 3, "updated", "erin"), (7, 9, "deleted", "erin")]
    assert rows[-1][4]["filter"] == {"action": INJECTION} and rows[-1][5] is None
    assert [(r.commit_version, r.rule_id) for r in latest_rule_history(spark, lakehouse, 3)] == [(7, 2), (7, 3), (7, 9)]
    # The rules now match the file exactly again: applying it once more writes nothing.
    v = version(spark, lakehouse.rules)
    assert {c.action for c in apply_rules_file(spark, lakehouse, tmp_path / "fix.json")} == {"unchanged"}
    assert version(spark, lakehouse.rules) == v


def export_after_apply(rules: list[dict]) -> list[dict]:
    """What config/rules holds for ``rules`` (the table's normal form), computed without Spark."""
    from rulewatch.spark.control.rules_table import rule_row

    return [rule_row(rule) for rule in parse_rules(rules)]


def test_history_pairs_images_without_spark():
    def image(kind, version, rule_id, limit, by=None, at=None):
        return {"ruleId": rule_id, "limit": Decimal(limit), "updated_by": by, "updated_at": at,
                "_change_type": kind, "_commit_version": version, "_commit_timestamp": None}  # fmt: skip

    rows = history_rows(
        [
            image("update_postimage", 3, 1, "20", "bob", 2), image("update_preimage", 3, 1, "10", "amy", 1),
            image("update_preimage", 3, 2, "5", "amy", 1), image("update_postimage", 3, 2, "6", "amy", 1),
            # UPDATE ... SET ruleId = 8 WHERE ruleId = 7: rule 7 is gone, rule 8 appeared.
            image("update_preimage", 4, 7, "1"), image("update_postimage", 4, 8, "1"),
            image("insert", 2, 5, "1"), image("delete", 5, 5, "1", "amy", 1),
        ],
        {3: "root", 5: "sam"},
    )  # fmt: skip
    assert [(r["commit_version"], r["rule_id"], r["change"], r["updated_by"], r["before"], r["after"]) for r in rows] == [
        (2, 5, "inserted", None, None, '{"ruleId": 5, "limit": 1}'),
        (3, 1, "updated", "bob", '{"ruleId": 1, "limit": 10}', '{"ruleId": 1, "limit": 20}'),
        (3, 2, "updated", "root", '{"ruleId": 2, "limit": 5}', '{"ruleId": 2, "limit": 6}'),
        (4, 7, "deleted", None, '{"ruleId": 7, "limit": 1}', None),
        (4, 8, "inserted", None, None, '{"ruleId": 8, "limit": 1}'),
        (5, 5, "deleted", "sam", '{"ruleId": 5, "limit": 1}', None),
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------ CLI


def rules_cli(*argv: str) -> int:
    from rulewatch.cli.rules_cli import add_cli

    parser = argparse.ArgumentParser(prog="rulewatch")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_the_rules_table_exists_only_as_a_delta_table(spark, applied, tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "parquet"))
    assert not rules_table_exists(spark, lakehouse)  # nothing at its path
    spark.range(3).write.parquet(lakehouse.rules)  # plain Parquet where the table belongs
    assert not rules_table_exists(spark, lakehouse)
    assert rules_table_exists(spark, applied)


def test_rules_cli(spark, tmp_path, capsys):
    lh = str(tmp_path / "lh")
    assert rules_cli("rules", "export", "--lakehouse", lh) == 1
    assert "no rules table" in capsys.readouterr().err

    assert rules_cli("rules", "apply", str(FIXTURES / "rules.json"), "--lakehouse", lh, "--updated-by", "alice") == 0
    captured = capsys.readouterr()
    # Progress while Spark starts goes to stderr: stdout is the changes alone.
    assert captured.err == f"rulewatch rules: starting Spark ...\nrulewatch rules: merging 4 rule(s) into {Lakehouse(lh).rules} ...\n"
    out = captured.out.splitlines()
    assert out[:4] == [f"rule {i}: added" for i in (1, 2, 3, 4)] and out[4].startswith("rules: 4 added; written to")

    edited_file = write_rules(tmp_path / "edit.json", edited(r1={"limit": 1200}, r4={"ruleState": "DELETE"}))
    assert rules_cli("rules", "apply", edited_file, "--lakehouse", lh) == 0
    assert capsys.readouterr().out.splitlines() == [
        "rule 1: updated (limit 1000 -> 1200)",
        "rule 2: unchanged",
        "rule 3: unchanged",
        "rule 4: deleted",
        f"rules: 1 updated, 1 deleted, 2 unchanged; written to {Lakehouse(lh).rules}",
    ]

    bad = write_rules(tmp_path / "bad.json", edited(r2={"aggregatorFunctionType": "FOO"}, r3={"limit": 1}))
    v = version(spark, Lakehouse(lh).rules)
    assert rules_cli("rules", "apply", bad, "--lakehouse", lh) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "bad.json" in captured.err and "rule 2: field 'aggregatorFunctionType' has 'FOO'" in captured.err
    assert "nothing was written" in captured.err
    assert version(spark, Lakehouse(lh).rules) == v

    assert rules_cli("rules", "export", "--lakehouse", lh) == 0
    captured = capsys.readouterr()
    exported = json.loads(captured.out)  # the rules file alone, progress beside it on stderr
    assert captured.err == f"rulewatch rules: starting Spark ...\nrulewatch rules: reading {Lakehouse(lh).rules} ...\n"
    assert [(r["ruleId"], r["limit"]) for r in exported] == [(1, 1200), (2, 5), (3, 4)]
    out_file = tmp_path / "out" / "rules.json"
    out_file.parent.mkdir()
    assert rules_cli("rules", "export", "--lakehouse", lh, "--out", str(out_file)) == 0
    assert json.loads(out_file.read_text()) == exported and "3 rule(s) written" in capsys.readouterr().err

    assert rules_cli("rules", "history", "--lakehouse", lh) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines()[-1] == f"rulewatch rules: updating {Lakehouse(lh).rule_history} from the change feed ..."
    lines = captured.out.splitlines()
    assert lines[0].startswith("rules history: last 6 change(s)")
    assert lines[5].split()[0] == "v2" and "rule 1" in lines[5] and "limit 1000 -> 1200" in lines[5]
    assert "rule 4" in lines[6] and "deleted" in lines[6]
    assert rules_cli("rules", "history", "--lakehouse", lh, "--last", "1") == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


# ------------------------------------------------------------------------------- ingest integrity


def test_a_rule_id_beyond_the_int_column_is_refused_before_any_write(spark, tmp_path, capsys):
    lh = Lakehouse(str(tmp_path / "lh"))
    largest = write_rules(tmp_path / "largest.json", [{**FIXTURE_RULES[0], "ruleId": 2**31 - 1}])
    assert rules_cli("rules", "apply", largest, "--lakehouse", lh.root) == 0
    v = version(spark, lh.rules)
    capsys.readouterr()
    for bad_id in (2**31, -(2**31) - 1, 10**20):
        bad = write_rules(tmp_path / "bad.json", [FIXTURE_RULES[1], {**FIXTURE_RULES[0], "ruleId": bad_id}])
        assert rules_cli("rules", "apply", bad, "--lakehouse", lh.root) == 2
        err = capsys.readouterr().err
        assert f"item 2: field 'ruleId' has {bad_id}; allowed: a positive integer between 1 and 2147483647" in err
        assert "nothing was written" in err
        with pytest.raises(RuleSetError, match="between 1 and 2147483647"):
            apply_rules_file(spark, lh, bad)
    assert version(spark, lh.rules) == v
    assert list(table_rules(spark, lh)) == [2**31 - 1]


def _concurrent_apply(spark, lh: Lakehouse, tmp_path: Path) -> None:
    apply_rules_file(spark, lh, write_rules(tmp_path / "other.json", edited(r1={"limit": 1500})), updated_by="other")


# What another writer commits between this apply's read of config/rules and its MERGE. The apply
# under test updates rule 1, leaves 2 and 3 as they are, deletes 4 and adds 5: each edit below
# touches one of those, and a MERGE on top of it would silently undo it or leave it in place.
CONCURRENT_EDITS = {
    "another apply of rule 1": _concurrent_apply,
    "SQL update of a rule left unchanged": lambda spark, lh, _: spark.sql(f"UPDATE {table_ref(lh.rules)} SET description = 'x' WHERE ruleId = 2"),
    "SQL insert of the rule being added": lambda spark, lh, _: spark.sql(f"INSERT INTO {table_ref(lh.rules)} (ruleId, ruleState) VALUES (5, 'PAUSE')"),
    "SQL delete of the rule being updated": lambda spark, lh, _: spark.sql(f"DELETE FROM {table_ref(lh.rules)} WHERE ruleId = 1"),
}
MINE = [*edited(r1={"limit": 1200}, r4={"ruleState": "DELETE"}), {**FIXTURE_RULES[0], "ruleId": 5}]


@pytest.mark.parametrize("edit", CONCURRENT_EDITS.values(), ids=CONCURRENT_EDITS.keys())
def test_a_change_between_the_read_and_the_merge_fails_the_apply_whole(spark, applied, tmp_path, monkeypatch, capsys, edit):
    from rulewatch.spark.control import rules_table
    from rulewatch.cli.main import main

    lh = applied
    read = rules_table._current_rules
    after_edit = {}

    def read_then_another_writer_commits(spark, lakehouse):
        seen = read(spark, lakehouse)
        monkeypatch.setattr(rules_table, "_current_rules", read)  # the other writer reads as usual
        edit(spark, lh, tmp_path)
        after_edit.update(version=version(spark, lh.rules), rules=table_rules(spark, lh))
        return seen

    monkeypatch.setattr(rules_table, "_current_rules", read_then_another_writer_commits)
    assert main(["rules", "apply", write_rules(tmp_path / "mine.json", MINE), "--lakehouse", lh.root]) == 2
    # Progress lines come first on stderr; the error is the last line.
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"rulewatch: config/rules ({lh.rules}) was changed by another writer while this apply ran; "
        "nothing of this apply was written; run it again"
    )
    assert after_edit and version(spark, lh.rules) == after_edit["version"]
    assert table_rules(spark, lh) == after_edit["rules"]
    # Run again, it applies on top of the other writer's change.
    assert main(["rules", "apply", str(tmp_path / "mine.json"), "--lakehouse", lh.root]) == 0
    assert parse_rules(list(table_rules(spark, lh).values())) == [r for r in parse_rules(MINE) if r.rule_id != 4]


def test_a_commit_while_the_merge_runs_loses_delta_s_conflict_check(spark, applied, tmp_path, monkeypatch):
    """The MERGE is held inside its transaction (a gate in its source) while another writer commits."""
    import os
    import threading
    import time

    from delta import exceptions as delta_errors
    from pyspark.sql import functions as F
    from pyspark.sql.types import BooleanType

    from rulewatch.spark.control import rules_table
    from rulewatch.spark.control.rules_table import RulesConflict

    lh = applied
    entered, release = str(tmp_path / "entered"), str(tmp_path / "release")

    def gate(_: int) -> bool:  # runs in a Python worker: only the first row waits
        try:
            os.close(os.open(entered, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return True
        deadline = time.monotonic() + 600
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)
        return True

    source = rules_table._merge_source
    gated = F.udf(lambda rule_id: gate(rule_id), BooleanType())  # a lambda: no type hints for Spark to read a pandas UDF into
    monkeypatch.setattr(rules_table, "_merge_source", lambda *args: source(*args).where(gated("ruleId")))
    outcome: list[BaseException] = []

    def apply_mine() -> None:
        try:
            apply_rules_file(spark, lh, write_rules(tmp_path / "mine.json", MINE))
        except BaseException as err:  # handed to the test thread
            outcome.append(err)

    worker = threading.Thread(target=apply_mine)
    worker.start()
    deadline = time.monotonic() + 600
    while not os.path.exists(entered) and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(entered), outcome
    spark.sql(f"UPDATE {table_ref(lh.rules)} SET description = 'x' WHERE ruleId = 2")
    after_edit = (version(spark, lh.rules), table_rules(spark, lh))
    Path(release).touch()
    worker.join(600)

    assert len(outcome) == 1 and isinstance(outcome[0], RulesConflict), outcome
    conflicts = (delta_errors.ConcurrentAppendException, delta_errors.ConcurrentDeleteReadException)
    assert isinstance(outcome[0].__cause__, conflicts), repr(outcome[0].__cause__)
    assert (version(spark, lh.rules), table_rules(spark, lh)) == after_edit


def test_two_applies_at_once_leave_one_file_whole(spark, applied, tmp_path):
    import threading

    from rulewatch.spark.control.rules_table import RulesConflict

    lh = applied
    files = {
        name: write_rules(tmp_path / f"{name}.json", edited(**{f"r{i}": {"description": name} for i in (1, 2, 3, 4)}))
        for name in ("a", "b")
    }
    start = threading.Barrier(len(files))
    outcome: dict[str, str] = {}

    def apply(name: str) -> None:
        start.wait()
        try:
            apply_rules_file(spark, lh, files[name])
            outcome[name] = "applied"
        except RulesConflict:
            outcome[name] = "conflict"
        except BaseException as err:  # handed to the test thread
            outcome[name] = repr(err)

    threads = [threading.Thread(target=apply, args=(name,)) for name in files]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)

    assert set(outcome.values()) <= {"applied", "conflict"} and "applied" in outcome.values(), outcome
    descriptions = {rule["description"] for rule in table_rules(spark, lh).values()}
    applied = [name for name, result in outcome.items() if result == "applied"]
    assert descriptions == set(applied) if len(applied) == 1 else len(descriptions) == 1
