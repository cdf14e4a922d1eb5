"""Checks a streaming checkpoint against the tables its query writes, before the query starts.

Spark silently starts a query from scratch when its checkpoint folder is missing or empty. For
rulewatch that would lose data: batch ids restart at 0, so the idempotent sinks (sinks.py) skip
every batch id they already hold, and bronze re-ingests every landed file. So before a query
starts, the last batch planned in its checkpoint must be at least the last batch any of its sinks
committed; a damaged checkpoint file is reported by path instead of as a stack trace from inside
Spark. The other way round, every table must still hold every batch the checkpoint has committed
(a lost Delta commit), and a stateful query its state folders.
docs/reliability.md has the recovery steps the errors point to.

Both sides are read as plain files, so the check needs a local or mounted path (a UC volume);
on a ``scheme://`` lakehouse it is skipped. Unity Catalog managed tables (``Lakehouse.schema``)
give no path to their Delta log: there the tables' side comes through Spark instead
(:class:`CatalogCommits`), from the (sink, batch) each commit carries as ``userMetadata`` and the
metrics table's rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol
from urllib.parse import unquote

import pyarrow.parquet as pq

from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.storage.delta_log import RECOVERY, CheckpointError, actions, committed_batches
from rulewatch.spark.storage.metrics import flush_pending, metrics_sink
from rulewatch.spark.storage.sinks import HISTORY_SINK, history_batches, sink_name

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


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
            if line != "-":  # a source with no offset yet
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


def delta_version_read(checkpoint: str, table_id: str) -> int | None:
    """The newest version of the Delta table with id ``table_id`` that the query's newest committed batch
    had read through, from that batch's offsets; None: no committed batch, or none reading that table."""
    committed = _numbered(Path(checkpoint, "commits"))
    if not committed:
        return None
    # A negative index (before the version's first change) means nothing of that version was read.
    offset = _delta_offsets(Path(checkpoint), committed[-1]).get(table_id)
    if offset is not None:
        version = offset["reservoirVersion"]
        return version - 1 if offset["index"] < 0 else version
    # No offset yet: a rescaled gold's source has read nothing since where the old query stopped.
    record = gold_record(checkpoint)
    name = next((name for name, source in record.get(SOURCE_IDS, {}).items() if source == table_id), None)
    return None if name is None else int(record[STARTING_VERSIONS][name]) - 1


def _delta_offsets(root: Path, batch: int) -> dict[str, dict]:
    """Each Delta source's end offset after ``batch``, by table id.

    After the version line and the batch's metadata, each source's end offset ("-": none yet); a Delta
    source's offset names its table by id."""
    lines = (root / "offsets" / str(batch)).read_text(encoding="utf-8").splitlines()[2:]
    offsets = (json.loads(line) for line in lines if line.startswith("{"))
    return {offset["reservoirId"]: offset for offset in offsets if "reservoirId" in offset}


def _rows_written(metrics_table: str, layers: list[str]) -> dict[str, int]:
    """Table -> the newest batch of ``layers`` that appended rows to it, per ``pipeline_metrics``."""
    log = Path(metrics_table, "_delta_log")
    live: dict[str, None] = {}
    for kind, action in actions(log, ("add", "remove")) if log.is_dir() else ():
        if kind == "add":
            live[action["path"]] = None
        else:
            live.pop(action["path"], None)
    newest: dict[str, int] = {}
    for path in live:
        part = pq.ParquetFile(Path(metrics_table, unquote(path)))
        if "rows_written" not in part.schema_arrow.names:
            continue  # written before the column existed
        for row in part.read(columns=["layer", "batch_id", "rows_written"]).to_pylist():
            if row["layer"] in layers:
                for table, rows in row["rows_written"] or ():
                    if rows:
                        newest[table] = max(newest.get(table, -1), row["batch_id"])
    return newest


class Commits(Protocol):
    """What the checks need to know of the tables' commits."""

    def committed_batches(self, table: str, app_id_prefix: str) -> dict[str, int]: ...

    def rows_written(self, metrics_table: str, layers: list[str]) -> dict[str, int]: ...


class LogFiles:
    """Path tables: their Delta logs and the metrics table's Parquet files, read as files."""

    def committed_batches(self, table: str, app_id_prefix: str) -> dict[str, int]:
        return committed_batches(table, app_id_prefix)

    def rows_written(self, metrics_table: str, layers: list[str]) -> dict[str, int]:
        return _rows_written(metrics_table, layers)


