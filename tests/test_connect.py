"""The whole job under Spark Connect (the API surface of Databricks serverless and databricks-connect)."""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT, why_it_failed
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.storage.metrics import PENDING
from rulewatch.spark.runtime.session import LOCAL_CONNECT_PORT
from processes import metrics_commits

pytestmark = [pytest.mark.jvm, pytest.mark.subprocess]


# One process, one local Connect server: a `rulewatch run` over the fixtures, then the live demo on another
# lakehouse (as a notebook calls one command after another). Each prints a marker first, on both streams.
_RUN_THEN_DEMO = (
    "import json, sys\n"
    "from rulewatch.cli.main import main\n"
    "codes = []\n"
    "for name, argv in json.loads(sys.argv[1]).items():\n"
    "    print(f'@@{name}@@', flush=True); print(f'@@{name}@@', file=sys.stderr, flush=True)\n"
    "    codes.append(main(argv))\n"
    "print('@@codes@@', *codes, flush=True)\n"
)


@dataclass
class Connected:
    run: tuple[str, str]  # the run's stdout and stderr
    demo: tuple[str, str]
    codes: list[int]
    stderr: str  # the whole process's
    lakehouse: Lakehouse  # the run's


@pytest.fixture(scope="module")
def connected(tmp_path_factory) -> Connected:
    root = tmp_path_factory.mktemp("connect")
    run = ["run", "--lakehouse", str(root / "run"), "--landing", str(FIXTURES / "transactions"), "--rules", str(FIXTURES / "rules.json")]
    demo = ["demo", "--lakehouse", str(root / "demo"), "--minutes", "0.17", "--rate", "40", "--pattern-every", "1"]
    env = {**os.environ, "RULEWATCH_REMOTE": "local[2]"}
    result = subprocess.run([sys.executable, "-c", _RUN_THEN_DEMO, json.dumps({"run": run, "demo": demo})], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert result.returncode == 0 and "@@codes@@" in result.stdout, why_it_failed(result.stderr)
    out, err = (stream.split("@@demo@@") for stream in (result.stdout, result.stderr))
    codes = [int(code) for code in out[1].split("@@codes@@")[1].splitlines()[0].split()]
    return Connected((out[0], err[0]), (out[1], err[1]), codes, result.stderr, Lakehouse(str(root / "run")))


@pytest.mark.slow
def test_run_under_spark_connect_gives_the_fixture_alerts(spark, connected, expected_alerts):
    out, err = connected.run
    assert connected.codes[0] == 0, why_it_failed(err)
    assert "bronze = silver + quarantined + duplicates: ok" in out and f"alerts           {len(expected_alerts)}" in out
    per_rule = Counter(a["rule_id"] for a in expected_alerts)
    for rule_id, count in per_rule.items():
        assert f"rule {rule_id}: {count} alert(s)" in out
    assert "Failed to set spark" not in connected.stderr
    # The layers' metrics rows, kept in files by the server's copies of the recorders, reached the
    # table in the run's one commit, and no file is left.
    lakehouse = connected.lakehouse
    layers = Counter(r.layer for r in spark.read.format("delta").load(lakehouse.pipeline_metrics).collect())
    assert layers == {"bronze": 1, "silver": 1, "gold": 1}
    assert not list(Path(lakehouse.root).glob(f"_checkpoints/*/{PENDING}/*.json"))
    assert metrics_commits(lakehouse) == [{"rulewatch.metrics.bronze", "rulewatch.metrics.silver", "rulewatch.metrics.gold"}]


@pytest.mark.slow
def test_live_demo_under_spark_connect_catches_every_pattern(connected):
    # Live mode's monitor reads the queries' progress reports (under Connect their numInputRows
    # item is None) and gold's alerts from the tables (foreachBatch runs in the server's Python);
    # the demo's rule edit reads the rules table, which under Connect must not need Delta Connect.
    # (Under Connect, a lakehouse without a rules table: test_another_thread_..., on its server.)
    out, err = connected.demo
    assert connected.codes[1] == 0, why_it_failed(err)
    assert "streams caught up" in out and "false positives: 0 alert(s)" in out, out[-3000:]
    scores = re.findall(r"rule \d+: injected (\d+), caught (\d+), missed (\d+)", out)
    assert len(scores) == 4 and all(int(injected) > 0 and caught == injected and missed == "0" for injected, caught, missed in scores), out[-3000:]
    assert re.search(r"rule change -> evaluator: rule \d+ edited .* applied by gold batch \d+", out), out[-3000:]


@pytest.mark.parametrize("family, address", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")], ids=["ipv4", "ipv6"])
def test_a_taken_connect_port_is_named_with_the_fix(tmp_path, family, address):
    # Held by "another program" (this test) the way a stray server would hold it; if something
    # already holds it, the run meets the same busy port. (`localhost` may dial either family.)
    try:
        holder = socket.socket(family)
    except OSError as err:
        pytest.skip(f"this host has no {family.name}: {err}")
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        holder.bind((address, LOCAL_CONNECT_PORT))
        holder.listen()
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            holder.close()
            pytest.skip(f"cannot listen on {address} here: {err}")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "rulewatch.cli.main", "run", "--lakehouse", str(tmp_path / "lakehouse"),
             "--landing", str(FIXTURES / "transactions"), "--rules", str(FIXTURES / "rules.json")],
            cwd=ROOT, env={**os.environ, "RULEWATCH_REMOTE": "local[2]"}, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        holder.close()
    assert result.returncode == 2, why_it_failed(result.stderr)
    assert f"port {LOCAL_CONNECT_PORT}" in result.stderr and "RULEWATCH_REMOTE=sc://localhost" in result.stderr
    assert "Traceback" not in result.stderr and "BindException" not in result.stderr


def test_another_thread_of_the_process_gets_its_local_connect_session(tmp_path):
    # A Connect session is active per thread: another thread (a notebook's helper, a sink's pool)
    # finds none and builds again, and must reach the server this process holds port 15002 with.
    # On the same server: `rules export` of a lakehouse without a rules table says so (exit 1); the
    # demo's rule edit reads that table, which under Connect must not need Delta Connect.
    script = (
        "import sys, threading\n"
        "from rulewatch.cli.main import main\n"
        "from rulewatch.spark.runtime.session import get_spark\n"
        "assert get_spark().range(3).count() == 3\n"
        "seen = []\n"
        "thread = threading.Thread(target=lambda: seen.append(get_spark().range(2).count()))\n"
        "thread.start(); thread.join()\n"
        "assert seen == [2], seen\n"
        "sys.exit(main(['rules', 'export', '--lakehouse', sys.argv[1]]))\n"
    )
    env = {**os.environ, "RULEWATCH_REMOTE": "local[2]"}
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "lakehouse")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 1 and "no rules table" in result.stderr, why_it_failed(result.stderr)
