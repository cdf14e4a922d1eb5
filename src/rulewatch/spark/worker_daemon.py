"""Spark's Python worker daemon, with what every worker imports done once, before it forks.

Local sessions start their Python workers through this module (``spark.python.daemon.module``);
it runs ``pyspark.daemon`` unchanged after two things:
- Spark puts its own ``pyspark.zip`` first on a worker's path, and zipimport cannot cache
  bytecode, so every fresh process compiled pyspark from source (~0.8 s here) and each forked
  worker re-read the zip's directory on its first task. When the zip is the one inside the pyspark
  installed in this environment, the installed copy (with its bytecode) is the same code: the zips
  are dropped from the path.
- A forked worker imported pandas, pyarrow, pyspark's worker and the evaluator again (~1 s of CPU
  each); imported here, every fork inherits them.
Databricks and Spark Connect servers run their own workers and never see this module.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import PathFinder
from pathlib import Path

MODULE = __name__
# The modules a rulewatch task's worker imports: the worker loop, Arrow batches, the stateful
# processor's state client and the engine behind it.
PRELOAD = ("pyspark.worker", "pandas", "pyarrow", "pyspark.sql.streaming.stateful_processor_api_client", "rulewatch.spark.processor")


def confs(remote: str | None) -> dict[str, str]:
    """The session settings that start workers through this module: for a session this process
    builds, or a Connect server it starts (``remote`` "local..."), whose workers share this
    environment. ``RULEWATCH_WORKER_DAEMON=off`` keeps Spark's own daemon."""
    if os.environ.get("RULEWATCH_WORKER_DAEMON", "on") == "off" or (remote and not remote.startswith("local")):
        return {}
    return {"spark.python.daemon.module": MODULE}


def installed_twin_zips(path: list[str]) -> list[str]:
    """The entries of ``path`` that are Spark's zips of packages installed elsewhere on ``path``.

    Spark adds ``$SPARK_HOME/python/lib/pyspark.zip`` and ``py4j-*.zip``; with pip's pyspark,
    SPARK_HOME is the installed package, so its zips copy what the environment has. A zip stays
    unless it lies inside the installed pyspark and its package is importable without it."""
    rest = [p for p in path if not p.endswith(".zip")]
    installed = PathFinder.find_spec("pyspark", rest)
    if installed is None or installed.origin is None:
        return []
    lib = Path(installed.origin).resolve().parent / "python" / "lib"
    twins = []
    for entry in path:
        zipped = Path(entry)
        package = "pyspark" if zipped.name == "pyspark.zip" else "py4j" if zipped.name.startswith("py4j-") else None
        if package and zipped.suffix == ".zip" and zipped.resolve().parent == lib and PathFinder.find_spec(package, rest):
            twins.append(entry)
    return twins


def main() -> None:
    for entry in installed_twin_zips(sys.path):
        sys.path.remove(entry)
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:  # another pyspark's layout: that worker imports it itself, as before
            pass
    from pyspark.daemon import manager

    manager()


if __name__ == "__main__":
    main()
