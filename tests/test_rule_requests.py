"""``rules apply`` while a live stream holds the lakehouse: the stream applies the rules on its own Spark
session, and the command starts none (spark/control/rule_requests.py)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import rulewatch.spark.runtime.session
from conftest import FIXTURES
from rulewatch.cli.main import main
from rulewatch.engine.rules import parse_rule
from rulewatch.spark.control import rule_requests
from rulewatch.spark.storage.lakehouse import Lakehouse, lock_holder

RULE = {"ruleId": 7, "groupingKeyNames": ["payeeId"], "aggregateFieldName": "paymentAmount",
        "aggregatorFunctionType": "SUM", "limitOperatorType": "GREATER", "limit": 100, "window": "1h"}  # fmt: skip


def test_a_request_nobody_claims_is_withdrawn(tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    started = time.monotonic()
    assert rule_requests.ask(lakehouse, [parse_rule(RULE)], "ann", claim_timeout=0.3) is None
    assert time.monotonic() - started < 5
    assert list(Path(lakehouse.root, rule_requests.FOLDER).iterdir()) == []  # nothing left for a later stream to apply


def test_a_request_whose_sender_has_gone_is_dropped_unapplied(tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    folder = Path(lakehouse.root, rule_requests.FOLDER)
    folder.mkdir(parents=True)
    (folder / "a.json").write_text(json.dumps({"rules": [RULE], "updated_by": "ann", "pid": int(gone), "host": socket.gethostname()}))
    # No Spark session: a dropped request reaches no MERGE.
    assert rule_requests.serve(None, lakehouse) == [f"rules: dropped a request of `rules apply` (pid {gone}), which has gone: nothing applied"]
    assert list(folder.iterdir()) == []


def test_a_file_that_is_no_request_is_set_aside_and_the_stream_goes_on(tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    folder = Path(lakehouse.root, rule_requests.FOLDER)
    folder.mkdir(parents=True)
    (folder / "rules.json").write_text(json.dumps([RULE]))  # a rules file dropped here by hand
    [said] = rule_requests.serve(None, lakehouse)
    assert said.startswith(f"rules: rules.json in {folder} is no rules request (AttributeError") and said.endswith("set aside as .bad")
    assert [p.name for p in folder.iterdir()] == ["rules.bad"]
    assert rule_requests.serve(None, lakehouse) == []  # not taken again


@pytest.mark.slow
def test_rules_applied_while_a_stream_runs_are_applied_by_the_stream(spark, tmp_path, capsys, monkeypatch, stream_ends_when):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    landing = tmp_path / "landing"
    shutil.copytree(FIXTURES / "transactions", landing)
    stream_args = ["stream", "--lakehouse", lakehouse.root, "--landing", str(landing), "--rules", str(FIXTURES / "rules.json"),
                   "--duration", "120", "--trigger", "1 second"]  # fmt: skip
    stream_ends_when(lambda lines: any("gold now evaluates config/rules version 2" in line for line in lines))
    exits: list[int] = []
    runner = threading.Thread(target=lambda: exits.append(main(stream_args)), daemon=True)
    runner.start()
    deadline = time.monotonic() + 120
    while not Path(lakehouse.checkpoint("gold"), "commits", "0").exists():  # the stream is past its start
        assert time.monotonic() < deadline and runner.is_alive(), "the stream did not start"
        time.sleep(0.5)
    assert rule_requests.serves_requests(lock_holder(lakehouse))
    changed = tmp_path / "rules.json"
    changed.write_text(json.dumps([{**RULE, "description": "added while the stream runs"}]))
    # From here on nothing in this process may start Spark: the stream already has it.
    with monkeypatch.context() as patched:
        patched.setattr(rulewatch.spark.runtime.session, "get_spark", lambda *_: pytest.fail("rules apply started Spark"))
        code = main(["rules", "apply", str(changed), "--lakehouse", lakehouse.root, "--updated-by", "ann"])
    runner.join(timeout=180)
    assert code == 0 and exits == [0]
    out, err = capsys.readouterr()
    assert "rule 7: added" in out and "written to" in out and "by the stream holding the lakehouse (pid" in out
    assert "rulewatch rules: handing 1 rule(s) to pid" in err and "its gold stream applies this change from its next micro-batch" in err
    assert "rules: applied for `rules apply` by ann: rule 7: added" in out  # the stream's own log
    stored = spark.read.format("delta").load(lakehouse.rules).where("ruleId = 7").collect()
    assert [(r.description, r.updated_by) for r in stored] == [("added while the stream runs", "ann")]
    assert "gold now evaluates config/rules version 2 (4 active)" in out  # the stream said it took the change
