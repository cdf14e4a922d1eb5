"""What the environment says: where rulewatch runs (Databricks, a checkout, a Spark Connect server), its
switches, where set-up keeps what it fetched, and the options every rulewatch JVM starts with.

Plain Python, imported by every layer above it: nothing here starts Spark or imports pyspark.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Mapping
from pathlib import Path

from rulewatch.engine.rules import parse_duration

# The checkout this package was imported from (src/rulewatch/spark/runtime/env.py -> the repository root).
_SOURCE_ROOT = Path(__file__).resolve().parents[4]
BUNDLE_FILE = "databricks.yml"


def is_databricks() -> bool:
    return "DATABRICKS_RUNTIME_VERSION" in os.environ


def repository_root(start: Path | None = None) -> Path | None:
    """The nearest folder holding ``databricks.yml`` from ``start`` (default: the working directory) upwards.

    Failing that, the checkout this package was imported from (an editable install used from
    elsewhere); None when neither exists, e.g. a wheel installed on a cluster.
    """
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / BUNDLE_FILE).is_file():
            return folder
    return _SOURCE_ROOT if (_SOURCE_ROOT / BUNDLE_FILE).is_file() else None


def switched_off(env: str) -> bool:
    """Whether the on-by-default switch ``env`` is set to 0, false, off or no (any case)."""
    return os.environ.get(env, "on").strip().lower() in {"0", "false", "off", "no"}


def connect_server_here(remote: str | None) -> bool:
    """Whether ``remote`` (``RULEWATCH_REMOTE``) asks for a Spark Connect server this process starts
    (``local[...]``): its Spark, its Python workers and its disk are this machine's."""
    return (remote or "").startswith("local")


def connect_server_elsewhere(remote: str | None) -> bool:
    """Whether ``remote`` names a Spark Connect server somewhere else (``sc://...``), whose Spark,
    classes and disk are its own; none (a classic session) is not."""
    return bool(remote) and not connect_server_here(remote)


def cache_home() -> Path:
    """``$RULEWATCH_HOME``, default ``~/.cache/rulewatch``: what set-up fetched, kept for offline runs."""
    return Path(os.environ.get("RULEWATCH_HOME", Path.home() / ".cache" / "rulewatch"))


def java_binary() -> Path | None:
    """The java that spark-submit (and the Kafka broker) run: ``$JAVA_HOME/bin/java``, else the one on PATH."""
    java = Path(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get("JAVA_HOME") else shutil.which("java")
    return Path(java).resolve() if java and Path(java).exists() else None


def collector_option(environ: Mapping[str, str]) -> str:
    """The parallel collector, not G1, because a batch job on two cores wants throughput: G1's
    concurrent work takes a core from the tasks (silver on 1M lines ~10 % faster, docs/journal/benchmarks.md,
    "The JVM's collector"). Empty if the environment's JVM options already choose one: the JVM
    refuses to start with two."""
    given = " ".join(environ.get(name, "") for name in ("JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "JDK_JAVA_OPTIONS"))
    return "" if re.search(r"-XX:\+Use\w*GC\b", given) else "-XX:+UseParallelGC"


# Silver's validation compiles into one generated method past HotSpot's 8,000-byte JIT limit, which
# then runs interpreted: letting the JIT take it makes the parse ~1.6x faster (docs/journal/benchmarks.md).
# The same holds on a cluster's executors, where silver's tasks run. Only that there: the log settings are
# the driver's own file, and a collector chosen here could clash with one the cluster's hosts choose.
EXECUTOR_JAVA_OPTIONS = "-XX:-DontCompileHugeMethods"
JAVA_OPTIONS = " ".join(filter(None, (f"-Dlog4j2.configurationFile={Path(__file__).with_name('log4j2.properties')}",
                                      EXECUTOR_JAVA_OPTIONS, collector_option(os.environ))))  # fmt: skip


# An event time further than this past its own ingest time is quarantined. A future-dated event
# would otherwise drag the watermark ahead and make every on-time event after it "late"; with the
# tolerance no larger than gold's allowed lateness, no accepted event can move the watermark past
# the ingest clock (docs/reliability.md, "Watermark poisoning"). Covers producer clock skew only.
FUTURE_TOLERANCE_ENV = "RULEWATCH_FUTURE_TOLERANCE"
DEFAULT_FUTURE_TOLERANCE = "5m"


class SettingError(ValueError):
    """An environment setting that is not a value it can take: names the variable, its value and the fix."""


def env_duration(env: str, default: str) -> str:
    """The duration ``env`` sets (``default`` when unset), checked: a typo stops the command with its name."""
    text = os.environ.get(env, default)
    try:
        parse_duration(text)
    except ValueError as err:
        raise SettingError(f"{env}={text!r} is not a duration ({err}); unset it for the default {default}") from None
    return text


def future_tolerance() -> str:
    """How far past its ingest time an event time may lie (``RULEWATCH_FUTURE_TOLERANCE``), as a duration."""
    return env_duration(FUTURE_TOLERANCE_ENV, DEFAULT_FUTURE_TOLERANCE)


# Where a classic session runs: ``local[2]`` (this process), or a cluster's master (docs/scale.md).
MASTER_ENV = "RULEWATCH_MASTER"
DEFAULT_MASTER = "local[2]"
_MASTER = re.compile(r"local(\[(\d+|\*)(,\d+)?\])?|local-cluster\[\d+,\d+,\d+\]|spark://[^\s/,]+:\d+(,[^\s/,]+:\d+)*|yarn|k8s://\S+")
# How long a standalone master has to accept a connection before the command gives up on it.
MASTER_TIMEOUT_S = 5.0


def master_problem(url: str) -> str | None:
    """Why ``url`` is no Spark master URL Spark would take (None: it is one)."""
    if _MASTER.fullmatch(url):
        return None
    return (f"{url!r} is no Spark master URL: give local[N] (this process, N cores), spark://HOST:PORT (a standalone "
            "cluster's master, docs/scale.md), yarn or k8s://...")  # fmt: skip


def spark_master() -> str:
    """The master a classic session starts on: ``RULEWATCH_MASTER`` (``--master``), else ``local[2]``.

    A standalone master (``spark://``) must accept a connection first: Spark would otherwise retry
    for a minute and fail with a trace that names no fix.
    """
    url = os.environ.get(MASTER_ENV, "").strip() or DEFAULT_MASTER
    if problem := master_problem(url):
        raise SettingError(f"{MASTER_ENV}={problem}")
    if url.startswith("spark://"):
        errors = []
        for address in url.removeprefix("spark://").split(","):
            host, _, port = address.rpartition(":")
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=MASTER_TIMEOUT_S).close()
                return url
            except OSError as err:
                errors.append(f"{address}: {err.strerror or err}")
        raise SettingError(f"no Spark master answers at {url} ({'; '.join(errors)}): start the cluster (docs/scale.md) or fix --master / {MASTER_ENV}")
    return url


def use_master(url: str) -> None:
    """Make ``url`` (``--master``) the master of the sessions this process and its kernels start, once
    it answers; refused beside ``RULEWATCH_REMOTE``, which sends the work to a Connect server instead."""
    if remote := os.environ.get("RULEWATCH_REMOTE"):
        raise SettingError(f"--master {url} runs Spark from this process, but RULEWATCH_REMOTE={remote} sends the work to "
                           "a Spark Connect server: unset one of them")  # fmt: skip
    os.environ[MASTER_ENV] = url
    spark_master()  # a cluster that does not answer: said before anything starts
