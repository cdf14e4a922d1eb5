"""rulewatch on a Spark standalone cluster: a master and two workers, each a JVM of its own with its own
executor and Python workers, started from the installed pyspark's own classes on loopback (as
docs/scale.md does by hand). The job and the live path there must raise the local run's alerts, id for
id, with tasks run on both workers; ``--master`` is refused before any JVM starts when it is no master
URL or nothing answers there.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pyspark
import pytest

from conftest import FIXTURES
from rulewatch.cli.main import main
from rulewatch.spark.runtime.env import MASTER_ENV
from rulewatch.spark.storage.lakehouse import Lakehouse
from test_crash import RULES, run_cli

SPARK_HOME = Path(pyspark.__file__).parent


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ------------------------------------------------------------------ --master, refused before Spark starts


@pytest.fixture
def master_env(monkeypatch):
    """main() hands --master to the session through the environment: put it back after the test."""
    monkeypatch.setenv(MASTER_ENV, "local[2]")
    monkeypatch.delenv("RULEWATCH_REMOTE", raising=False)


@pytest.mark.parametrize("url", ["spark://nohost", "local[two]", "http://127.0.0.1:7077"])
def test_a_master_that_is_no_url_is_refused_by_the_parser(master_env, tmp_path, capsys, url):
    with pytest.raises(SystemExit) as exit:
        main(["rules", "export", "--lakehouse", str(tmp_path), "--master", url])
    assert exit.value.code == 2
    assert f"--master: {url!r} is no Spark master URL: give local[N]" in capsys.readouterr().err


def test_a_master_nobody_answers_at_is_named_before_a_jvm_starts(master_env, tmp_path, capsys):
    url = f"spark://127.0.0.1:{_free_port()}"
    assert main(["rules", "export", "--lakehouse", str(tmp_path), "--master", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rulewatch: no Spark master answers at {url} (127.0.0.1:") and "start the cluster (docs/scale.md)" in err
    assert err.count("\n") == 1  # one line, no trace, before anything starts


def test_a_master_beside_a_spark_connect_server_is_refused(master_env, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RULEWATCH_REMOTE", "sc://localhost:15002")
    assert main(["rules", "export", "--lakehouse", str(tmp_path), "--master", "local[1]"]) == 2
    assert "RULEWATCH_REMOTE=sc://localhost:15002 sends the work to a Spark Connect server: unset one of them" in capsys.readouterr().err


# ------------------------------------------------------------------------------- a standalone cluster


@dataclass
class Cluster:
    url: str
    workers: list[Path]  # each worker's work folder: its executors' logs, by application


def _start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([str(SPARK_HOME / "bin" / "spark-class"), *args], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)  # fmt: skip


def _wait_for(log: Path, pattern: str, count: int = 1, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if len(re.findall(pattern, log.read_text(errors="replace"))) >= count:
            return
        time.sleep(0.5)
    raise AssertionError(f"{log.name}: {pattern!r} not seen {count}x within {seconds:.0f}s:\n{log.read_text(errors='replace')[-3000:]}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    # Everything on loopback; the daemons' JVMs get no more memory than a worker needs here.
    env = os.environ | {"SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_DAEMON_MEMORY": "512m"}
    port = _free_port()
    url = f"spark://127.0.0.1:{port}"
    processes = [_start(["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
                         "--webui-port", str(_free_port())], root / "master.log", env)]  # fmt: skip
    workers = [root / f"worker-{i}" for i in (1, 2)]
    try:
        _wait_for(root / "master.log", r"Starting Spark master at")
        for i, work in enumerate(workers, 1):
            processes.append(_start(["org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1", "--cores", "1",
                                     "--memory", "3g", "--work-dir", str(work), "--webui-port", "0"],
                                    root / f"worker-{i}.log", env))  # fmt: skip
        _wait_for(root / "master.log", r"Registering worker", count=2)
        yield Cluster(url, workers)
    finally:
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


def _alert_ids(spark, lakehouse: Lakehouse) -> list[str]:
    return sorted(r.alert_id for r in spark.read.format("delta").load(lakehouse.alerts).select("alert_id").collect())


def _ran_tasks_on_both_workers(cluster: Cluster, before: set[Path]) -> None:
    """Each worker's executor of the application started since ``before`` finished tasks."""
    for work in cluster.workers:
        logs = [log for app in work.glob("app-*") if app not in before for log in app.glob("*/stderr")]
        assert any("Finished task" in log.read_text(errors="replace") for log in logs), f"no task ran on {work.name}"


def _applications(cluster: Cluster) -> set[Path]:
    return {app for work in cluster.workers for app in work.glob("app-*")}


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_job_on_a_standalone_cluster_raises_the_local_runs_alerts(spark, cluster, fixture_run, tmp_path):
    lakehouse, before = Lakehouse(str(tmp_path / "lakehouse")), _applications(cluster)
    landing = FIXTURES / "transactions"
    assert run_cli(["run", "--master", cluster.url, "--lakehouse", lakehouse.root, "--landing", str(landing), "--rules", RULES]) == 0
    assert _alert_ids(spark, lakehouse) == _alert_ids(spark, fixture_run.lakehouse) != []
    _ran_tasks_on_both_workers(cluster, before)


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_live_path_on_a_standalone_cluster_raises_the_local_runs_alerts(spark, cluster, fixture_run, tmp_path):
    lakehouse, before = Lakehouse(str(tmp_path / "lakehouse")), _applications(cluster)
    landing = tmp_path / "landing"
    shutil.copytree(FIXTURES / "transactions", landing)
    arguments = ["stream", "--master", cluster.url, "--lakehouse", lakehouse.root, "--landing", str(landing), "--rules", RULES]
    assert run_cli([*arguments, "--drain", "--duration", "300"]) == 0
    assert _alert_ids(spark, lakehouse) == _alert_ids(spark, fixture_run.lakehouse) != []
    _ran_tasks_on_both_workers(cluster, before)
