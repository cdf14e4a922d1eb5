"""Local sessions' Python workers start from rulewatch's daemon (spark/worker_daemon.py): the
installed pyspark instead of Spark's zip of it, with the workers' imports done before the fork."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rulewatch.spark import worker_daemon


def _package(root: Path, name: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("")


def test_only_zips_of_the_installed_packages_leave_the_path(tmp_path):
    site = tmp_path / "site"
    _package(site, "pyspark")
    lib = site / "pyspark" / "python" / "lib"
    other = tmp_path / "other-spark" / "python" / "lib"
    for folder in (lib, other):
        folder.mkdir(parents=True)
        for name in ("pyspark.zip", "py4j-0.10.9.9-src.zip"):
            (folder / name).write_bytes(b"")
    path = [str(lib / "pyspark.zip"), str(lib / "py4j-0.10.9.9-src.zip"), str(other / "pyspark.zip"), str(site)]

    # py4j is not installed beside pyspark here, so its zip is the only copy and stays
    assert worker_daemon.installed_twin_zips(path) == [str(lib / "pyspark.zip")]
    _package(site, "py4j")
    assert worker_daemon.installed_twin_zips(path) == [str(lib / "pyspark.zip"), str(lib / "py4j-0.10.9.9-src.zip")]
    # no pyspark outside the zips: nothing to fall back on, every zip stays
    assert worker_daemon.installed_twin_zips(path[:3]) == []


@pytest.mark.parametrize(
    ("remote", "switch", "expected"),
    [
        (None, None, {"spark.python.daemon.module": "rulewatch.spark.worker_daemon"}),
        ("local[2]", None, {"spark.python.daemon.module": "rulewatch.spark.worker_daemon"}),
        ("sc://workspace:443", None, {}),  # a server elsewhere runs its own workers
        (None, "off", {}),
    ],
)
def test_which_sessions_start_workers_from_it(monkeypatch, remote, switch, expected):
    if switch:
        monkeypatch.setenv("RULEWATCH_WORKER_DAEMON", switch)
    else:
        monkeypatch.delenv("RULEWATCH_WORKER_DAEMON", raising=False)
    assert worker_daemon.confs(remote) == expected


def test_workers_run_the_installed_pyspark_with_the_engine_preloaded(spark):
    if spark.conf.get("spark.python.daemon.module", None) != worker_daemon.MODULE:
        pytest.skip("this session's workers start from Spark's own daemon (RULEWATCH_WORKER_DAEMON=off)")
    def worker_view(batches):  # nested: pickled by value, as workers cannot import this test module
        import pandas as pd

        for _ in batches:
            yield pd.DataFrame({
                "pyspark_from": [sys.modules["pyspark"].__file__],
                "spark_zips_on_path": [sum(p.endswith("pyspark.zip") or "/py4j-" in p for p in sys.path)],
                "engine_preloaded": ["rulewatch.spark.processor" in sys.modules],
            })  # fmt: skip

    rows = spark.range(4, numPartitions=2).mapInPandas(worker_view, "pyspark_from string, spark_zips_on_path int, engine_preloaded boolean").collect()
    installed = Path(sys.modules["pyspark"].__file__).resolve()
    assert {Path(r.pyspark_from).resolve() for r in rows} == {installed}
    assert {(r.spark_zips_on_path, r.engine_preloaded) for r in rows} == {(0, True)}
