"""Python runs this at start-up in every process Spark starts for a session rulewatch builds (its
folder leads the JVM's PYTHONPATH, after Spark's own entries; rulewatch.spark.runtime.worker_path): Spark's
zips of pyspark and py4j leave the path before anything imports them, so pyspark loads from the
installed package's cached bytecode instead of being compiled from the zip again (~1 s a process).
A ``sitecustomize`` found further along the path then runs as it would have without this one."""

import sys
from importlib.machinery import PathFinder
from importlib.util import module_from_spec
from pathlib import Path

try:
    from rulewatch.spark.runtime.worker_path import drop_spark_archives
except ImportError:  # another Python or environment: Spark's path, as without this folder
    pass
else:
    drop_spark_archives()

_here = Path(__file__).resolve().parent
_spec = PathFinder.find_spec(__name__, [p for p in sys.path if Path(p or ".").resolve() != _here])
if _spec is not None and _spec.loader is not None:
    _theirs = module_from_spec(_spec)
    sys.modules[__name__] = _theirs
    _spec.loader.exec_module(_theirs)
