"""Local sessions' Python workers start from rulewatch's daemon (spark/worker_daemon.py): the
installed pyspark instead of Spark's zip of it, with the workers' imports done before the fork."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

from rulewatch.spark import worker_daemon


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
    assert worker_daemon.spark_archives(path) == [ours[0], ours[2]]
    _package(site, "py4j")
    assert worker_daemon.spark_archives(path) == ours
    # no pyspark outside the archives: nothing to fall back on, every archive stays
    assert worker_daemon.spark_archives(path[:-1]) == []


@pytest.mark.parametrize(
    ("remote", "switch", "expected"),
    [
        (None, None, {"spark.python.daemon.module": "rulewatch.spark.worker_daemon"}),
        ("local[2]", None, {"spark.python.daemon.module": "rulewatch.spark.worker_daemon"}),
        ("sc://workspace:443", None, {}),  # a server elsewhere runs its own workers
        (None, "off", {}),
        (None, "No", {}),
    ],
)
def test_which_sessions_start_workers_from_it(monkeypatch, remote, switch, expected):
    if switch:
        monkeypatch.setenv("RULEWATCH_WORKER_DAEMON", switch)
    else:
        monkeypatch.delenv("RULEWATCH_WORKER_DAEMON", raising=False)
    assert worker_daemon.confs(remote) == expected


def test_a_worker_python_that_cannot_import_it_keeps_sparks_daemon(monkeypatch, tmp_path):
    # a Python without rulewatch: the module found here only through this process's path
    bare = tmp_path / "python"
    bare.write_text(f"#!/bin/sh\nPYTHONPATH= exec {sys.base_prefix}/bin/python3 -I \"$@\"\n")
    bare.chmod(0o755)
    monkeypatch.setenv("PYSPARK_PYTHON", str(bare))
    assert not worker_daemon.workers_can_import()
    assert worker_daemon.confs(None) == {}


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
