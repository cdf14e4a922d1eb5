"""The one place that builds (or finds) the SparkSession every layer runs on."""

from __future__ import annotations

import errno
import os
import re
import socket
import sys
import threading
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

from pyspark.sql import SparkSession

from rulewatch.spark.runtime.class_archive import SPARK_HOME, archive_options
from rulewatch.spark.runtime.jars import fetch_spark_jars
from rulewatch.spark.runtime import worker_daemon, worker_path
from rulewatch.spark.runtime.env import EXECUTOR_JAVA_OPTIONS, JAVA_OPTIONS, connect_server_elsewhere, connect_server_here, is_databricks, repository_root, spark_master

ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"

# Sane defaults for a 2-core laptop; each can be overridden with an env var of the same meaning.
LOCAL_CONF: dict[str, str] = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    # transformWithState* only runs on the RocksDB state store.
    "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
    "spark.sql.shuffle.partitions": os.environ.get("RULEWATCH_SHUFFLE_PARTITIONS", "4"),
    "spark.default.parallelism": "4",
    "spark.sql.session.timeZone": "UTC",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.memory": os.environ.get("RULEWATCH_DRIVER_MEMORY", "4g"),
    "spark.sql.adaptive.enabled": "false",
    "spark.databricks.delta.snapshotPartitions": "2",
    "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
    # The .crc file beside each commit costs a state computation per append; live micro-batches make
    # several appends each (docs/journal/benchmarks.md, "Live mode latency": batches ~5-10% shorter without).
    "spark.databricks.delta.writeChecksumFile.enabled": "false",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    # Silver caches each batch's parsed lines once and reads them five times; compressing that cache
    # costs more CPU than it saves (1M lines: 15.6-16.2 s -> 13.5-14.7 s, docs/journal/benchmarks.md).
    "spark.sql.inMemoryColumnarStorage.compressed": "false",
    # Compiled code is cached by its source, 100 entries by default: a live ingest + gold pair of
    # micro-batches generates ~300 distinct classes, so the cache thrashed and most compiling
    # recompiled a source seen before (1-minute demo: 18.8 of 30.5 s). Delta's per-batch filters
    # carry literals and still compile once each; this keeps the rest (docs/journal/benchmarks.md, "Live
    # mode latency").
    "spark.sql.codegen.cache.maxEntries": "1000",
    # A file-source micro-batch of more than 32 files (the default) has its files listed by a Spark
    # job, one task per file; on a local disk the driver stats them in milliseconds. A live ingest
    # batch holds ~50 landed files at 1,000 events/s, a job run every file landed since the last
    # (50 files: getBatch 317-392 -> 12-15 ms; 935 files: 4.7 -> 0.1 s; docs/journal/benchmarks.md).
    "spark.sql.sources.parallelPartitionDiscovery.threshold": "100000",
    # Local runs need no Derby metastore: every table is addressed by path.
    "spark.sql.catalogImplementation": "in-memory",
}


# Hadoop's local file system starts a process for each file it creates (`chmod`) and, through its
# FileContext API, for each rename (`readlink`, twice or more) unless Hadoop's native library is
# loaded, which pip's pyspark does not ship: ~3-5 ms each here. FileContext is how Spark writes
# streaming checkpoints (offsets, commits, state store files) and Delta its log on file paths by
# default; through the FileSystem API a rename starts none (the fixture job: 578 processes ->
# 253, docs/journal/benchmarks.md). Either way a rename checks that its target is absent, then renames:
# neither is atomic across processes on a local disk; Delta's LocalLogStore adds a lock within one.
CHECKPOINT_MANAGER = "FileSystemBasedCheckpointFileManager"


@cache
def _checkpoint_manager_class() -> str | None:
    """The checkpoint manager's full name in this Spark (its package moved after 4.0), or None."""
    for jar in sorted((SPARK_HOME / "jars").glob("spark-sql_*.jar")):
        with zipfile.ZipFile(jar) as classes:
            names = set(classes.namelist())
        for package in ("org/apache/spark/sql/execution/streaming/checkpointing", "org/apache/spark/sql/execution/streaming"):
            if f"{package}/{CHECKPOINT_MANAGER}.class" in names:
                return f"{package.replace('/', '.')}.{CHECKPOINT_MANAGER}"
    return None


