"""Spark's Python worker daemon, with what every worker imports done once, before it forks.

Local sessions start their Python workers through this module (``spark.python.daemon.module``);
it runs ``pyspark.daemon`` unchanged after three things (docs/benchmarks.md, "Python workers start
from the installed pyspark"):
- Spark puts ``pyspark.zip``, ``py4j-*.zip`` and its ``spark-core`` jar first on a worker's path.
  zipimport cannot cache bytecode, so every fresh process compiled pyspark from source (~0.8 s
  here), and each forked worker re-read all three archives' directories on its first task. With
  pip's pyspark they are copies of what this environment has installed: they leave the path.
- A forked worker imported pyspark's worker, pandas and pyarrow again (~1 s of CPU each);
  imported here, every fork inherits them. rulewatch's own modules are not preloaded, so a worker
  forked after an edit runs the edited code, as with Spark's daemon.
- After each task a worker runs a full garbage collection, which walked all those modules'
  objects again (~5 ms a task; 1.9 s over gold's stateful tasks at 1M keys). Frozen before the
  fork, they are skipped.
numpy's global random state would be inherited by every fork; each child reseeds it, as a fresh
import would. The sessions rulewatch builds use it (a local Connect server's workers included);
Databricks and remote Connect servers start their own workers.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from importlib.machinery import PathFinder
from pathlib import Path

MODULE = __name__
SWITCH = "RULEWATCH_WORKER_DAEMON"
# What a rulewatch task's worker imports from outside rulewatch: the worker loop, Arrow batches
# and the stateful processor's state client.
PRELOAD = ("pyspark.worker", "pandas", "pyarrow", "pyspark.sql.streaming.stateful_processor_api_client")


def confs(remote: str | None) -> dict[str, str]:
    """The session settings that start workers through this module, for a session this process
    builds or a Connect server it starts (``remote`` "local..."): their workers share this
    environment. None if ``RULEWATCH_WORKER_DAEMON=off`` or the workers' Python cannot import it."""
    # imported here, not at the top: the daemon itself must load none of rulewatch's modules
    from rulewatch.spark.settings import connect_server_elsewhere, switched_off

    if switched_off(SWITCH):
        return {}
    if connect_server_elsewhere(remote) or not workers_can_import():
        return {}
    return {"spark.python.daemon.module": MODULE}


def workers_can_import() -> bool:
    """Whether the workers' Python finds this module with this process's environment; a path added
    at run time (a notebook's ``sys.path.insert``) does not reach it, and a daemon that cannot
    start would fail every Python task."""
    python = os.environ.get("PYSPARK_PYTHON", sys.executable)
    try:
        return subprocess.run([python, "-c", f"import {MODULE}"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


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


def _reseed_numpy() -> None:
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def prepare_forks() -> None:
    """Children reseed numpy's global random state; what is loaded now is frozen out of their
    collections (collected first, so no garbage is frozen with it)."""
    os.register_at_fork(after_in_child=_reseed_numpy)
    gc.collect()
    gc.freeze()


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

    prepare_forks()
    manager()


if __name__ == "__main__":
    main()
