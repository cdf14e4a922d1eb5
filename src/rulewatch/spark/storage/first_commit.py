"""A new path table created by writing the first commit Delta wrote for the same statement aside.

A CREATE TABLE costs a SQL statement and Delta's commit path: a fresh lakehouse's 12 tables took
1.1-1.8 s of a warm session and 4.7 s of a new process's (docs/testing.md), paid by every test,
notebook and first run on a new lakehouse. The first commit of a new path table holds only its protocol,
its metadata and the commit's info, which depend on the statement, the Spark and Delta releases and the
session's settings alone. So Delta makes it once, for a table in a folder aside, and it is kept (in this
process and in ``$RULEWATCH_HOME/first-commits``, for the next); each new table then gets that commit with
an id and times of its own, its folder renamed into place only where none with anything in it is there.

The version checksum Delta writes beside a commit (``.crc``, off for this project's own commits: session.py)
is made aside too and written beside each table's first commit: without it, a table Delta has not created
in this session has its protocol and metadata read back by a Spark job at its first use, which cost more
than the statement saved (docs/testing.md).

Only where the copy is exactly what Delta would write: a classic session on a local or standalone master
whose file system is the local one, an absolute path with no folder there yet (an existing folder is left to
Delta, which says what is wrong with it), and a commit of the protocol features and table properties named
below, none of which holds a value of the table's own (column mapping's physical names, row tracking's
columns, a commit coordinator's or catalog's registration, in-commit timestamps' enablement would). Anything
else is left to the statement.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Iterator

from pyspark.sql import SparkSession

from rulewatch.spark.runtime.env import cache_home, is_databricks
from rulewatch.spark.runtime.session import is_connect
from rulewatch.spark.storage.delta_log import UNREADABLE
from rulewatch.spark.storage.lakehouse import is_table_name, table_ref

COMMIT_0 = f"{0:020d}.json"
CHECKSUM_0 = f"{0:020d}.crc"
# The settings that can shape a new table (Delta's and Spark SQL's: a column type's default, a collation),
# and the jars Delta comes from; Delta's note of the session's newest commit changes with every commit.
_SHAPING = ("spark.databricks.delta.", "spark.sql.", "spark.jars")
_VOLATILE = {"spark.databricks.delta.lastCommitVersionInSession"}
_FEATURES = {"appendOnly", "invariants", "checkConstraints", "changeDataFeed", "generatedColumns", "deletionVectors", "timestampNtz", "vacuumProtocolCheck"}
_PROPERTIES = {
    "delta.appendOnly", "delta.checkpointInterval", "delta.dataSkippingStatsColumns", "delta.dataSkippingNumIndexedCols",
    "delta.enableChangeDataFeed", "delta.enableDeletionVectors",
}  # fmt: skip
_NOT_POSSIBLE: dict[str, Any] = {}  # in place of a commit a statement's table is not copied from (this process only)
_made: dict[str, dict[str, Any]] = {}
_lock = threading.Lock()


class _ReadOnce:
    """A session's shaping settings, read by the first creation in a ``settings_read_once`` block that needs them."""

    def __init__(self, spark: SparkSession) -> None:
        self.spark, self.lock, self.settings = spark, threading.Lock(), None

    def of(self, spark: SparkSession) -> dict[str, str]:
        if spark is not self.spark:
            return _shaping(spark)
        with self.lock:
            if self.settings is None:
                self.settings = _shaping(spark)
            return self.settings


_READ_ONCE: ContextVar[_ReadOnce | None] = ContextVar("rulewatch_first_commit_settings", default=None)


@contextmanager
def settings_read_once(spark: SparkSession) -> Iterator[None]:
    """Tables created in the block, and in the threads it starts through ``sinks.together`` (which carry its
    context), take the session's settings as first read in it: each read is a py4j call per setting
    (~30 ms), which a fresh lakehouse's dozen creations made ~0.2 s of a warm run's ~5 s. A setting
    changed inside the block is not seen by its later creations, so blocks hold creations alone."""
    token = _READ_ONCE.set(_ReadOnce(spark)) if _READ_ONCE.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _READ_ONCE.reset(token)


def _shaping(spark: SparkSession) -> dict[str, str]:
    return {k: v for k, v in spark.conf.getAll.items() if k.startswith(_SHAPING) and k not in _VOLATILE}


