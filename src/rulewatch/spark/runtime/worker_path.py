"""What the Python processes Spark starts for a local session find first on their path.

Spark puts ``pyspark.zip``, ``py4j-*.zip`` and its ``spark-core`` jar first on the path of every
Python process it starts. zipimport cannot cache bytecode, so each fresh process compiles pyspark
from the zip (~1 s here); with pip's pyspark the archives are copies of what is installed. The
executors' workers drop them in rulewatch's daemon (``worker_daemon``); the processes Spark starts
by module name without a daemon (a stateful query's driver-side
``transform_with_state_driver_worker``, Connect's ``foreachBatch`` workers) drop them at start-up:
the folder ``worker_site``, holding only a ``sitecustomize``, leads the ``PYTHONPATH`` the
session's JVM inherits, which Spark appends to every such process's path.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.machinery import PathFinder
from pathlib import Path

SITE = Path(__file__).with_name("worker_site")


def spark_archives(path: list[str]) -> list[str]:
    """The entries of ``path`` that are Spark's archives of packages installed elsewhere on ``path``.

    Spark adds ``$SPARK_HOME/python/lib/pyspark.zip`` and ``py4j-*.zip`` and the jar of its own
    classes; with pip's pyspark, SPARK_HOME is the installed package. An archive leaves only if it
    lies inside that package and what it holds is importable without it."""
    rest = [p for p in path if not p.endswith((".zip", ".jar"))]
    installed = PathFinder.find_spec("pyspark", rest)
    if installed is None or installed.origin is None:
        return []
    home = Path(installed.origin).resolve().parent
    archives = []
    for entry in path:
        archive = Path(entry)
        folder = archive.resolve().parent
        if archive.suffix == ".jar" and folder == home / "jars":
            archives.append(entry)
        elif archive.suffix == ".zip" and folder == home / "python" / "lib":
            package = "pyspark" if archive.name == "pyspark.zip" else "py4j" if archive.name.startswith("py4j-") else None
            if package and PathFinder.find_spec(package, rest):
                archives.append(entry)
    return archives


def drop_spark_archives() -> None:
    """Take Spark's archives of installed packages off this process's path (``spark_archives``)."""
    dropped = spark_archives(sys.path)
    for entry in dropped:
        sys.path.remove(entry)
    # the importers already made for them (and for folders inside them) would still be re-read
    for entry in [e for e in sys.path_importer_cache if e.startswith(tuple(dropped))]:
        del sys.path_importer_cache[entry]


@contextmanager
def jvm_python_path(applied: bool) -> Iterator[None]:
    """While a session starts its JVM, ``worker_site`` leads the ``PYTHONPATH`` it inherits; this
    process's own environment is put back after."""
    previous = os.environ.get("PYTHONPATH")
    if applied:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), previous) if p)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = previous
