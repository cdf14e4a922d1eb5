"""The landing folder's side of "every landed line is accounted for".

Bronze proves every line it holds reached silver, quarantine or duplicates; this module proves the
files got into bronze whole. It compares three views of each file: the folder now, the files the
stream source listed (its checkpoint log), and what bronze recorded when it read the file (its size
and modification time). What cannot be reconciled is reported by path:

- listed by the source but gone before it was read (the source then reads nothing, silently);
- changed after it was read: a writer still appending, a torn last line completed later (the file
  source never reads a path twice, so the later lines would be lost);
- on disk before the run started, yet never listed.

The landing contract (docs/reliability.md): write a file under a name starting with ``.`` or ``_``
and rename it when complete. Such names are skipped by the reader and listed here as ignored.
Only a local or mounted landing folder is audited; on ``scheme://`` paths Auto Loader tracks files.

Symbolic links are not followed (Spark's listing would: a link back to the folder is read ~40 levels
deep, a link to a host file copies it into bronze), and a file with several names (hard links) is read
under one of them: lines read through a link or a repeated name are dropped before bronze
(``read_once``), and each is named in the report, as is anything that is not a regular file.
"""

from __future__ import annotations

import bz2
import gzip
import json
import os
import stat
import sys
import zlib
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from rulewatch.spark.storage.lakehouse import Lakehouse, write_whole
from rulewatch.spark.storage import schema, tables

# A file's modification time may trail the moment it became visible by the file system's
# timestamp granularity; within this much of the run's start a never-listed file counts as pending.
MTIME_SLACK_S = 2.0


# In the bronze query's checkpoint: what bronze recorded per file, up to an ingest time (files_read).
FILES_READ = "rulewatch-files-read.json"
# Beside it: the compressed files found whole, by path -> [size, mtime_ns] (each is decompressed once).
COMPRESSED_CHECKED = "rulewatch-compressed-checked.json"
# Hadoop's codecs by file name; the ones Python can read to the end are checked (the rest cannot be here).
CODECS = {".gz": "gzip", ".bz2": "bzip2", ".deflate": "deflate", ".lz4": "lz4", ".snappy": "snappy", ".zst": "zstd"}
CHECKABLE = ("gzip", "bzip2", "deflate")
CLOCK_SLACK_MS = 10 * 60 * 1000


@dataclass(frozen=True)
class FileRead:
    size: int | None  # None: read before bronze recorded sizes
    mtime_ms: int | None

    def merge(self, size: int | None, mtime_ms: int | None) -> "FileRead":
        """The largest of each, as one query over every row of the file would give."""
        return FileRead(_largest(self.size, size), _largest(self.mtime_ms, mtime_ms))


