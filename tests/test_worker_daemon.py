"""Local sessions' Python workers start from rulewatch's daemon (spark/runtime/worker_daemon.py), and every
Python process Spark starts from its site folder (spark/runtime/worker_path.py): the installed pyspark
instead of Spark's zip of it, with the workers' imports done before the fork."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

from rulewatch.spark.runtime import worker_daemon, worker_path


def _package(root: Path, name: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("")


def test_only_archives_of_the_installed_packages_leave_the_path(tmp_path):
    site = tmp_path / "site"
    _package(site, "pyspark")
    home = site / "pyspark"
    other = tmp_path / "other-spark"
    for spark_home in (home, other):
        (spark_home / "python" / "lib").mkdir(parents=True)
        (spark_home / "jars").mkdir()
        for name in ("python/lib/pyspark.zip", "python/lib/py4j-0.10.9.9-src.zip", "python/lib/extra.zip", "jars/spark-core.jar"):
            (spark_home / name).write_bytes(b"")
    ours = [str(home / n) for n in ("python/lib/pyspark.zip", "python/lib/py4j-0.10.9.9-src.zip", "jars/spark-core.jar")]
    theirs = [str(other / n) for n in ("python/lib/pyspark.zip", "jars/spark-core.jar")]
    path = [*ours, str(home / "python/lib/extra.zip"), *theirs, str(site)]

    # py4j is not installed beside pyspark here, so its zip is the only copy and stays
    assert worker_path.spark_archives(path) == [ours[0], ours[2]]
    _package(site, "py4j")
    assert worker_path.spark_archives(path) == ours
    # no pyspark outside the archives: nothing to fall back on, every archive stays
    assert worker_path.spark_archives(path[:-1]) == []


@pytest.mark.parametrize(
    ("remote", "switch", "expected"),
    [
        (None, None, True),
        ("local[2]", None, True),
        ("sc://workspace:443", None, False),  # a server elsewhere runs its own workers
        (None, "off", False),
        (None, "No", False),
    ],
)
def test_which_sessions_start_workers_from_it(monkeypatch, remote, switch, expected):
    if switch:
        monkeypatch.setenv("RULEWATCH_WORKER_DAEMON", switch)
    else:
        monkeypatch.delenv("RULEWATCH_WORKER_DAEMON", raising=False)
    assert worker_daemon.applies(remote) is expected
    assert worker_daemon.confs(expected) == ({"spark.python.daemon.module": "rulewatch.spark.runtime.worker_daemon"} if expected else {})


@pytest.mark.parametrize("previous", [None, "", "/somewhere/else"])
@pytest.mark.parametrize("applied", [True, False])
def test_the_jvm_inherits_the_site_folder_and_this_process_gets_its_path_back(monkeypatch, previous, applied):
    if previous is None:
        monkeypatch.delenv("PYTHONPATH", raising=False)
    else:
        monkeypatch.setenv("PYTHONPATH", previous)
    with worker_path.jvm_python_path(applied):
        seen = os.environ.get("PYTHONPATH")
    assert os.environ.get("PYTHONPATH") == previous
    if not applied:
        assert seen == previous
    else:
        assert seen.split(os.pathsep) == [str(worker_path.SITE), *([previous] if previous else [])]


def test_a_worker_python_that_cannot_import_it_keeps_sparks_daemon(monkeypatch, tmp_path):
    # a Python without rulewatch: the module found here only through this process's path
    bare = tmp_path / "python"
    bare.write_text(f"#!/bin/sh\nPYTHONPATH= exec {sys.base_prefix}/bin/python3 -I \"$@\"\n")
    bare.chmod(0o755)
    monkeypatch.setenv("PYSPARK_PYTHON", str(bare))
    assert not worker_daemon.workers_can_import()
    assert not worker_daemon.applies(None)


def test_forked_children_draw_their_own_random_numbers():
    import numpy as np

    worker_daemon.prepare_forks()
    try:
        np.random.seed(1)
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            os.write(write, str(np.random.randint(2**62)).encode())
            os._exit(0)
        os.waitpid(child, 0)
        assert int(os.read(read, 64)) != np.random.randint(2**62)
    finally:
        gc.unfreeze()


def test_workers_run_the_installed_pyspark_with_their_imports_frozen(spark):
    if spark.conf.get("spark.python.daemon.module", None) != worker_daemon.MODULE:
        pytest.skip("this session's workers start from Spark's own daemon (RULEWATCH_WORKER_DAEMON=off)")

    def worker_view(batches):  # nested: pickled by value, as workers cannot import this test module
        import gc

        import pandas as pd

        for _ in batches:
            yield pd.DataFrame({
                "pyspark_from": [sys.modules["pyspark"].__file__],
                "archives_read": [sum(type(i).__name__ == "zipimporter" and "pyspark" in k for k, i in sys.path_importer_cache.items())],
                "frozen": [gc.get_freeze_count() > 0],
            })  # fmt: skip

    rows = spark.range(4, numPartitions=2).mapInPandas(worker_view, "pyspark_from string, archives_read int, frozen boolean").collect()
    installed = Path(sys.modules["pyspark"].__file__).resolve()
    assert {Path(r.pyspark_from).resolve() for r in rows} == {installed}
    assert {(r.archives_read, r.frozen) for r in rows} == {(0, True)}


def _spark_archives_first() -> list[str]:
    """The entries Spark puts first on the path of every Python process it starts: its zips of pyspark
    and py4j, and its spark-core jar."""
    import pyspark  # the Python package only (no JVM); not imported yet when this test runs first

    home = Path(pyspark.__file__).resolve().parent
    return [str(p) for p in (*sorted((home / "python" / "lib").glob("*.zip")), *sorted((home / "jars").glob("spark-core_*.jar")))]


@pytest.mark.parametrize("with_site", [True, False])
def test_a_process_started_with_the_site_folder_imports_the_installed_pyspark_and_still_runs_other_sitecustomizes(tmp_path, with_site):
    import subprocess

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIR_SITECUSTOMIZE'] = 'ran'\n")
    path = [*_spark_archives_first(), *([str(worker_path.SITE)] if with_site else []), str(theirs)]
    shown = subprocess.run(
        [sys.executable, "-c", "import os, sys; loaded = ','.join(sorted(m for m in sys.modules if m.startswith('rulewatch'))) or '-'; "
         "import pyspark; print(pyspark.__file__, os.environ.get('THEIR_SITECUSTOMIZE'), loaded)"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(path)}, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    installed = str(Path(sys.modules["pyspark"].__file__).resolve())
    if with_site:
        # only the path module: Spark runs the daemon module with -m, which must find it not yet loaded
        assert shown == [installed, "ran", "rulewatch,rulewatch.spark,rulewatch.spark.runtime,rulewatch.spark.runtime.worker_path"]
    else:  # Spark's own path: pyspark from its zip
        assert ".zip" in shown[0] and shown[1:] == ["ran", "-"]


def test_a_stateful_querys_driver_side_python_imports_the_installed_pyspark(spark, tmp_path):
    from pyspark.sql.streaming import StatefulProcessor

    report = tmp_path / "inits"

    class Reporter(StatefulProcessor):  # nested: pickled by value, as workers cannot import this test module
        def init(self, handle):
            main = getattr(sys.modules["__main__"], "__spec__", None)
            with open(report, "a") as out:
                out.write(f"{main.name if main else ''} {sys.modules['pyspark'].__file__}\n")

        def handleInputRows(self, key, rows, timerValues):
            yield from ()

        def close(self):
            pass

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.json").write_text('{"k": "a"}\n')
    query = (
        spark.readStream.schema("k string").json(str(tmp_path / "in"))
        .groupBy("k").transformWithStateInPandas(Reporter(), "k string", "Append", "None")
        .writeStream.format("noop").option("checkpointLocation", str(tmp_path / "cp")).trigger(availableNow=True).start()
    )  # fmt: skip
    query.awaitTermination()
    driver_side = [line.split(" ", 1)[1] for line in report.read_text().splitlines() if line.startswith("pyspark.sql.streaming.transform_with_state_driver_worker ")]
    assert driver_side, report.read_text()
    if spark.conf.get("spark.python.daemon.module", None) == worker_daemon.MODULE:
        assert {str(Path(f).resolve()) for f in driver_side} == {str(Path(sys.modules["pyspark"].__file__).resolve())}
    else:  # RULEWATCH_WORKER_DAEMON=off: Spark's path, pyspark from its zip
        assert all(".zip" in f for f in driver_side)
