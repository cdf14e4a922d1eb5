"""Delta Lake and Kafka-connector jars for the local SparkSession, fetched once and reused offline.

Spark can resolve ``--packages`` itself at every start, but that needs the network each time and
pulls in copies of jars pyspark already ships (jackson, hadoop, parquet). We resolve once with
Spark's own Ivy resolver, keep only the jars pyspark lacks, and point ``spark.jars`` at them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pyspark

from rulewatch.spark.runtime.env import cache_home

DELTA_VERSION = "4.4.0"
SPARK_LINE = tuple(int(part) for part in pyspark.__version__.split(".")[:2])  # (major, minor)
SPARK_MINOR = ".".join(map(str, SPARK_LINE))
DELTA_PACKAGE = f"io.delta:delta-spark_{SPARK_MINOR}_2.13:{DELTA_VERSION}"
# Spark's own Kafka source and sink, at the Spark version itself (Databricks runtimes ship it).
KAFKA_CONNECTOR = f"org.apache.spark:spark-sql-kafka-0-10_2.13:{pyspark.__version__}"
PACKAGES = (DELTA_PACKAGE, KAFKA_CONNECTOR)

_VERSION_SUFFIX = re.compile(r"-\d[\w.]*(?:-\d+)?\.jar$")


def jars_dir() -> Path:
    """Where the resolved Spark jars live: ``<cache_home>/jars/<packages>``."""
    return cache_home() / "jars" / "+".join(p.replace(":", "_") for p in PACKAGES)


def spark_jars() -> list[Path]:
    """The jar paths for ``spark.jars``; empty when they have not been fetched yet."""
    directory = jars_dir()
    if not (directory / "COMPLETE").exists():
        return []
    return sorted(directory.glob("*.jar"))


def _artifact(jar_name: str) -> str:
    # Ivy names jars "<org>_<artifact>-<version>.jar"; pyspark ships "<artifact>-<version>.jar".
    return _VERSION_SUFFIX.sub("", jar_name.split("_", 1)[-1])


def fetch_spark_jars(quiet: bool = False) -> list[Path]:
    """Resolve ``PACKAGES`` from Maven Central (once) and keep the jars pyspark lacks."""
    if jars := spark_jars():
        return jars
    target = jars_dir()
    shipped = {_VERSION_SUFFIX.sub("", p.name) for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar")}
    with tempfile.TemporaryDirectory(prefix="rulewatch-ivy-") as ivy:
        if not quiet:
            print(f"rulewatch: fetching {', '.join(PACKAGES)} from Maven Central (once) ...", file=sys.stderr)
        probe = (
            "from pyspark.sql import SparkSession;"
            f"SparkSession.builder.master('local[1]').config('spark.jars.packages',{','.join(PACKAGES)!r})"
            f".config('spark.jars.ivy',{ivy!r}).config('spark.ui.enabled','false').getOrCreate().stop()"
        )
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
        resolved = sorted(Path(ivy, "jars").glob("*.jar"))
        if result.returncode != 0 or not resolved:
            raise RuntimeError(
                f"could not resolve {', '.join(PACKAGES)} from Maven Central; is the network reachable?\n"
                + result.stderr[-2000:]
            )
        target.mkdir(parents=True, exist_ok=True)
        for jar in resolved:
            if _artifact(jar.name) not in shipped:
                shutil.copy2(jar, target / jar.name)
    (target / "COMPLETE").write_text("\n".join(PACKAGES) + "\n")
    return spark_jars()
