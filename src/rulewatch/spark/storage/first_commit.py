"""A new path table created by writing the first commit Delta wrote for the same statement aside.

A CREATE TABLE costs a SQL statement and Delta's commit path: a fresh lakehouse's 12 tables took
1.1-1.8 s of a warm session and 4.7 s of a new process's (docs/testing.md), paid by every test,
notebook and first run on a new lakehouse. The first commit of a new path table holds only its protocol,
its metadata and the commit's info, which depend on the statement, the Spark and Delta releases and the
session's Delta settings alone. So Delta makes it once, for a table in a folder aside, and it is kept (in
this process and in the cache home, for the next); each new table then gets that commit with an id and
times of its own, put only if absent, as Delta's log store puts a commit.

The version checksum Delta writes beside a commit (``.crc``, off for this project's own commits: session.py)
is made aside too and written beside each table's first commit: without it, a table Delta has not created
in this session has its protocol and metadata read back by a Spark job at its first use, which cost more
than the statement saved (a fixture run 8.4-13.1 s against 6.8-8.5 s through SQL, docs/testing.md).

Only for a table this process can write as Delta would: a plain local path, a classic session on this
machine, and no folder there yet (an existing folder is left to Delta, which says what is wrong with it).
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
from pathlib import Path
from typing import Any, Callable

from pyspark.sql import SparkSession

from rulewatch.spark.runtime.env import cache_home, is_databricks
from rulewatch.spark.runtime.jars import DELTA_VERSION
from rulewatch.spark.runtime.session import is_connect
from rulewatch.spark.storage.delta_log import UNREADABLE
from rulewatch.spark.storage.lakehouse import is_table_name, table_ref

COMMIT_0 = f"{0:020d}.json"
CHECKSUM_0 = f"{0:020d}.crc"
_DELTA = "spark.databricks.delta."
# Delta's note of the session's newest commit: changes with every commit, shapes none.
_SESSION_VERSION = _DELTA + "lastCommitVersionInSession"
_made: dict[str, dict[str, Any]] = {}
_lock = threading.Lock()


def create(spark: SparkSession, table: str, statement: Callable[[str], str]) -> bool:
    """Create the path ``table`` as ``statement(table_ref)`` would; False where this cannot (the
    caller then runs the statement itself), or where another creator's commit came first."""
    # A Spark Connect session has no session of its own to make the checksum in (newSession).
    if is_table_name(table) or not os.path.isabs(table) or is_databricks() or is_connect(spark):
        return False
    folder = Path(table)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        return False
    try:
        commit, checksum = _own(_made_for(spark, statement))
    except UNREADABLE:  # a kept file this cannot use, a cache home it cannot write: Delta creates it
        return False
    log = folder / "_delta_log"
    log.mkdir(parents=True, exist_ok=True)
    (log / "_staged_commits").mkdir(exist_ok=True)  # as Delta leaves it
    staged = log / f".{COMMIT_0}.{uuid.uuid4()}.tmp"
    staged.write_text("".join(json.dumps(action, separators=(",", ":")) + "\n" for action in commit))
    try:
        os.link(staged, log / COMMIT_0)  # fails if a commit 0 is there: the other creator's stands
    except FileExistsError:
        return False
    finally:
        staged.unlink()
    staged.write_text(json.dumps(checksum, separators=(",", ":")))
    staged.replace(log / CHECKSUM_0)
    return True


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
            body.update(timestamp=now, txnId=txn, **({"inCommitTimestamp": now} if "inCommitTimestamp" in body else {}))
        commit.append({kind: body})
    checksum = {**made["checksum"], "txnId": txn, "metadata": metadata}
    if "inCommitTimestampOpt" in checksum:
        checksum["inCommitTimestampOpt"] = now
    return commit, checksum


def _made_for(spark: SparkSession, statement: Callable[[str], str]) -> dict[str, Any]:
    """The first commit's actions and checksum Delta writes for ``statement`` in this session."""
    settings = {k: v for k, v in spark.conf.getAll.items() if k.startswith(_DELTA) and k != _SESSION_VERSION}
    key = hashlib.sha256(json.dumps([spark.version, DELTA_VERSION, sorted(settings.items()), statement("<table>")]).encode()).hexdigest()[:32]
    with _lock:
        if key not in _made:
            kept = cache_home() / "first-commits" / f"{key}.json"
            if kept.exists():
                _made[key] = _checked(json.loads(kept.read_text()))
            else:
                _made[key] = _made_aside(spark, settings, statement)
                kept.parent.mkdir(parents=True, exist_ok=True)
                part = kept.with_name(f".{kept.name}.{uuid.uuid4()}")
                part.write_text(json.dumps(_made[key]))
                part.replace(kept)
        return _made[key]


def _made_aside(spark: SparkSession, settings: dict[str, str], statement: Callable[[str], str]) -> dict[str, Any]:
    # A session of its own, with this one's Delta settings, writes the checksum: turning it on in this
    # one would make every commit running beside it write one as well.
    aside = spark.newSession()
    for name, value in settings.items():
        aside.conf.set(name, value)
    aside.conf.set(_DELTA + "writeChecksumFile.enabled", "true")
    folder = tempfile.mkdtemp(prefix="rulewatch-table-")
    try:
        log = Path(folder, "table", "_delta_log")
        aside.sql(statement(table_ref(str(log.parent))))
        commit = [json.loads(line) for line in (log / COMMIT_0).read_text().splitlines() if line.strip()]
        checksum = json.loads((log / CHECKSUM_0).read_text())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return _checked({"commit": commit, "checksum": checksum})


def _checked(made: Any) -> dict[str, Any]:
    """``made`` if it is a first commit this module can give a table: protocol, metadata and commit info,
    and a checksum; else ValueError (the table is then left to Delta)."""
    kinds = sorted(kind for action in made["commit"] for kind in action)
    if kinds != ["commitInfo", "metaData", "protocol"] or not isinstance(made["checksum"], dict):
        raise ValueError(f"not a first commit of protocol, metadata and commit info with a checksum: {made}")
    return made