@dataclass
class CatalogCommits:
    """Catalog tables, through Spark: ``DESCRIBE HISTORY`` (the newest ``HISTORY_DEPTH`` commits, each
    with the ``userMetadata`` ``sinks.append_once`` gives it) and the metrics table read as a table."""

    spark: "SparkSession"

    def committed_batches(self, table: str, app_id_prefix: str) -> dict[str, int]:
        from rulewatch.spark.storage import tables

        if not tables.exists(self.spark, table):
            return {}
        return history_batches(self.spark, table, app_id_prefix)

    def rows_written(self, metrics_table: str, layers: list[str]) -> dict[str, int]:
        from pyspark.sql import functions as F

        from rulewatch.spark.storage import tables

        if not tables.exists(self.spark, metrics_table):
            return {}
        written = (
            tables.read(self.spark, metrics_table)
            .where(F.col("layer").isin(layers))
            .select("batch_id", F.explode("rows_written").alias("table", "rows"))
            .where(F.col("rows") > 0)
            .groupBy("table")
            .agg(F.max("batch_id").alias("batch_id"))
        )
        return {row.table: row.batch_id for row in written.collect()}


def check_checkpoint(checkpoint: str, sinks: list[tuple[str, str]], commits: Commits = LogFiles()) -> None:
    """Fail with a clear error unless ``checkpoint`` is readable and not behind any of its ``sinks``.

    ``sinks``: (table, ``txnAppId`` prefix) pairs the query writes with (sinks.py); only those
    writers are compared, so a table another query also writes is fine.
    """
    if "://" in checkpoint:
        return
    planned = last_planned_batch(checkpoint) + batch_base(checkpoint)
    for table, app_id_prefix in sinks:
        for app_id, version in commits.committed_batches(table, app_id_prefix).items():
            if version > planned:
                state = "is missing or empty" if planned < 0 else f"has batches only up to {planned}"
                raise CheckpointError(
                    f"checkpoint {checkpoint} {state}, but {table} already holds batch {version} of {app_id}. "
                    "Starting from it would number new batches from an old id, and the idempotent writes would "
                    f"skip them (data loss). Do not run until the checkpoint is restored or the layer rebuilt: {RECOVERY}"
                )


GOLD_LAYOUT = "rulewatch-layout.json"  # in gold's checkpoint folder, beside Spark's own files
SHARD_PARTITIONS = "shard_partitions"  # in it since the shards' labels were spread (engine.shards)
GOLD_SOURCE = "source"  # what gold reads: "silver", or a Kafka source's identity (layers/gold.py)
# Kept in it by a rescale (layers/rescale.py), whose new checkpoint continues the old one's query:
BATCH_BASE = "batch_base"  # added to the checkpoint's batch ids in every table gold writes
WATERMARK_FLOOR = "watermark_floor_ms"  # the old query's watermark: no event it would call late is evaluated
STARTING_VERSIONS = "starting_versions"  # where each Delta source of the first batch starts
SOURCE_IDS = "source_ids"  # those sources' Delta table ids
SILVER_AFTER_BATCH = "silver_after_batch"  # silver's newest batch id the old query read (rows after it are new)
RESCALED_FROM = "rescaled_from"  # the old shard count and its last batch, for people


def gold_source(checkpoint: str) -> str | None:
    """What gold's checkpoint reads (``check_gold_layout``'s ``source``), as far as it says; None: a new one.

    Its record's, once a start has written it; "silver" for one that planned a batch before records named
    their source, and for a ``scheme://`` checkpoint, which keeps no record (there, only an explicit
    choice reads the topic)."""
    if "://" in checkpoint:
        return "silver"
    stored = gold_record(checkpoint).get(GOLD_SOURCE)
    if stored is not None:
        return stored
    begun = has_run(checkpoint) or (Path(checkpoint, "offsets").exists() and last_planned_batch(checkpoint) >= 0)
    return "silver" if begun else None


def gold_record(checkpoint: str) -> dict:
    """Gold's layout record (``{}``: none, or a ``scheme://`` checkpoint)."""
    record = Path(checkpoint) / GOLD_LAYOUT
    if "://" in checkpoint or not record.exists():
        return {}
    return json.loads(record.read_text(encoding="utf-8"))


def has_run(checkpoint: str) -> bool:
    """Whether the checkpoint's query has committed a batch."""
    return bool(_numbered(Path(checkpoint) / "commits"))


def batch_base(checkpoint: str) -> int:
    """What the checkpoint's batch ids are offset by in the tables its query writes (0 unless gold was rescaled)."""
    return int(gold_record(checkpoint).get(BATCH_BASE, 0))


