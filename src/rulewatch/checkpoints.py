"""Checks a streaming checkpoint against the tables its query writes, before the query starts.

Spark silently starts a query from scratch when its checkpoint folder is missing or empty. For
rulewatch that would lose data: batch ids restart at 0, so the idempotent sinks (Delta ``txnAppId``
+ ``txnVersion``, see sinks.py) skip every batch id they already hold, and bronze re-ingests every
landed file. So before a query starts, the last batch planned in its checkpoint must be at least the
last batch any of its sinks committed; a damaged checkpoint file is reported by path instead of as a
stack trace from inside Spark. docs/reliability.md has the recovery steps the errors point to.

Both sides are read as plain files, so the check needs a local or mounted path (a UC volume);
on a ``scheme://`` lakehouse it is skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

from rulewatch.lakehouse import Lakehouse

RECOVERY = "see 'Recovery' in docs/reliability.md"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed safely: names the checkpoint and what to do."""


def _numbered(folder: Path) -> list[int]:
    """Batch ids of a checkpoint log folder (``offsets/``, ``commits/``), ignoring temp and crc files."""
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def _check_log_file(path: Path) -> None:
    """A Spark checkpoint log file is a version line (``v1``) followed by JSON lines."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        if not lines or not lines[0].startswith("v"):
            raise ValueError("no version line")
        for line in lines[1:]:
            json.loads(line)
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(
            f"checkpoint file {path} is corrupt ({err}); the query cannot resume from it. "
            f"Restore the checkpoint folder from a backup or rebuild the layer: {RECOVERY}"
        ) from None


def last_planned_batch(checkpoint: str) -> int:
    """The newest batch id in ``checkpoint/offsets`` (-1 if none), after checking the files Spark reads first."""
    root = Path(checkpoint)
    metadata = root / "metadata"
    if metadata.exists():
        try:
            json.loads(metadata.read_text(encoding="utf-8"))["id"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise CheckpointError(
                f"checkpoint file {metadata} is corrupt (expected JSON with the query id); "
                f"restore the checkpoint folder from a backup or rebuild the layer: {RECOVERY}"
            ) from None
    offsets = _numbered(root / "offsets")
    if offsets:
        _check_log_file(root / "offsets" / str(offsets[-1]))
    commits = _numbered(root / "commits")
    if commits:
        _check_log_file(root / "commits" / str(commits[-1]))
    return offsets[-1] if offsets else -1


def _transactions(log: Path) -> Iterator[dict]:
    """The ``txn`` actions of a Delta log: its newest checkpoint's, then every later commit's.

    Reading from the checkpoint on keeps this cheap on long-lived tables and still right after log
    cleanup has removed the early commit files.
    """
    checkpoint_version = -1
    if (log / "_last_checkpoint").exists():
        checkpoint_version = json.loads((log / "_last_checkpoint").read_text())["version"]
    for part in sorted(log.glob(f"{checkpoint_version:020d}.checkpoint*.parquet")):
        yield from (t for t in pq.read_table(part, columns=["txn"]).column("txn").to_pylist() if t)
    for commit in sorted(log.glob("*.json")):
        if int(commit.name.split(".")[0]) > checkpoint_version:
            lines = commit.read_text(encoding="utf-8").splitlines()
            yield from (json.loads(line)["txn"] for line in lines if line.startswith('{"txn"'))


def committed_batches(table: str, app_id_prefix: str) -> dict[str, int]:
    """``{txnAppId: last txnVersion}`` for the idempotent writers of ``table`` whose id starts with the prefix."""
    log = Path(table, "_delta_log")
    latest: dict[str, int] = {}
    for txn in _transactions(log) if log.is_dir() else ():
        if txn["appId"].startswith(app_id_prefix):
            latest[txn["appId"]] = max(latest.get(txn["appId"], -1), txn["version"])
    return latest


def check_checkpoint(checkpoint: str, sinks: list[tuple[str, str]]) -> None:
    """Fail with a clear error unless ``checkpoint`` is readable and not behind any of its ``sinks``.

    ``sinks``: (table, ``txnAppId`` prefix) pairs the query writes with (sinks.py); only those
    writers are compared, so a table another query also writes is fine.
    """
    if "://" in checkpoint:
        return
    planned = last_planned_batch(checkpoint)
    for table, app_id_prefix in sinks:
        for app_id, version in committed_batches(table, app_id_prefix).items():
            if version > planned:
                state = "is missing or empty" if planned < 0 else f"has batches only up to {planned}"
                raise CheckpointError(
                    f"checkpoint {checkpoint} {state}, but {table} already holds batch {version} of {app_id}. "
                    "Starting from it would number new batches from an old id, and the idempotent writes would "
                    f"skip them (data loss). Do not run until the checkpoint is restored or the layer rebuilt: {RECOVERY}"
                )


def _query_sinks(lakehouse: Lakehouse) -> dict[str, list[tuple[str, str]]]:
    """Checkpoint name -> the (table, txnAppId prefix) pairs its query writes.

    Tables a batch adds nothing to get no commit, but every batch of a layer writes its
    ``pipeline_metrics`` row, so the newest batch always shows there.
    """
    silver = [lakehouse.silver_transactions, lakehouse.silver_quarantine, lakehouse.silver_duplicates]
    gold = [lakehouse.alerts, lakehouse.window_metrics, lakehouse.late_events, lakehouse.rule_errors]
    tables = {
        "bronze": [lakehouse.bronze_transactions],
        "silver": silver,
        "ingest": [lakehouse.bronze_transactions, *silver],
        "gold": gold,
    }
    sinks = {
        query: [(t, f"rulewatch.{query}.") for t in written] + [(lakehouse.pipeline_metrics, f"rulewatch.metrics.{query}")]
        for query, written in tables.items()
    }
    sinks["rule_history"] = [(lakehouse.rule_history, "rulewatch.gold.rule_history")]
    return sinks


# The job ingests the landing folder with the bronze and silver queries, live mode with the one
# ingest query (ingest.py). Each reads every landed file, so a lakehouse used both ways would hold
# every line twice.
INGEST_WAYS = {"bronze": "the batch job", "silver": "the batch job", "ingest": "live mode (rulewatch stream / demo)"}


def _check_one_ingest_way(lakehouse: Lakehouse, query: str) -> None:
    if query not in INGEST_WAYS:
        return
    for other, way in INGEST_WAYS.items():
        if way != INGEST_WAYS[query] and Path(lakehouse.checkpoint(other)).exists():
            raise CheckpointError(
                f"{lakehouse.root} was ingested by {way} (checkpoint {lakehouse.checkpoint(other)}); "
                f"{INGEST_WAYS[query]} would read every landed file again. Use another lakehouse folder for it."
            )


def check_queries(lakehouse: Lakehouse, *queries: str) -> None:
    """``check_checkpoint`` for each named rulewatch query (bronze, silver, ingest, gold, rule_history) of ``lakehouse``.

    Also refuses to start an ingest query on a lakehouse the other ingest way has used."""
    sinks = _query_sinks(lakehouse)
    for query in queries:
        _check_one_ingest_way(lakehouse, query)
        check_checkpoint(lakehouse.checkpoint(query), sinks[query])
