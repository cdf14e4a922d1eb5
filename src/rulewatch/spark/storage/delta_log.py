"""A Delta table's log read as plain files: which (sink, batch) its commits name, and whether they only append.

Every idempotent append (sinks.py) names its (sink, batch) in its commit's ``userMetadata``, and
a run's first batch also leaves Delta's ``txn`` record. Reading them from ``_delta_log`` takes
about a millisecond, against 0.2-0.5 s for a ``DESCRIBE HISTORY`` (5 s for a process's first),
so path tables are read this way; Unity Catalog managed tables give no path and go through Spark
(``sinks.history_batches``). sinks.py, checkpoints.py and tables.py read through this module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timedelta, timezone
from urllib.parse import unquote
from itertools import chain
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

RECOVERY = "see 'Recovery' in docs/reliability.md"
# An add action's path with a scheme (s3://..., file:/...) names a file outside the table's folder (a shallow clone's).
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")

# A bound on the commits read per table: the newest commits are the ones compared, and reading a
# long-lived table's whole history (one commit per micro-batch) would cost more than the run.
HISTORY_DEPTH = 1000
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


# What reading a log as files raises for a log these reads do not understand, or a file removed meanwhile:
# the callers then ask Spark instead.
UNREADABLE = (OSError, ValueError, KeyError, TypeError)


class CheckpointError(RuntimeError):
    """A checkpoint or table that cannot be resumed safely: names the path and what to do."""


def batch_metadata(sink: str, batch_id: int, also: Mapping[str, int] | None = None) -> str:
    """The ``userMetadata`` of batch ``batch_id``'s commit by ``sink``; ``also``: other sinks' batches
    the same commit holds (``{sink: batch}``; metrics rows of several queries appended at once)."""
    return json.dumps({"txnAppId": sink, "txnVersion": batch_id, **({"alsoBatches": dict(also)} if also else {})})


def sink_batches(user_metadata: Any) -> list[tuple[str, int]]:
    """The (sink, batch) pairs a commit's ``userMetadata`` names (none: no metadata, or someone else's)."""
    try:
        txn = json.loads(user_metadata)
        named = {txn["txnAppId"]: txn["txnVersion"], **txn.get("alsoBatches", {})}
        return [(sink, int(batch)) for sink, batch in named.items() if isinstance(sink, str)]
    except (ValueError, KeyError, TypeError, AttributeError):
        return []


def newest_per_sink(found: Iterable[tuple[str, int]], app_id_prefix: str) -> dict[str, int]:
    """``{sink: newest batch}`` of the (sink, batch) pairs whose sink starts with the prefix."""
    latest: dict[str, int] = {}
    for pair in found:
        if pair[0].startswith(app_id_prefix):
            latest[pair[0]] = max(latest.get(pair[0], -1), pair[1])
    return latest


def _log_versions(log: Path) -> tuple[int, list[int]]:
    """(newest checkpoint version or -1, the commit versions after it), refusing a gap.

    Delta reads a table as the checkpoint plus every later commit; a commit file missing from that
    run (removed by hand, lost on object storage) silently drops its rows if it was the newest one,
    or breaks every read if not. Either way nothing more may be written before it is restored.
    """
    checkpoint_version = -1
    if (log / "_last_checkpoint").exists():
        checkpoint_version = json.loads((log / "_last_checkpoint").read_text())["version"]
    versions = sorted(int(p.name.split(".")[0]) for p in log.glob("*.json") if p.name.split(".")[0].isdigit())
    later = [v for v in versions if v > checkpoint_version]
    expected = range(checkpoint_version + 1, (later[-1] + 1) if later else checkpoint_version + 1)
    missing = sorted(set(expected) - set(later))
    if missing:
        raise CheckpointError(
            f"Delta table {log.parent} is missing commit {missing[0]} ({log / f'{missing[0]:020d}.json'}): its rows "
            f"are no longer part of the table. Do not run until it is restored (from a backup or a versioned "
            f"bucket), or rebuild the table's layer: {RECOVERY}"
        )
    return checkpoint_version, later


def _versions_through(log: Path, version: int) -> tuple[int, list[int]]:
    """(the newest checkpoint at or before ``version`` or -1, the commits after it through ``version``):
    what Delta reads for an older version. FileNotFoundError once log cleanup has removed one of them."""
    checkpoints = {int(p.name.split(".")[0]) for p in log.glob("*.checkpoint*.parquet")}
    base = max((v for v in checkpoints if v <= version), default=-1)
    commits = list(range(base + 1, version + 1))
    missing = [v for v in commits if not (log / f"{v:020d}.json").exists()]
    if missing:
        raise FileNotFoundError(f"version {version} of {log.parent} is no longer in its log: {log / f'{missing[0]:020d}.json'} is gone")
    return base, commits


def actions(log: Path, kinds: tuple[str, ...], version: int | None = None) -> Iterator[tuple[str, dict]]:
    """The ``kinds`` actions (``txn``, ``add``, ``remove``, ``protocol``, ``metaData``...) of a Delta log: its newest checkpoint's, then every later commit's
    (with ``version``: the table's actions up to that version instead).

    Reading from the checkpoint on keeps this cheap on long-lived tables and still right after log
    cleanup has removed the early commit files.
    """
    checkpoint_version, later = _log_versions(log) if version is None else _versions_through(log, version)
    for part in sorted(log.glob(f"{checkpoint_version:020d}.checkpoint*.parquet")):
        table = pq.read_table(part, columns=list(kinds))
        for kind in kinds:
            yield from ((kind, a) for a in table.column(kind).to_pylist() if a)
    for version in later:
        for line in (log / f"{version:020d}.json").read_text(encoding="utf-8").splitlines():
            action = json.loads(line)
            yield from ((kind, action[kind]) for kind in kinds if kind in action)


def whole_history_is_appends(table: str) -> bool:
    """Whether the path table's log still holds every commit since version 0, has no checkpoint yet
    (its commits before the first, small files read one by one), and after the creation only appended:
    no commit removed data or changed the schema (an older release's table given new columns).

    Then streaming the table from version 0 yields exactly its current rows, in commit order.
    """
    log = Path(table, "_delta_log")
    if (log / "_last_checkpoint").exists() or not (log / f"{0:020d}.json").exists():
        return False
    found = list(actions(log, ("remove", "metaData")))
    removed = any(kind == "remove" and action.get("dataChange", True) for kind, action in found)
    return not removed and sum(kind == "metaData" for kind, _ in found) <= 1


def _newest_commits(log: Path) -> tuple[list[Path], bool]:
    """The newest ``HISTORY_DEPTH`` commit files, newest first, and whether they are the whole log: every
    version from 0 to the newest has its file, and none is left out."""
    commits = sorted((p for p in log.glob("*.json") if p.stem.isdigit()), key=lambda p: int(p.stem), reverse=True)
    whole = bool(commits) and int(commits[-1].stem) == 0 and int(commits[0].stem) == len(commits) - 1 and len(commits) <= HISTORY_DEPTH
    return commits[:HISTORY_DEPTH], whole


def _named_in(commit: Path) -> list[tuple[str, int]] | None:
    """The (sink, batch) pairs a commit names, in its ``userMetadata`` and its ``txn`` actions; None when
    the file is gone (removed by Delta's log cleanup since the listing: older than its retention)."""
    try:
        lines = commit.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return None
    return [
        *(pair for line in lines if line.startswith('{"commitInfo"') for pair in sink_batches(json.loads(line)["commitInfo"].get("userMetadata"))),
        *((txn["appId"], txn["version"]) for line in lines if line.startswith('{"txn"') for txn in [json.loads(line)["txn"]]),
    ]


def committed_batches(table: str, app_id_prefix: str) -> dict[str, int]:
    """``{sink: newest batch}`` for the idempotent writers of ``table`` whose name starts with the prefix.

    From Delta's ``txn`` records (which a run's first batch may write, sinks.replay_check) and the
    ``userMetadata`` of the newest ``HISTORY_DEPTH`` commits (which every append writes).
    """
    log = Path(table, "_delta_log")
    if not log.is_dir():
        return {}
    txns = ((txn["appId"], txn["version"]) for _, txn in actions(log, ("txn",)))
    named = (pair for commit in _newest_commits(log)[0] for pair in _named_in(commit) or ())
    return newest_per_sink(chain(txns, named), app_id_prefix)


def newest_committed_batch(table: str, sink: str) -> int:
    """The newest batch ``sink`` appended to the path table ``table`` (-1: none), reading few files.

    Commits are read newest first and the first one naming the sink answers: one sink's batches
    commit in order. Only a sink that none of the newest ``HISTORY_DEPTH`` commits names falls back
    to Delta's ``txn`` records. On a mounted volume every file read is a round trip to object
    storage, so this stops as soon as it can.
    """
    told = batch_told_by_commits(table, sink)
    if told is not None:
        return told
    return max((txn["version"] for _, txn in actions(Path(table, "_delta_log"), ("txn",)) if txn["appId"] == sink), default=-1)


def batch_told_by_commits(table: str, sink: str) -> int | None:
    """The newest batch ``sink`` appended to the path table ``table`` (-1: none) as its commit files tell
    it, newest first: the first commit naming the sink (in its ``userMetadata`` or a ``txn`` action)
    answers. None when they cannot tell: no commit read names the sink, and not every commit since
    version 0 was read (past ``HISTORY_DEPTH``, or removed by log cleanup), so older ones might."""
    commits, whole = _newest_commits(Path(table, "_delta_log"))
    for commit in commits:
        named = _named_in(commit)
        if named is None:
            whole = False
            continue
        batches = [batch for found, batch in named if found == sink]
        if batches:
            return max(batches)
    return -1 if whole else None


def table_version(table: str) -> tuple[str, int] | None:
    """(the path table's id, its newest version) from its log; None: no log here."""
    log = Path(table, "_delta_log")
    if not log.is_dir():
        return None
    checkpoint_version, later = _log_versions(log)
    *_, (_, metadata) = actions(log, ("metaData",))
    return metadata["id"], later[-1] if later else checkpoint_version


def column_names(table: str) -> list[str] | None:
    """The column names of the path table's newest schema, from its log (None: no log here, or
    no schema in it)."""
    log = Path(table, "_delta_log")
    if not log.is_dir():
        return None
    found = [action for _, action in actions(log, ("metaData",))]
    return [f["name"] for f in json.loads(found[-1]["schemaString"])["fields"]] if found else None


def live_files(table: str, version: int | None = None, counts: bool = True) -> list[dict[str, Any]] | None:
    """The ``add`` actions of the path table's current version (or ``version``), read as plain files; None
    when its rows cannot be read from them alone: no log here, partition columns, column mapping,
    deletion vectors, any other reader feature, a file outside the table's folder, or (``counts``, which
    ``numRecords`` then gives) a file without its row count. ``path`` is made absolute."""
    log = Path(table, "_delta_log")
    if not log.is_dir():
        return None
    # A file is named by its path and deletion vector: a commit that adds a deletion vector to a file
    # adds it again with the vector and removes the version without, in either order.
    def named(action: dict[str, Any]) -> tuple[str, Any]:
        dv = action.get("deletionVector") or {}
        return action["path"], (dv.get("storageType"), dv.get("pathOrInlineDv"), dv.get("offset"))

    live: dict[tuple[str, Any], dict[str, Any]] = {}
    protocol = None
    for kind, action in actions(log, ("protocol", "metaData", "add", "remove"), version):
        if kind == "protocol":
            protocol = action
            if action.get("minReaderVersion", 1) > 1:  # a reader feature (v2 checkpoints, type widening...) these reads do not know
                return None
        elif kind == "metaData":
            configuration = dict(action.get("configuration") or {})  # a checkpoint's map column reads as pairs
            mapping = configuration.get("delta.columnMapping.mode", "none")
            if action.get("partitionColumns") or mapping != "none":
                return None
        elif kind == "add":
            live[named(action)] = action
        else:
            live.pop(named(action), None)
    if protocol is None:  # a checkpoint these reads did not find (a v2 one written as JSON): its files are unknown
        return None
    files = []
    for add in live.values():
        stats = json.loads(add.get("stats") or "{}")
        if add.get("deletionVector") or (counts and "numRecords" not in stats) or _URI.match(add["path"]):
            return None
        files.append({**add, "path": str(Path(table, unquote(add["path"]))), "numRecords": stats.get("numRecords")})
    return files


def column_values(files: list[dict[str, Any]], columns: list[str]) -> Iterator[tuple]:
    """The rows' values of ``columns`` in ``live_files``' files, read as Delta reads them: None for a
    column added to the table after a file was written."""
    for file in files:
        with pq.ParquetFile(file["path"]) as parquet:
            found = parquet.read(columns=[c for c in columns if c in parquet.schema_arrow.names]).to_pydict()
            rows = parquet.metadata.num_rows
        yield from zip(*(found.get(c, [None] * rows) for c in columns))


def may_hold(add: dict[str, Any], column: str, low_ms: int, high_ms: int) -> bool:
    """Whether a file (a ``live_files`` entry) may hold a value of the timestamp ``column`` within
    [``low_ms``, ``high_ms``] (epoch milliseconds) by its statistics: False only when they rule it out.

    Delta writes a timestamp's statistics truncated to milliseconds, so a maximum is taken as up to
    one millisecond more; a value without a time zone, or none at all, rules nothing out."""
    stats = json.loads(add.get("stats") or "{}")
    bounds = [(stats.get(side) or {}).get(column) for side in ("minValues", "maxValues")]
    if not all(isinstance(bound, str) for bound in bounds):
        return True
    try:
        first, last = (datetime.fromisoformat(bound) for bound in bounds)
    except ValueError:
        return True
    if first.tzinfo is None or last.tzinfo is None:
        return True
    ms = timedelta(milliseconds=1)  # whole milliseconds, not a float's: a bound equal to a limit must stay equal
    return (first - _EPOCH) // ms <= high_ms and (last - _EPOCH) // ms + 1 >= low_ms