def local_file_confs(remote: str | None) -> dict[str, str]:
    """The settings that keep renames on local files from starting processes; none for a Spark
    Connect server elsewhere (its own Spark, its own classes)."""
    if connect_server_elsewhere(remote):
        return {}
    confs = {"spark.delta.logStore.file.impl": "io.delta.storage.LocalLogStore"}
    manager = _checkpoint_manager_class()
    if manager:
        confs["spark.sql.streaming.checkpointFileManagerClass"] = manager
    return confs


def driver_java_options() -> str:
    """The local driver JVM's options: the project's, this machine's class archive, then
    ``RULEWATCH_JAVA_OPTIONS`` last, so that they win. The test suite sets it to compile with C1 only
    (``-XX:TieredStopAtLevel=1``) for the commands it starts: a short-lived JVM otherwise spends ~70 %
    of its CPU in the JIT compilers (docs/journal/benchmarks.md, "The test suite's JVMs")."""
    return " ".join(filter(None, (JAVA_OPTIONS, archive_options(), os.environ.get("RULEWATCH_JAVA_OPTIONS", "").strip())))


def executor_java_options() -> str:
    """A cluster's executors' JVM options: the project's that are no driver's file, then ``RULEWATCH_JAVA_OPTIONS``.
    (A local session's executor is its driver's JVM.)"""
    return " ".join(filter(None, (EXECUTOR_JAVA_OPTIONS, os.environ.get("RULEWATCH_JAVA_OPTIONS", "").strip())))


# Lines the JVM passes on that say nothing to a user: the stateful operator's Python driver worker
# prints its UDF and schemas (kilobytes) each time a query starts, Spark's start-up banner tells
# how to change a log level, and the DataSketches library inside Spark warns on any Java past 11
# that it cannot use off-heap memory, which Spark's HLL sketches (gold's window metrics) never ask
# for. RULEWATCH_JVM_OUTPUT=all keeps them.
_NOISE = re.compile(
    rb"^(Starting )?Streaming TransformWithStateInPandas Python worker|^\s*$|^WARNING: Using incubator modules"
    rb"|^Setting default log level to|^To adjust logging level use"
    rb"|^Warning: Java versions > Java 11 can only operate in restricted mode where no off-heap operations are allowed!$"
)


def _forward(pipe_fd: int, target_fd: int) -> None:
    with os.fdopen(pipe_fd, "rb") as pipe:
        for line in pipe:
            if not _NOISE.match(line):
                os.write(target_fd, line)


@contextmanager
def _jvm_stderr_filtered() -> Iterator[None]:
    """While the JVM starts, its stderr (fd 2, inherited) becomes a pipe that drops ``_NOISE`` lines.

    Only the JVM keeps the pipe: this process gets its own stderr back at once, so nothing it prints
    itself depends on the forwarding thread.
    """
    if os.environ.get("RULEWATCH_JVM_OUTPUT") == "all":
        yield
        return
    read_fd, write_fd = os.pipe()
    real_stderr = os.dup(2)
    sys.stderr.flush()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    threading.Thread(target=_forward, args=(read_fd, real_stderr), name="rulewatch-jvm-stderr", daemon=True).start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real_stderr, 2)


def foreach_batch_runs_here(spark: SparkSession) -> bool:
    """Whether a query's ``foreachBatch`` function runs on this machine, so files it writes can be
    read here: a classic session, or a Spark Connect server this process started (``RULEWATCH_REMOTE``
    ``local[...]``). A Connect server elsewhere runs it in its own process, on its own disk."""
    return not is_connect(spark) or connect_server_here(os.environ.get("RULEWATCH_REMOTE"))


