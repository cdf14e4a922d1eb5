"""Spark's Python worker daemon, with what every worker imports done once, before it forks.

Local sessions start their Python workers through this module (``spark.python.daemon.module``);
it runs ``pyspark.daemon`` unchanged after three things (docs/journal/benchmarks.md, "Python workers start
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
import would. The processes Spark starts without a daemon drop the archives at start-up
(``rulewatch.spark.runtime.worker_path``). The sessions rulewatch builds use it (a local Connect server's
workers included); Databricks and remote Connect servers start their own workers.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

from rulewatch.spark.runtime.worker_path import drop_spark_archives

MODULE = __name__
SWITCH = "RULEWATCH_WORKER_DAEMON"
# What a rulewatch task's worker imports from outside rulewatch: the worker loop, Arrow batches
# and the stateful processor's state client.
PRELOAD = ("pyspark.worker", "pandas", "pyarrow", "pyspark.sql.streaming.stateful_processor_api_client")


def applies(remote: str | None) -> bool:
    """Whether workers start from this module and ``worker_path.SITE``: for a session this process builds
    or a Connect server it starts (``remote`` "local..."), whose workers share this environment;
    not if ``RULEWATCH_WORKER_DAEMON=off`` or the workers' Python cannot import it."""
    # imported here, not at the top: the daemon loads none of the modules rulewatch's tasks run
    from rulewatch.spark.runtime.env import connect_server_elsewhere, switched_off

    return not switched_off(SWITCH) and not connect_server_elsewhere(remote) and workers_can_import()


def confs(applied: bool) -> dict[str, str]:
    """The session settings that start executors' workers through this module."""
    return {"spark.python.daemon.module": MODULE} if applied else {}


def workers_can_import() -> bool:
    """Whether the workers' Python finds this module with this process's environment; a path added
    at run time (a notebook's ``sys.path.insert``) does not reach it, and a daemon that cannot
    start would fail every Python task."""
    python = os.environ.get("PYSPARK_PYTHON", sys.executable)
    try:
        return subprocess.run([python, "-c", f"import {MODULE}"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


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
    drop_spark_archives()
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
