"""Spark's Python worker daemon, with what every worker imports done once, before it forks.

Local sessions start their Python workers through this module (``spark.python.daemon.module``);
it runs ``pyspark.daemon`` unchanged after three things (docs/benchmarks.md, "Python workers start
from the installed pyspark"):
- Spark puts ``pyspark.zip``, ``py4j-*.zip`` and its ``spark-core`` jar first on a worker's path.
  zipimport cannot cache bytecode, so every fresh process compiled pyspark from source (~0.8 s
  here), and each forked worker re-read all three archives' directories on its first task. With
  pip's pyspark they are copies of what this environment has installed: they leave the path.
- A forked worker imported pandas, pyarrow, pyspark's worker and the evaluator again (~1 s of CPU
  each); imported here, every fork inherits them.
- After each task a worker runs a full garbage collection, which walked all those modules'
  objects again (~5 ms a task; 1.9 s over gold's stateful tasks at 1M keys). Frozen before the
  fork, they are skipped.
Databricks and Spark Connect servers run their own workers and never see this module.
"""

from __future__ import annotations

import gc
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


def main() -> None:
    dropped = spark_archives(sys.path)
    for entry in dropped:
        sys.path.remove(entry)
    # the importers already made for them (and for folders inside them) would still be re-read
    for entry in [e for e in sys.path_importer_cache if e.startswith(tuple(dropped))]:
        del sys.path_importer_cache[entry]
    for name in PRELOAD:
        try:
            __import__(name)
        except Exception:  # e.g. another pyspark's layout: a task that needs it imports it, as before
            pass
    from pyspark.daemon import manager

    gc.freeze()
    manager()


if __name__ == "__main__":
    main()