def is_connect(spark: SparkSession) -> bool:
    """Whether ``spark`` is a Spark Connect session (its ``foreachBatch`` functions run in the server's
    Python processes, never in this one)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


# pyspark's local Connect mode (RULEWATCH_REMOTE=local[...]) starts its server on this port and dials it.
LOCAL_CONNECT_PORT = 15002


class ConnectPortBusy(RuntimeError):
    """The port a local Spark Connect server needs is taken by another program."""


def _check_connect_port(remote: str) -> None:
    # Otherwise the server's start fails deep in the JVM with a BindException and a Py4J trace. The
    # server listens on every address, IPv4 and IPv6: a listener of either family blocks it.
    for family, wildcard in [(socket.AF_INET, ""), (socket.AF_INET6, "::")]:
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host: nothing can listen there either
            continue
        with probe:
            # A closed server's connections left in TIME_WAIT do not block it; only a listener does.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # IPv4 was probed above; this one asks about IPv6 alone
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind((wildcard, LOCAL_CONNECT_PORT))
            except OSError as err:
                if err.errno != errno.EADDRINUSE:  # e.g. IPv6 turned off: not a listener, the server will say
                    continue
                raise ConnectPortBusy(
                    f"RULEWATCH_REMOTE={remote} starts a local Spark Connect server on port {LOCAL_CONNECT_PORT}, "
                    f"which another program holds ({err.strerror}); stop it (`ss -ltnp 'sport = :{LOCAL_CONNECT_PORT}'` "
                    f"names it), or, if it is a Connect server, use it with RULEWATCH_REMOTE=sc://localhost:{LOCAL_CONNECT_PORT}"
                ) from None


def get_spark(app_name: str = "rulewatch") -> SparkSession:
    """Return the active session (Databricks, Connect, tests) or build the local one.

    Locally: ``local[2]`` (``RULEWATCH_MASTER`` or ``--master`` overrides, env.spark_master) with Delta,
    RocksDB state and quiet logs.
    The Python workers must import pandas/pyarrow from this same environment, hence PYSPARK_PYTHON.
    """
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    if is_databricks():
        return SparkSession.builder.getOrCreate()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    remote = os.environ.get("RULEWATCH_REMOTE")
    builder = SparkSession.builder.appName(app_name)
    # Spark Connect (as on Databricks serverless): "local[2]" starts a local Connect server with the
    # same settings; an "sc://..." URL connects to a running one.
    if remote:
        # Not once this process runs the server (pyspark marks it so; another thread has no active
        # session and gets it again), nor under pyspark's tests, which give the server a free port.
        if connect_server_here(remote) and not {"SPARK_LOCAL_REMOTE", "SPARK_TESTING"} & os.environ.keys():
            _check_connect_port(remote)
        # The local Connect server takes these at start-up; the client then also tries to set them
        # as session confs and warns that static ones cannot change. Nothing is wrong: hush it.
        warnings.filterwarnings("ignore", message="Failed to set spark", category=UserWarning)
        builder = builder.remote(remote)
    else:
        master = spark_master()
        builder = builder.master(master)
        if not master.startswith("local[") and master != "local":  # local-cluster[...] has executors of its own
            builder = builder.config("spark.executor.extraJavaOptions", executor_java_options())
    for key, value in (LOCAL_CONF | local_file_confs(remote)).items():
        builder = builder.config(key, value)
    # Spark makes its (unused: tables are addressed by path) warehouse folder in the working directory,
    # which for a notebook opened by hand is notebooks/; keep it at the repository root, where git ignores it.
    root = repository_root()
    if root is not None:
        builder = builder.config("spark.sql.warehouse.dir", str(root / "spark-warehouse"))
    workers_from_rulewatch = worker_daemon.applies(remote)
    for key, value in worker_daemon.confs(workers_from_rulewatch).items():
        builder = builder.config(key, value)
    builder = builder.config("spark.jars", ",".join(str(p) for p in fetch_spark_jars()))
    builder = builder.config("spark.driver.extraJavaOptions", driver_java_options())
    with _jvm_stderr_filtered(), worker_path.jvm_python_path(workers_from_rulewatch):
        return builder.getOrCreate()


@contextmanager
def session_confs(spark: SparkSession, confs: dict[str, str]) -> Iterator[None]:
    """Set ``confs`` while queries start (each copies the session's settings then), then put them back."""
    previous = {key: spark.conf.get(key, None) for key in confs}
    for key, value in confs.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)