def committed_sources(checkpoint: str) -> tuple[int, int, dict[str, int]]:
    """The newest committed batch, the watermark the next batch would use, and each Delta source's next
    version to read (by table id) after that batch. A source that has read nothing yet has no offset
    (``-``) and is left out.

    Raises CheckpointError when a source stopped inside a version (its offset's index is not negative),
    which a new query could not start from exactly."""
    root = Path(checkpoint)
    committed = _numbered(root / "commits")
    if not committed:
        raise CheckpointError(f"checkpoint {checkpoint} has no committed batch")
    last = committed[-1]
    for folder in ("offsets", "commits"):
        _check_log_file(root / folder / str(last))
    commit = json.loads((root / "commits" / str(last)).read_text(encoding="utf-8").splitlines()[1])
    offsets = _delta_offsets(root, last)
    for table_id, offset in offsets.items():
        if offset["index"] >= 0:
            raise CheckpointError(
                f"batch {last} of {checkpoint} stopped inside version {offset['reservoirVersion']} of Delta table "
                f"{table_id}; run gold once more (it then reads to the end of the versions there are)"
            )
    return last, int(commit.get("nextBatchWatermarkMs", 0)), {table_id: int(o["reservoirVersion"]) for table_id, o in offsets.items()}


def as_flags(layout: dict[str, int]) -> str:
    return " ".join(f"--{name.replace('_', '-')} {value}" for name, value in layout.items())


def gold_layout(checkpoint: str, asked: dict[str, int | None], defaults: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """The shards and state layout to run gold with: each value asked for, else the one the checkpoint
    began with, else the default; and the values the checkpoint supplied that differ from the defaults.

    So a lakehouse begun with other values (flags, the bundle's, or ``run``'s 16 shards before 4 became
    the default) resumes without its flags; a value given that differs from the record is still
    refused by :func:`check_gold_layout`.
    """
    stored = gold_record(checkpoint) if has_run(checkpoint) else {}
    filled = {name: int(stored[name]) for name, value in asked.items() if value is None and name in stored}
    layout = {name: asked[name] if asked[name] is not None else filled.get(name, defaults[name]) for name in asked}
    return layout, {name: value for name, value in filled.items() if value != defaults[name]}


def check_gold_layout(checkpoint: str, layout: dict[str, int], partitions: int = 0, rescaling: bool = False, source: str = "silver") -> int:
    """Refuse to resume gold with another shard count or state layout than it began with; record them.

    A key's window history lives in the shard its hash picked, and a rule change reaches only the
    shards the query had when it read the change: with another count, keys move to shards without
    their history or without any rule, and detection silently stops for them. A checkpoint with no
    committed batch yet takes the layout it is given (as does one from before the record existed).

    Returns the partition count the shards' labels are spread over (``engine.shards``): a new
    checkpoint's ``partitions``, the record's for one that has run, 0 (labels 0 .. shards-1) for one
    whose record predates it, and for a ``scheme://`` checkpoint, where no record is kept.

    A rescale's new checkpoint before its first batch (``rescaling``: the rescale itself) runs only
    from the rescale, which hands it the old state; any other start would begin without it.

    ``source``: what gold reads, silver or a Kafka topic itself (layers/gold.py): the checkpoint's
    offsets are that source's, so it is kept too.
    """
    if "://" in checkpoint:
        return 0
    record = Path(checkpoint) / GOLD_LAYOUT
    ran = has_run(checkpoint)
    stored = gold_record(checkpoint)
    if STARTING_VERSIONS in stored and not ran and not rescaling:
        raise CheckpointError(
            f"gold's rescale to {stored.get('shards')} shards did not finish (checkpoint {checkpoint} has not run yet "
            f"and the old state waits beside it): run `rulewatch gold rescale --shards {stored.get('shards')}` on this "
            "lakehouse again to finish it"
        )
    if record.exists() and ran:
        read = stored.get(GOLD_SOURCE, "silver")
        if read != source:
            raise CheckpointError(
                f"gold checkpoint {checkpoint} reads {read}; this run asks it to read {source}. Its offsets are "
                f"{read}'s: run as it began, or rebuild gold ({RECOVERY})."
            )
        began_with = {name: stored.get(name) for name in layout}
        if began_with != layout:
            began = as_flags(began_with)
            raise CheckpointError(
                f"gold checkpoint {checkpoint} began with {began}; this run asks for {as_flags(layout)}. Keys would move to "
                f"shards without their window history or rules and alerts would be missed silently. Run with "
                f"{began}; `rulewatch gold rescale --shards N` moves the state to another shard count (docs/scale.md); "
                f"the state layout is kept for good, short of rebuilding gold ({RECOVERY})."
            )
        return int(stored.get(SHARD_PARTITIONS, 0))
    spread = 0 if ran else partitions  # a checkpoint that ran before the record kept labels 0 .. shards-1
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({**stored, **layout, SHARD_PARTITIONS: spread, GOLD_SOURCE: source}) + "\n", encoding="utf-8")
    return spread


