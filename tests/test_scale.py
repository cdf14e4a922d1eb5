"""rulewatch on a Spark standalone cluster: a master and two workers, each a JVM of its own with its own
executor and Python workers, started from the installed pyspark's own classes on loopback (as
docs/scale.md does by hand). The job and the live path there must raise the local run's alerts, id for
id, with tasks run on both workers; ``--master`` is refused before any JVM starts when it is no master
URL or nothing answers there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyspark
import pytest

from conftest import FIXTURES, why_it_failed
from rulewatch.cli.main import main
from rulewatch.spark.runtime.env import MASTER_ENV
from rulewatch.spark.storage.lakehouse import Lakehouse
from processes import RULES, finished_tasks, run_grouped

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


def _applications(cluster: Cluster) -> set[Path]:
    return {app for work in cluster.workers for app in work.glob("app-*")}


# One driver, as a notebook calls one command after another: the job over the fixtures, then the live path
# over a copy of them into another lakehouse; between them, the tasks each worker finished so far.
_JOB_THEN_STREAM = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from processes import finished_tasks
from rulewatch.cli.main import main

given = json.loads(sys.argv[1])
codes = [main(given["job"])]
counts = finished_tasks([Path(w) for w in given["workers"]], {Path(a) for a in given["before"]})
print("@@after-job@@", json.dumps(counts), flush=True)
codes.append(main(given["stream"]))
print("@@codes@@", json.dumps(codes), flush=True)
"""


@dataclass
class OnCluster:
    job: Lakehouse
    live: Lakehouse
    codes: list[int]
    after_job: dict[str, int]  # tasks finished per worker when the job had ended
    after_both: dict[str, int]


@pytest.fixture(scope="module")
def on_cluster(cluster, tmp_path_factory) -> OnCluster:
    root = tmp_path_factory.mktemp("on-cluster")
    job, live, before = Lakehouse(str(root / "job")), Lakehouse(str(root / "live")), _applications(cluster)
    shutil.copytree(FIXTURES / "transactions", root / "landing")
    given = {
        "workers": [str(w) for w in cluster.workers], "before": [str(a) for a in before],
        "job": ["run", "--master", cluster.url, "--lakehouse", job.root, "--landing", str(FIXTURES / "transactions"), "--rules", RULES],
        "stream": ["stream", "--master", cluster.url, "--lakehouse", live.root, "--landing", str(root / "landing"), "--rules", RULES,
                   "--drain", "--duration", "300"],
    }  # fmt: skip
    # In a process group of its own, which is killed whole at the end: the driver's JVM goes with it.
    code, out, err = run_grouped([sys.executable, "-c", _JOB_THEN_STREAM, json.dumps(given), str(Path(__file__).parent)], 1200)
    assert code == 0 and "@@codes@@" in out, why_it_failed(err)
    after_job = json.loads(out.split("@@after-job@@")[1].splitlines()[0])
    codes = json.loads(out.split("@@codes@@")[1].splitlines()[0])
    return OnCluster(job, live, codes, after_job, finished_tasks(cluster.workers, before))


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_job_on_a_standalone_cluster_raises_the_local_runs_alerts(spark, on_cluster, fixture_run):
    assert on_cluster.codes[0] == 0
    assert _alert_ids(spark, on_cluster.job) == _alert_ids(spark, fixture_run.lakehouse) != []
    assert all(on_cluster.after_job.values()), f"a worker ran none of the job's tasks: {on_cluster.after_job}"


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_live_path_on_a_standalone_cluster_raises_the_local_runs_alerts(spark, on_cluster, fixture_run):
    assert on_cluster.codes[1] == 0
    assert _alert_ids(spark, on_cluster.live) == _alert_ids(spark, fixture_run.lakehouse) != []
    ran = {work: on_cluster.after_both[work] - on_cluster.after_job[work] for work in on_cluster.after_job}
    assert all(count > 0 for count in ran.values()), f"a worker ran none of the live path's tasks: {ran}"
