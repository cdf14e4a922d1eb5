"""Where every table and checkpoint lives: the one naming layer.

Without a schema (locally) each table is a Delta table at ``<root>/<layer>/<table>`` so any Delta
reader can open it. With a Unity Catalog schema (``catalog.schema``, on Databricks) each table is a
managed table ``catalog.schema.<layer>_<table>``, so the catalog grants, masks and traces it; the
root (a volume) then holds only checkpoints. Either way checkpoints sit under ``<root>/_checkpoints``.

A table reference is therefore a path or a three-level name; ``rulewatch.spark.storage.tables`` reads and writes both.
"""

from __future__ import annotations

import fcntl
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator


@dataclass(frozen=True)
class Lakehouse:
    root: str
    schema: str = ""  # "catalog.schema": Unity Catalog managed tables there; "": Delta folders under root

    def __post_init__(self) -> None:
        if "://" not in self.root:
            object.__setattr__(self, "root", str(Path(self.root).expanduser().resolve()))
        if self.schema and not _SCHEMA.fullmatch(self.schema):
            raise ValueError(
                f"tables schema {self.schema!r} is not catalog.schema (two names of letters, digits, _ or -); "
                "pass e.g. main.rulewatch, or nothing for Delta folders under the lakehouse"
            )

    def table(self, layer: str, name: str) -> str:
        if self.schema:
            return f"{self.schema}.{layer}_{name}"
        return f"{self.root}/{layer}/{name}"

    def name_of(self, table: str) -> str:
        """``<root>/gold/alerts`` or ``<catalog>.<schema>.gold_alerts`` -> ``gold/alerts``: how metrics rows name a table."""
        if is_table_name(table):
            return table.rsplit(".", 1)[1].replace("_", "/", 1)
        return table[len(self.root) + 1 :]

    def checkpoint(self, query: str) -> str:
        return f"{self.root}/_checkpoints/{query}"

    def tables(self) -> list[str]:
        """Every table of the lakehouse (its path or catalog name), in the order the properties below name them."""
        return [getattr(self, name) for name, value in vars(Lakehouse).items() if isinstance(value, property)]

    @property
    def bronze_transactions(self) -> str:
        return self.table("bronze", "transactions")

    @property
    def silver_transactions(self) -> str:
        return self.table("silver", "transactions")

    @property
    def silver_quarantine(self) -> str:
        return self.table("silver", "quarantine")

    @property
    def silver_duplicates(self) -> str:
        return self.table("silver", "duplicates")

    @property
    def rules(self) -> str:
        return self.table("config", "rules")

    @property
    def rule_errors(self) -> str:
        return self.table("config", "rule_errors")

    @property
    def rule_keysets(self) -> str:
        return self.table("gold", "rule_keysets")

    @property
    def rule_history(self) -> str:
        return self.table("gold", "rule_history")

    @property
    def alerts(self) -> str:
        return self.table("gold", "alerts")

    @property
    def window_metrics(self) -> str:
        return self.table("gold", "window_metrics")

    @property
    def late_events(self) -> str:
        return self.table("gold", "late_events")

    @property
    def pipeline_metrics(self) -> str:
        return self.table("gold", "pipeline_metrics")

    @property
    def rule_commands(self) -> str:
        return self.table("config", "rule_commands")


_SCHEMA = re.compile(r"[\w-]+\.[\w-]+")


def is_table_name(table: str) -> bool:
    """A catalog name (``catalog.schema.table``) rather than a path: names never hold a slash."""
    return "/" not in table


def table_ref(table: str) -> str:
    """The table in SQL: ``delta.`<path>``` or ```catalog`.`schema`.`table```."""
    if "`" in table:
        raise ValueError(f"table {table!r} contains a backtick; choose a lakehouse path or schema without one")
    if is_table_name(table):
        return ".".join(f"`{part}`" for part in table.split("."))
    return f"delta.`{table}`"


class LakehouseBusy(RuntimeError):
    """Another process is running the pipeline on the same lakehouse."""


class LakehouseUnwritable(RuntimeError):
    """The lakehouse folder cannot be created or written: a file in the way, a read-only mount, no permission."""


def _unwritable(lakehouse: Lakehouse, err: OSError) -> LakehouseUnwritable:
    root = Path(lakehouse.root)
    if root.exists() and not root.is_dir():
        return LakehouseUnwritable(f"lakehouse {root} is a file, not a folder; pass --lakehouse a folder (it is created if missing)")
    return LakehouseUnwritable(
        f"lakehouse {root} cannot be written ({err.strerror}: {err.filename}); "
        "pass --lakehouse a folder on a writable file system that this user may write to"
    )


