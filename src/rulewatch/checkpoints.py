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


def check_checkpoint(checkpoint: str, layer: str, tables: list[str]) -> None:
    """Fail with a clear error unless ``checkpoint`` is readable and not behind any of ``tables``.

    The query writes ``tables`` with ``txnAppId`` ``rulewatch.<layer>.<table>`` (sinks.py); only
    those writers are compared, so a table another query also writes is fine.
    """
    if "://" in checkpoint:
        return
    planned = last_planned_batch(checkpoint)
    for table in tables:
        for app_id, version in committed_batches(table, f"rulewatch.{layer}.").items():
            if version > planned:
                state = "is missing or empty" if planned < 0 else f"has batches only up to {planned}"
                raise CheckpointError(
                    f"checkpoint {checkpoint} {state}, but {table} already holds batch {version} of {app_id}. "
                    "Starting from it would number new batches from an old id, and the idempotent writes would "
                    f"skip them (data loss). Do not run until the checkpoint is restored or the layer rebuilt: {RECOVERY}"
                )


def _query_sinks(lakehouse: Lakehouse) -> dict[str, tuple[str, list[str]]]:
    """Checkpoint name -> (layer its sink ids are named after, the tables it writes)."""
    return {
        "bronze": ("bronze", [lakehouse.bronze_transactions]),
        "silver": ("silver", [lakehouse.silver_transactions, lakehouse.silver_quarantine, lakehouse.silver_duplicates]),
        "gold": ("gold", [lakehouse.alerts, lakehouse.window_metrics, lakehouse.late_events, lakehouse.rule_errors]),
        "rule_history": ("gold", [lakehouse.rule_history]),
    }


def check_queries(lakehouse: Lakehouse, *queries: str) -> None:
    """``check_checkpoint`` for each named rulewatch query (bronze, silver, gold, rule_history) of ``lakehouse``."""
    sinks = _query_sinks(lakehouse)
    for query in queries:
        layer, tables = sinks[query]
        check_checkpoint(lakehouse.checkpoint(query), layer, tables)
