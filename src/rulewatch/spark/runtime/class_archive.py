"""The JVM's class-data sharing archive: the classes a run loads, kept mapped-ready for the next JVM.

A cold local run spends most of its first minute loading and verifying Spark's and Delta's classes
(docs/journal/benchmarks.md, "A cold rulewatch run"). The JVM can dump every class it loaded at exit
(``-XX:ArchiveClassesAtExit``) and map that dump at the next start (``-XX:SharedArchiveFile``).

A truncated archive crashes the JVM that maps it (SIGBUS), so an archive is only ever used once it
is whole and proven: set-up dumps it under a temporary name from a JVM that has exited, starts a JVM
that must map it (``-Xshare:on``), and only then renames it into place. Its name is keyed by the JVM
build and the class path, because the JVM accepts a dynamic archive only from the same build and
the same jars; one that no longer matches is skipped with the JVM's warning silenced, never fatal.
Installing one removes the archives it supersedes (~200 MB each): the same checkout's older ones and
those of checkouts that are gone. ``RULEWATCH_CLASS_ARCHIVE=off`` starts every JVM without it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyspark

from rulewatch.spark.runtime.env import JAVA_OPTIONS, cache_home, java_binary, repository_root
from rulewatch.spark.runtime.jars import spark_jars

SPARK_HOME = Path(pyspark.__file__).resolve().parent
# A mismatched archive (another JVM build, changed jars) would print a warning at every start.
_QUIET = "-Xlog:cds=off,cds+dynamic=off"
# Beside each archive, the pyspark folder (checkout or environment) whose JVMs map it.
_OWNER = ".owner"


def archive_path() -> Path | None:
    """Where the archive for this JVM build and these jars lives; None without a java to key it by."""
    java = java_binary()
    if java is None:
        return None
    key = hashlib.sha256()
    # The JVM build: its binary and its libjvm (what a JDK update replaces).
    for part in (java, *java.parent.parent.glob("lib/server/libjvm.*")):
        stat = part.stat()
        key.update(f"{part}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    key.update(f"{SPARK_HOME}:{pyspark.__version__}\n".encode())
    for jar in spark_jars():
        key.update(f"{jar}\n".encode())
    return cache_home() / "class-archive" / f"{key.hexdigest()[:20]}.jsa"


def archive_options() -> str:
    """The JVM options that map the archive, or "" when there is none (or it is switched off)."""
    if os.environ.get("RULEWATCH_CLASS_ARCHIVE") == "off":
        return ""
    path = archive_path()
    return f"-XX:SharedArchiveFile={path} {_QUIET}" if path is not None and path.is_file() else ""


def _submit(script: str, java_options: str, folder: Path) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with spark-submit: its JVM is the process waited for, so its exit (and dump) is too."""
    path = folder / f"script-{time.monotonic_ns()}.py"
    path.write_text(script)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    env.pop("PYSPARK_GATEWAY_PORT", None)
    command = [str(SPARK_HOME / "bin" / "spark-submit"), "--master", "local[2]", "--driver-java-options", java_options]
    if jars := spark_jars():
        command += ["--jars", ",".join(map(str, jars))]
    return subprocess.run([*command, str(path)], capture_output=True, text=True, env=env, cwd=folder, timeout=900)


def _workload(lakehouse: Path, fixtures: Path) -> str:
    # The fixtures' whole job: every layer, the state operator, the rules table and the summary.
    args = ["run", "--lakehouse", str(lakehouse), "--landing", str(fixtures / "transactions"),
            "--rules", str(fixtures / "rules.json")]  # fmt: skip
    return f"import sys\nfrom rulewatch.cli.main import main\nsys.exit(main({args!r}))\n"


_CHECK = "from pyspark.sql import SparkSession\nassert SparkSession.builder.getOrCreate().range(3).count() == 3\n"


def prove(archive: Path, java_options: str, folder: Path) -> subprocess.CompletedProcess[str]:
    """Start a JVM that must map ``archive`` (``-Xshare:on``) and run a query: exit 0 only if it could."""
    return _submit(_CHECK, f"{java_options} -Xshare:on -XX:SharedArchiveFile={archive}", folder)


def build(java_options: str, quiet: bool = False) -> Path | None:
    """Dump, prove and install the archive for this JVM and these jars, once; None if it cannot be made.

    ``java_options`` are those every session starts its JVM with. A failure only costs speed, so it
    is reported and set-up goes on.
    """

    def say(message: str) -> None:
        if not quiet:
            print(f"rulewatch: {message}", file=sys.stderr)

    target = archive_path()
    if target is not None and target.is_file():
        return target
    root = repository_root()
    if target is None or root is None or not (root / "fixtures" / "rules.json").is_file():
        say("no JVM class archive: it needs java and the repository's fixtures to run once")
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    say("building the JVM class archive for faster starts (once, ~2 min) ...")
    try:
        with tempfile.TemporaryDirectory(prefix="rulewatch-class-archive-") as folder:
            run = _submit(_workload(Path(folder, "lakehouse"), root / "fixtures"),
                          f"{java_options} -XX:ArchiveClassesAtExit={partial}", Path(folder))  # fmt: skip
            if run.returncode != 0 or not partial.is_file():
                say(f"no JVM class archive: the run that dumps it failed (exit {run.returncode})\n{run.stderr[-1500:]}")
                return None
            check = prove(partial, java_options, Path(folder))
            if check.returncode != 0:
                say(f"no JVM class archive: a JVM could not map the one dumped\n{check.stderr[-1500:]}")
                return None
        target.with_suffix(_OWNER).write_text(str(SPARK_HOME))
        os.replace(partial, target)
    except (OSError, subprocess.TimeoutExpired) as error:
        say(f"no JVM class archive: {error}")
        return None
    finally:
        partial.unlink(missing_ok=True)
    say(f"JVM class archive: {target} ({target.stat().st_size // 2**20} MB)")
    for stale in _superseded(target):
        stale.unlink(missing_ok=True)
        stale.with_suffix(_OWNER).unlink(missing_ok=True)
        say(f"removed the stale JVM class archive {stale}")
    return target


def _superseded(target: Path) -> list[Path]:
    """Archives no JVM will map again: this pyspark's older ones (other jars or JDK) and deleted checkouts'."""
    stale = []
    for archive in target.parent.glob("*.jsa"):
        owner = archive.with_suffix(_OWNER)
        # An archive without its owner's record predates the record: whose it is cannot be told, so it stays.
        if archive == target or not owner.is_file():
            continue
        home = Path(owner.read_text())
        if home == SPARK_HOME or not home.is_dir():
            stale.append(archive)
    return stale


if __name__ == "__main__":
    build(JAVA_OPTIONS)