def _open_lock(lakehouse: Lakehouse) -> IO[str]:
    """The lock file, open for appending: a run's first write to the lakehouse, so an unusable one fails here.

    Trying the write is the only reliable test: permission bits say nothing about a read-only mount,
    and root ignores them anyway.
    """
    try:
        Path(lakehouse.root).mkdir(parents=True, exist_ok=True)
        return open(Path(lakehouse.root, "_lock"), "a+")
    except OSError as err:
        raise _unwritable(lakehouse, err) from err


def _locked(handle: IO[str]) -> bool:
    """Whether this process now holds the lock. Tried twice: ``rules apply`` looking for a holder
    (:func:`lock_holder`) holds a shared lock for microseconds, and that must not refuse a run."""
    for attempt in range(2):
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if not attempt:
                time.sleep(0.05)
    return False


# The local lakehouses this process holds (``exclusive``, or a task of the job run holding it): until it
# lets go, no other process writes there.
_HELD: set[str] = set()

# Databricks' shared mounts: an OS lock there reaches no other host (the job's max_concurrent_runs guards there).
_SHARED_MOUNTS = ("/Volumes/", "/dbfs/", "/Workspace/")

# `rulewatch job run` holds its lakehouse while the notebooks of its tasks write it from kernels it
# starts: it names itself to them here, so that their layers run under its hold instead of being refused.
HOLDER_ENV = "RULEWATCH_LAKEHOUSE_HOLDER"


@contextmanager
def exclusive(lakehouse: Lakehouse, command: str = "") -> Iterator[None]:
    """Hold the lakehouse for one run: a second run fails fast instead of racing on the checkpoints.

    The lock file names the holder's pid and ``command`` (``rulewatch run``, ...), for the refusal and
    for ``rules apply`` (:func:`lock_holder`). A local lakehouse only (an OS file lock); on Databricks
    the job's ``max_concurrent_runs: 1`` plays this part.
    """
    if "://" in lakehouse.root or lakehouse.root.startswith(_SHARED_MOUNTS):
        yield
        return
    with _open_lock(lakehouse) as handle:
        if not _locked(handle):
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise LakehouseBusy(
                f"lakehouse {lakehouse.root} is in use by {holder}; wait for that run to finish or stop it "
                "(two runs on one lakehouse would race on its checkpoints)"
            )
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}{f' ({command})' if command else ''} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        handle.flush()
        _HELD.add(lakehouse.root)
        try:
            yield
        finally:
            _HELD.discard(lakehouse.root)
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def holding(lakehouse: Lakehouse, command: str) -> Iterator[None]:
    """``exclusive``, unless the lakehouse is held already: by this process (a command around a library
    call) or by the ``rulewatch job run`` whose task this process runs (``HOLDER_ENV``)."""
    if lakehouse.root in _HELD:
        yield
    elif _held_by_job_run(lakehouse):
        _HELD.add(lakehouse.root)  # the job runs its tasks one at a time, and refuses every other writer
        try:
            yield
        finally:
            _HELD.discard(lakehouse.root)
    else:
        with exclusive(lakehouse, command):
            yield


def _held_by_job_run(lakehouse: Lakehouse) -> bool:
    pid = os.environ.get(HOLDER_ENV)
    return bool(pid) and (lock_holder(lakehouse) or "").startswith(f"pid {pid} ")


def held_here(table: str) -> bool:
    """Whether the path table lies in a local lakehouse this process holds: then no other process
    commits to it meanwhile (sinks.py leaves out Delta's concurrent-writer guard there)."""
    return os.path.isabs(table) and any(os.path.commonpath([root, table]) == root for root in tuple(_HELD))


def lock_holder(lakehouse: Lakehouse) -> str | None:
    """What the lock file says of the process holding the lakehouse (``pid N (rulewatch run) since ...``);
    None when no process holds it. Asks by trying a shared lock, let go at once (a run starting meanwhile
    tries again: ``_locked``)."""
    if "://" in lakehouse.root:
        return None
    try:
        handle = open(Path(lakehouse.root, "_lock"))
    except OSError:  # no lock file: nothing has ever held this lakehouse
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return handle.read().strip() or "another process"
        fcntl.flock(handle, fcntl.LOCK_UN)
        return None


def write_whole(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so a crash leaves the old file or the new one, never half of one.

    It is written as ``.<name>.tmp`` first, which no reader takes for the real file (Spark's file
    source skips names starting with ``.``; the others read their own names or suffixes), then
    renamed over ``path``.
    """
    hidden = path.with_name(f".{path.name}.tmp")
    hidden.write_text(text, encoding="utf-8")
    os.replace(hidden, path)