def _largest(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


class LandingError(RuntimeError):
    """The landing folder cannot be ingested into this lakehouse as given: names it and the fix."""


@dataclass
class LandingReport:
    files: int = 0
    problems: list[str] = field(default_factory=list)  # lines that were landed but are not in bronze
    pending: list[str] = field(default_factory=list)  # landed after the run listed the folder
    ignored: list[str] = field(default_factory=list)  # hidden / underscore names (landing contract)
    skipped: dict[str, str] = field(default_factory=dict)  # not read, path -> why: links, FIFOs, devices

    def lines(self) -> list[str]:
        out = [f"landing files    {self.files}" + (f" (+{len(self.ignored)} ignored: name starts with . or _)" if self.ignored else "")]
        out += [f"  NOT INGESTED: {p}" for p in self.problems]
        out += [f"  pending: {p}" for p in self.pending]
        out += [f"  skipped: {path}: {why}" for path, why in self.skipped.items()]
        return out


def local_path(uri: str) -> str:
    """``file:/a%20b/c`` (Spark's spelling of a file) -> ``/a b/c``."""
    return unquote(urlparse(uri).path) if "://" in uri or uri.startswith("file:") else uri


def _skipped(relative: Path) -> bool:
    return any(part.startswith((".", "_")) for part in relative.parts)


def _entries(folder: str, hidden: bool = True) -> Iterator[os.DirEntry[str]]:
    """Every entry below ``folder``, not descending into symbolic links (no stat: a listing per folder);
    without names starting with ``.`` or ``_`` and what lies below them unless ``hidden``. A folder
    removed while it is listed (archived) has nothing left to read."""
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if not hidden and entry.name.startswith((".", "_")):
                    continue
                yield entry
                if entry.is_dir(follow_symlinks=False):
                    yield from _entries(entry.path, hidden)
    except FileNotFoundError:
        return


def _link_reason(path: str) -> str:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return f"a symbolic link (to {target}), not followed: move or copy the file into the landing folder"


def _repeats(names: Mapping[tuple[int, int], list[str]], listed: Mapping[str, int]) -> dict[str, str]:
    """Of each file's names (by device and inode), every one but the first -> why it is not read
    (a file with one name gives nothing).

    The first is the name the source listed first (then the first by name): a hard link made after
    the file was read, under a name that sorts earlier, must not read it again.
    """
    repeats: dict[str, str] = {}
    for same in names.values():
        first, *others = sorted(same, key=lambda path: (listed.get(path, sys.maxsize), path))
        repeats.update({path: f"a hard link to {first} (the same file), read once under that name" for path in others})
    return repeats


def scan(landing: str, listed: Mapping[str, int] | None = None) -> tuple[dict[str, os.stat_result], list[str], dict[str, str]]:
    """Files under ``landing`` the reader takes (path -> stat), the ones it skips by name, and the
    entries not read for what they are (path -> why: symbolic links, FIFOs, sockets, devices, and a
    file's second name, ``listed``: path -> the source batch that first listed it)."""
    root = Path(landing)
    taken: dict[str, os.stat_result] = {}
    ignored: list[str] = []
    skipped: dict[str, str] = {}
    names: dict[tuple[int, int], list[str]] = defaultdict(list)
    for entry in _entries(landing):
        if _skipped(Path(entry.path).relative_to(root)):
            if not entry.is_dir(follow_symlinks=False):
                ignored.append(entry.path)
        elif entry.is_symlink():
            skipped[entry.path] = _link_reason(entry.path)
        elif not entry.is_dir(follow_symlinks=False):
            try:
                status = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed while we looked: like never landed
                continue
            if stat.S_ISREG(status.st_mode):
                taken[entry.path] = status
                names[(status.st_dev, status.st_ino)].append(entry.path)
            else:
                skipped[entry.path] = "not a regular file (a FIFO, socket or device), not read: land regular files"
    skipped.update(_repeats(names, listed or {}))
    return taken, sorted(ignored), dict(sorted(skipped.items()))


def unread(landing: str, checkpoint: str) -> dict[str, str]:
    """What the reader would take below ``landing`` that bronze must not (path -> why): symbolic
    links, and a file's names after its first (``checkpoint``: the reading query's).

    One listing of the folder without stat calls; a file is stat'ed (and the source's log read) only
    when two names share an inode number.
    """
    found: dict[str, str] = {}
    by_inode: dict[int, list[str]] = defaultdict(list)
    for entry in _entries(landing, hidden=False):
        if entry.is_symlink():
            found[entry.path] = _link_reason(entry.path)
        elif entry.is_file(follow_symlinks=False):
            by_inode[entry.inode()].append(entry.path)
    names: dict[tuple[int, int], list[str]] = defaultdict(list)
    for path in (path for same in by_inode.values() if len(same) > 1 for path in same):
        try:
            status = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            continue
        names[(status.st_dev, status.st_ino)].append(path)
    if any(len(same) > 1 for same in names.values()):  # the source's log is read only then
        found.update(_repeats(names, listed_files(checkpoint)))
    return dict(sorted(found.items()))


def _below(path: str, folders: Iterable[str]) -> bool:
    return any(path == f or path.startswith(f + "/") for f in folders)


def _local_file(uri: Column) -> Column:
    """Spark's spelling of a file (``file:/a%20b/c+d``) as a local path: a literal ``+`` stays one
    in that spelling, which ``url_decode`` alone would read as a space."""
    return F.regexp_replace(F.url_decode(F.replace(uri, F.lit("+"), F.lit("%2B"))), r"^file:(//)?", "")


_named: set[str] = set()


def read_once(lines: DataFrame, landing: str, checkpoint: str) -> DataFrame:
    """``lines`` (with ``source_file``) without those read through a symbolic link below ``landing``
    or under a second name of a file (``unread``; ``checkpoint``: the reading query's).

    Found on each batch; with none (the usual case) the batch is left as it is. Each is named on
    stderr once per process.
    """
    found = unread(landing, checkpoint)
    if not found:
        return lines
    for path in found.keys() - _named:
        print(f"rulewatch: landing: skipped {path}: {found[path]}", file=sys.stderr)
        _named.add(path)
    path = _local_file(F.col("source_file"))
    return lines.where(~F.exists(F.array(*[F.lit(p) for p in found]), lambda name: (path == name) | path.startswith(F.concat(name, F.lit("/")))))


def listed_files(checkpoint: str) -> dict[str, int]:
    """Every file the query's file source has listed -> the source batch that first listed it, from
    its checkpoint log (``sources/0``; a batch's files are logged before the batch runs)."""
    log = Path(checkpoint, "sources", "0")
    files: dict[str, int] = {}
    for entry in sorted(log.iterdir()) if log.is_dir() else ():
        if entry.name.split(".")[0].isdigit() and not entry.name.endswith(".tmp"):
            for line in entry.read_text(encoding="utf-8").splitlines()[1:]:
                listed = json.loads(line)
                path = local_path(listed["path"])
                files[path] = min(files.get(path, sys.maxsize), listed["batchId"])
    return files


def audit(spark: SparkSession, lakehouse: Lakehouse, landing: str, query: str, started: float) -> LandingReport:
    """Reconcile the landing folder with bronze after query ``query`` (bronze or ingest) read it.

    ``started``: ``time.time()`` when that query started listing; files newer than that are pending.
    """
    if "://" in landing:
        return LandingReport()
    listed = listed_files(lakehouse.checkpoint(query))
    on_disk, ignored, skipped = scan(landing, listed)
    read = files_read(spark, lakehouse, query)
    report = LandingReport(files=len(on_disk), ignored=ignored, skipped=skipped)
    for path in sorted(listed.keys() | on_disk.keys()):
        if _below(path, skipped):  # a link, a second name, or a FIFO the reader found empty: named as skipped
            continue
        stat = on_disk.get(path)
        problem = _reconcile(path, stat, path in listed, read.get(path), started)
        if problem == "pending":
            report.pending.append(f"{path} landed after the run listed the folder; the next run reads it")
        elif problem:
            report.problems.append(problem)
    report.problems += _damaged(lakehouse.checkpoint(query), {p: s for p, s in on_disk.items() if p in listed})
    return report


def _codec(path: str) -> str | None:
    return CODECS.get(os.path.splitext(path)[1].lower())


def _readable_whole(path: str, codec: str) -> bool | None:
    """Whether the file decompresses to its end (None: no reader for ``codec`` here)."""
    opener = {"gzip": gzip.open, "bzip2": bz2.open}.get(codec)
    try:
        if opener is not None:
            with opener(path, "rb") as stream:
                while stream.read(1 << 20):
                    pass
            return True
        if codec == "deflate":  # Hadoop's DefaultCodec: one zlib stream
            with open(path, "rb") as raw:
                zlib.decompress(raw.read())
            return True
    except (OSError, EOFError, zlib.error):
        return False
    return None


def _damaged(checkpoint: str, listed: dict[str, os.stat_result]) -> list[str]:
    """The listed compressed files that do not decompress whole: the reader skips what it cannot read
    (``ignoreCorruptFiles``) rather than fail every other file with it, so they are named here.

    Each file is checked once per size and modification time (kept in the checkpoint)."""
    record = Path(checkpoint, COMPRESSED_CHECKED) if "://" not in checkpoint else None
    try:
        checked = json.loads(record.read_text(encoding="utf-8")) if record is not None and record.is_file() else {}
    except ValueError:
        checked = {}
    problems = []
    for path, status in sorted(listed.items()):
        codec, stamp = _codec(path), [status.st_size, status.st_mtime_ns]
        if codec is None or checked.get(path) == stamp:
            continue
        whole = _readable_whole(path, codec)
        if whole is False:
            problems.append(
                f"{path} is not valid {codec} to its end (its name ends in {os.path.splitext(path)[1]}, so it is read as {codec}): "
                "its lines were not all ingested. Land it uncompressed or as a complete file under a new name"
            )
        elif whole:
            checked[path] = stamp
    if record is not None and checked:
        write_whole(record, json.dumps(checked))
    return problems


def files_read(spark: SparkSession, lakehouse: Lakehouse, query: str) -> dict[str, FileRead]:
    """What bronze recorded for each file it read (size, modification time), by local path.

    Kept in the query's checkpoint with the newest ingest time it covers, so each audit reads only
    bronze's newer rows (older files are skipped by their ``ingest_time`` statistics): a scan of
    all of bronze took 2.8 s at 10M rows, and grows with every run for as long as the lakehouse lives.
    Without a readable record (the first audit, or a checkpoint that cannot hold one) all of bronze
    is read, and the record written anew.
    """
    checkpoint = lakehouse.checkpoint(query)
    record = Path(checkpoint, FILES_READ) if "://" not in checkpoint else None
    known: dict[str, FileRead] = {}
    through = None
    if record is not None and record.is_file():
        try:
            stored = json.loads(record.read_text(encoding="utf-8"))
            known = {path: FileRead(*values) for path, values in stored["files"].items()}
            through = int(stored["through_ms"])
        except (ValueError, KeyError, TypeError, AttributeError):  # not a record this code wrote: read all of bronze
            known, through = {}, None
    # Back by a margin: a batch's ingest time is the driver's clock, which may have stepped back a little.
    since = None if through is None else through - CLOCK_SLACK_MS
    bronze = tables.read_near(spark, lakehouse.bronze_transactions, schema.BRONZE, "ingest_time", since)
    if bronze is not None and since is not None:
        bronze = bronze.where(F.col("ingest_time") >= F.timestamp_millis(F.lit(since)))
    per_file = [] if bronze is None else (
        bronze.where(F.col("source_file").isNotNull())
        .groupBy("source_file")
        .agg(
            F.max("source_file_size").alias("size"),
            F.unix_millis(F.max("source_file_mtime")).alias("mtime_ms"),
            F.unix_millis(F.max("ingest_time")).alias("through_ms"),
        )
        .collect()
    )
    for row in per_file:
        path = local_path(row.source_file)
        known[path] = known[path].merge(row.size, row.mtime_ms) if path in known else FileRead(row.size, row.mtime_ms)
        through = max(through or row.through_ms, row.through_ms)
    if record is not None and through is not None:
        stored = {"through_ms": through, "files": {path: [f.size, f.mtime_ms] for path, f in known.items()}}
        write_whole(record, json.dumps(stored))
    return known


def _reconcile(path: str, stat: os.stat_result | None, listed: bool, read: FileRead | None, started: float) -> str | None:
    """What went wrong with one file (None: nothing), or "pending" for a file newer than the run."""
    if read is None:
        if stat is None:
            return f"{path} was listed but gone before it was read: its lines never reached bronze"
        if stat.st_size == 0:
            return None  # nothing to ingest (yet); a later growth shows up once it has bytes
        if listed and _codec(path) in CHECKABLE:
            return None  # a compressed file the reader could not read: _damaged names it
        if listed:
            return (f"{path} was empty when it was read and has {stat.st_size:,} bytes now: those lines were never "
                    "ingested (land files complete: write under a temporary name, then rename)")  # fmt: skip
        if stat.st_mtime >= started - MTIME_SLACK_S:
            return "pending"
        return f"{path} was on disk before the run but the file source never listed it"
    if stat is None or read.size is None:
        return None  # removed after ingest (archived); a pre-upgrade row has no size to compare
    if stat.st_size != read.size or stat.st_mtime_ns // 1_000_000 > read.mtime_ms:
        return (f"{path} changed after it was read ({read.size:,} bytes then, {stat.st_size:,} now): lines added "
                "since were not ingested (land files complete: write under a temporary name, then rename)")  # fmt: skip
    return None


def check_landing(lakehouse: Lakehouse, landing: str) -> None:
    """Refuse a landing folder that would make the reader take the wrong files.

    - the lakehouse inside the landing folder: its own table files would be read as landed lines;
    - another landing folder than the one this lakehouse has ingested (moved, renamed or a typo):
      the file source remembers files by path, so every file would be read a second time.
    """
    if "://" in landing or "://" in lakehouse.root:
        return
    folder = Path(landing).resolve()
    if not folder.is_dir():
        raise LandingError(f"landing folder {landing} is not a folder; point it at the folder the JSON-lines files land in")
    root = Path(lakehouse.root)
    if root == folder or folder in root.parents:
        raise LandingError(
            f"lakehouse {root} is inside the landing folder {folder}: its own table files would be read as "
            "landed lines. Keep the lakehouse outside the landing folder."
        )
    check_recorded_source(lakehouse, str(folder))


def _described(identity: str) -> str:
    return f"Kafka topic {identity[len('kafka:'):]}" if identity.startswith("kafka:") else f"the landing folder {identity}"


def check_recorded_source(lakehouse: Lakehouse, identity: str) -> None:
    """Refuse a source other than the one this lakehouse has ingested; record it on first use.

    ``identity``: a resolved landing folder, or ``kafka:<topic>``. A checkpoint's offsets mean
    nothing for another source: files are remembered by path, Kafka offsets per topic partition.
    """
    root = Path(lakehouse.root)
    record = root / "_landing"
    if record.exists():
        ingested = record.read_text(encoding="utf-8").strip()
        if ingested != identity:
            raise LandingError(
                f"lakehouse {root} ingests {_described(ingested)}, not {_described(identity)}. Its checkpoint "
                "remembers what was read by path or offset, so another source would be read wrongly or twice. "
                "If a folder moved, move it back (or point at it); for a different source use a new lakehouse."
            )
    else:
        root.mkdir(parents=True, exist_ok=True)
        record.write_text(f"{identity}\n", encoding="utf-8")