# The pipeline_metrics rows each query writes, by layer (the ingest query writes both of its layers').
QUERY_LAYERS = {"bronze": ["bronze"], "silver": ["silver"], "ingest": ["bronze", "silver"], "gold": ["gold"]}
STATEFUL = {"gold"}


def check_tables_not_behind(lakehouse: Lakehouse, query: str, sinks: list[tuple[str, str]], commits: Commits = LogFiles()) -> None:
    """Fail unless every table holds every batch the query's checkpoint says it committed.

    The other direction of ``check_checkpoint``: a lost commit (the newest one of a table) would
    otherwise go unnoticed, because the checkpoint never replays a committed batch. Every batch
    writes a ``pipeline_metrics`` row naming the rows it appended per table, so: the metrics table
    must hold the checkpoint's last committed batch, and each table the newest batch that wrote to it.
    """
    checkpoint = Path(lakehouse.checkpoint(query))
    committed = _numbered(checkpoint / "commits")
    if "://" in lakehouse.root or not committed or query not in QUERY_LAYERS:
        return
    if query in STATEFUL:
        _check_state(checkpoint, committed[-1])
    last = committed[-1] + batch_base(str(checkpoint))
    metrics = lakehouse.pipeline_metrics
    recorded = max(commits.committed_batches(metrics, metrics_sink(query)).values(), default=-1)
    if recorded < last:
        raise CheckpointError(
            f"checkpoint {checkpoint} has committed batch {last}, but {metrics} holds the {query} query's "
            f"rows only up to batch {recorded}: commits of that table are lost. Do not run until they are restored "
            f"or the layer rebuilt: {RECOVERY}"
        )
    newest = commits.rows_written(metrics, QUERY_LAYERS[query])
    for table, app_id_prefix in sinks:
        wrote = newest.get(lakehouse.name_of(table), -1)
        holds = max(commits.committed_batches(table, app_id_prefix).values(), default=-1)
        if holds < wrote:
            raise CheckpointError(
                f"{table} has lost rows: batch {wrote} of the {query} query appended to it (gold/pipeline_metrics), "
                f"but its newest commit from that query is batch {holds}. A commit was removed or lost; do not run "
                f"until it is restored or the layer rebuilt: {RECOVERY}"
            )


def _check_state(checkpoint: Path, last_committed: int) -> None:
    """A stateful query that has committed a batch must still have its state store folders."""
    offsets = checkpoint / "offsets" / str(max(_numbered(checkpoint / "offsets")))
    conf = json.loads(offsets.read_text(encoding="utf-8").splitlines()[1]).get("conf", {})
    partitions = int(conf.get("spark.sql.shuffle.partitions", "0"))
    missing = [p for p in range(partitions) if not (checkpoint / "state" / "0" / str(p)).is_dir()]
    if missing or not (checkpoint / "state").is_dir():
        raise CheckpointError(
            f"checkpoint {checkpoint} has committed batch {last_committed} but its state "
            f"({checkpoint / 'state'}{f', partitions {missing}' if missing else ''}) is gone: the evaluator would "
            f"start without the windows it holds and miss alerts. Restore the folder, or rebuild gold: {RECOVERY}"
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
        query: [(t, sink_name(query)) for t in written] + [(lakehouse.pipeline_metrics, metrics_sink(query))]
        for query, written in tables.items()
    }
    sinks["rule_history"] = [(lakehouse.rule_history, HISTORY_SINK)]
    return sinks


# The job ingests the landing folder with the bronze and silver queries, live mode with the one
# ingest query (layers/ingest.py). Each reads every landed file, so a lakehouse used both ways would hold
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


def check_queries(lakehouse: Lakehouse, *queries: str, spark: "SparkSession | None" = None) -> None:
    """``check_checkpoint`` for each named rulewatch query (bronze, silver, ingest, gold, rule_history) of ``lakehouse``.

    Also refuses to start an ingest query on a lakehouse the other ingest way has used. A lakehouse
    of catalog tables needs ``spark`` to see their commits. First appends the metrics rows a live
    run left pending (metrics.Recorder): they record committed writes, and the checks read them."""
    if lakehouse.schema and spark is None:
        raise ValueError(f"checking the catalog tables of {lakehouse.schema} needs a SparkSession (spark=...)")
    commits: Commits = CatalogCommits(spark) if lakehouse.schema else LogFiles()
    sinks = _query_sinks(lakehouse)
    for query in queries:
        _check_one_ingest_way(lakehouse, query)
        flush_pending(spark, lakehouse, query, at_start=True)
        check_checkpoint(lakehouse.checkpoint(query), sinks[query], commits)
        check_tables_not_behind(lakehouse, query, sinks[query], commits)