def create(spark: SparkSession, table: str, statement: Callable[[str], str]) -> bool:
    """Create the path ``table`` as ``statement(table_ref)`` would; False where this cannot (the
    caller then runs the statement itself), or where another creator's commit came first."""
    if is_table_name(table) or not os.path.isabs(table) or is_databricks() or is_connect(spark) or not _local_files(spark):
        return False
    folder = Path(table)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        return False
    made = _made_for(spark, statement)
    if made is _NOT_POSSIBLE:
        return False
    commit, checksum = _own(made)
    # The whole table folder is written aside and renamed into place: a crash leaves no half table (a
    # `_delta_log` folder without commit 0 is one Delta's CREATE TABLE IF NOT EXISTS takes as existing).
    staging = folder.parent / f".{folder.name}.{uuid.uuid4()}.tmp"
    try:
        log = staging / "_delta_log"
        (log / "_staged_commits").mkdir(parents=True)  # as Delta leaves it
        (log / COMMIT_0).write_text("".join(json.dumps(action, separators=(",", ":")) + "\n" for action in commit))
        (log / CHECKSUM_0).write_text(json.dumps(checksum, separators=(",", ":")))
        os.rename(staging, folder)  # fails where the folder holds anything: the other creator's table stands
    except OSError:  # that, or a folder it cannot write: the statement answers
        shutil.rmtree(staging, ignore_errors=True)
        return False
    return True


def _local_files(spark: SparkSession) -> bool:
    """Whether the driver's own disk is where Delta writes a path table (not HDFS or a cluster's store)."""
    master = spark.conf.get("spark.master", "")
    default_fs = spark.conf.get("spark.hadoop.fs.defaultFS", "file:///")
    return (master.startswith("local") or master.startswith("spark://")) and default_fs.startswith("file:")


def _own(made: dict[str, Any]) -> tuple[list[dict], dict]:
    """The commit and checksum made aside, as a new table's own: a new id, times and transaction."""
    now, txn = int(time.time() * 1000), str(uuid.uuid4())
    commit = []
    for action in made["commit"]:
        ((kind, body),) = action.items()
        body = dict(body)
        if kind == "metaData":
            body.update(id=str(uuid.uuid4()), createdTime=now)
            metadata = body
        elif kind == "commitInfo":
            body.update(timestamp=now, txnId=txn)
        commit.append({kind: body})
    return commit, {**made["checksum"], "txnId": txn, "metadata": metadata}


def _made_for(spark: SparkSession, statement: Callable[[str], str]) -> dict[str, Any]:
    """The first commit's actions and checksum Delta writes for ``statement`` in this session, or
    ``_NOT_POSSIBLE``."""
    held = _READ_ONCE.get()
    settings = held.of(spark) if held is not None else _shaping(spark)
    key = hashlib.sha256(json.dumps([spark.version, sorted(settings.items()), statement("<table>")]).encode()).hexdigest()[:32]
    with _lock:
        if key not in _made:
            kept = cache_home() / "first-commits" / f"{key}.json"
            try:
                _made[key] = _usable(json.loads(kept.read_text()))
            except UNREADABLE:  # none kept, or one this cannot use: made again
                _made[key] = _made_aside(spark, settings, statement)
                if _made[key] is not _NOT_POSSIBLE:  # a later process tries again
                    _keep(kept, _made[key])
        return _made[key]


def _keep(kept: Path, made: dict[str, Any]) -> None:
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        part = kept.with_name(f".{kept.name}.{uuid.uuid4()}")
        part.write_text(json.dumps(made))
        part.replace(kept)
    except OSError:
        pass  # a cache home this cannot write: the next process makes it again


def _made_aside(spark: SparkSession, settings: dict[str, str], statement: Callable[[str], str]) -> dict[str, Any]:
    # A session of its own, with this one's settings, writes the checksum: turning it on in this one
    # would make every commit running beside it write one as well.
    folder = tempfile.mkdtemp(prefix="rulewatch-table-")
    try:
        aside = spark.newSession()
        for name in {k for k in aside.conf.getAll if k.startswith(_SHAPING)} - settings.keys():
            aside.conf.unset(name)
        for name, value in settings.items():
            if aside.conf.get(name, None) != value:
                aside.conf.set(name, value)
        aside.conf.set("spark.databricks.delta.writeChecksumFile.enabled", "true")
        log = Path(folder, "table", "_delta_log")
        aside.sql(statement(table_ref(str(log.parent))))
        commit = [json.loads(line) for line in (log / COMMIT_0).read_text().splitlines() if line.strip()]
        return _usable({"commit": commit, "checksum": json.loads((log / CHECKSUM_0).read_text())})
    except Exception:  # a setting a new session cannot take, a commit not to copy: the statement's own way
        return _NOT_POSSIBLE
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _usable(made: Any) -> dict[str, Any]:
    """``made`` if every new table can take it as it is (module doc); else ValueError."""
    actions = {kind: body for action in made["commit"] for kind, body in action.items()}
    protocol, metadata = actions["protocol"], actions["metaData"]
    features = {*protocol.get("readerFeatures", ()), *protocol.get("writerFeatures", ())}
    if (
        len(made["commit"]) != 3
        or set(actions) != {"commitInfo", "metaData", "protocol"}
        or not features <= _FEATURES
        or not set(metadata.get("configuration") or {}) <= _PROPERTIES
        or "inCommitTimestamp" in actions["commitInfo"]
        or not isinstance(made["checksum"], dict)
    ):
        raise ValueError(f"not a first commit every new table can take as it is: {made}")
    return made
