"""The JVM class archive: built by a JVM that exited, proven by one that maps it, installed only then."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import why_it_failed
from rulewatch.spark.runtime import class_archive
from rulewatch.spark.runtime.env import JAVA_OPTIONS, collector_option, java_binary
from rulewatch.spark.runtime.session import driver_java_options

pytestmark = pytest.mark.jvm


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RULEWATCH_HOME", str(tmp_path))
    monkeypatch.delenv("RULEWATCH_CLASS_ARCHIVE", raising=False)
    # The check's session and count: enough classes for a real archive in seconds rather than a whole job.
    monkeypatch.setattr(class_archive, "_workload", lambda lakehouse, fixtures: class_archive._CHECK)
    return tmp_path


def test_the_archive_is_keyed_by_the_jars(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = class_archive.archive_path()
    assert path is not None and path.parent == home / "class-archive"
    monkeypatch.setattr(class_archive, "spark_jars", lambda: [home / "another.jar"])
    assert class_archive.archive_path() != path


def test_no_options_without_an_archive_or_when_switched_off(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert class_archive.archive_options() == ""
    path = class_archive.archive_path()
    assert path is not None
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    assert class_archive.archive_options().startswith(f"-XX:SharedArchiveFile={path} ")
    monkeypatch.setenv("RULEWATCH_CLASS_ARCHIVE", "off")
    assert class_archive.archive_options() == ""


def _archive_owned_by(folder: Path, name: str, owner: Path) -> Path:
    archive = folder / f"{name}.jsa"
    archive.write_bytes(b"an archive")
    archive.with_suffix(".owner").write_text(str(owner))
    return archive


@pytest.mark.slow
def test_a_whole_dump_is_installed_and_a_truncated_one_never(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = class_archive.archive_path()
    assert target is not None
    folder = target.parent
    folder.mkdir(parents=True)
    # Superseded: this checkout's archive for other jars, and one of a checkout since deleted.
    _archive_owned_by(folder, "older-jars", class_archive.SPARK_HOME)
    _archive_owned_by(folder, "deleted-checkout", home / "gone" / "pyspark")
    # Kept: another checkout's that still exists, and one from before owners were recorded.
    (home / "other" / "pyspark").mkdir(parents=True)
    _archive_owned_by(folder, "other-checkout", home / "other" / "pyspark")
    (folder / "unrecorded.jsa").write_bytes(b"an archive")

    proved: list[tuple[int, subprocess.CompletedProcess[str]]] = []  # (the file's inode, the JVM that mapped it)
    prove = class_archive.prove

    def recorded(archive: Path, java_options: str, folder: Path) -> subprocess.CompletedProcess[str]:
        check = prove(archive, java_options, folder)
        proved.append((archive.stat().st_ino, check))
        return check

    monkeypatch.setattr(class_archive, "prove", recorded)
    assert class_archive.build(JAVA_OPTIONS, quiet=True) == target
    assert sorted(p.name for p in folder.glob("*.jsa")) == sorted([target.name, "other-checkout.jsa", "unrecorded.jsa"])
    assert sorted(p.name for p in folder.glob("*.owner")) == sorted([target.with_suffix(".owner").name, "other-checkout.owner"])
    for kept in ("other-checkout.jsa", "other-checkout.owner", "unrecorded.jsa"):
        (folder / kept).unlink()
    # Installed means proven: a JVM that had to map it (-Xshare:on) started and ran a query, on the very
    # file (the same inode) that was then installed. (A JVM of the test's own would start a third JVM.)
    [(inode, check)] = proved
    assert check.returncode == 0, why_it_failed(check.stderr)
    assert inode == target.stat().st_ino

    # As if the dumping JVM had died mid-write: its first MB is all there is. The real check must refuse it.
    whole = target.read_bytes()
    target.unlink()
    target.with_suffix(".owner").unlink()
    submit = class_archive._submit

    def dump_cut_short(script: str, java_options: str, folder: Path) -> subprocess.CompletedProcess[str]:
        if "-XX:ArchiveClassesAtExit=" not in java_options:
            return submit(script, java_options, folder)
        partial = Path(java_options.split("-XX:ArchiveClassesAtExit=")[1].split()[0])
        partial.write_bytes(whole[: 2**20])
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(class_archive, "_submit", dump_cut_short)
    assert class_archive.build(JAVA_OPTIONS, quiet=True) is None
    assert list(target.parent.iterdir()) == []
    assert len(proved) == 2 and proved[1][1].returncode != 0  # refused by the JVM that had to map it


@pytest.mark.parametrize("chosen", ["", "-XX:+UseG1GC", "-XX:+UseSerialGC"])
def test_the_jvm_starts_whatever_collector_the_environment_chose(chosen: str) -> None:
    # The session picks the parallel collector unless JAVA_TOOL_OPTIONS already picked one:
    # a JVM given two refuses to start.
    java = java_binary()
    assert java is not None
    env = {"JAVA_TOOL_OPTIONS": chosen}
    option = collector_option(env)
    assert (option == "") == bool(chosen)
    run = subprocess.run([str(java), *option.split(), "-version"], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    if chosen:
        both = subprocess.run([str(java), "-XX:+UseParallelGC", "-version"], env=env, capture_output=True, text=True, timeout=60)
        assert both.returncode != 0 and "Multiple garbage collectors" in both.stdout + both.stderr  # what the guard avoids


def test_rulewatch_java_options_come_last_and_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RULEWATCH_JAVA_OPTIONS", " -XX:+DontCompileHugeMethods -XX:TieredStopAtLevel=1 ")
    options = driver_java_options()
    assert options.startswith(JAVA_OPTIONS) and options.endswith("-XX:+DontCompileHugeMethods -XX:TieredStopAtLevel=1")
    flags = subprocess.run([str(java_binary()), *options.split(), "-XX:+PrintFlagsFinal", "-version"], capture_output=True, text=True, timeout=60)
    assert flags.returncode == 0, flags.stderr
    final = {line.split()[1]: line.split()[3] for line in flags.stdout.splitlines() if line.count("=") == 1 and len(line.split()) >= 4}
    assert (final["DontCompileHugeMethods"], final["TieredStopAtLevel"]) == ("true", "1")  # the project's -XX:- is overridden
    monkeypatch.delenv("RULEWATCH_JAVA_OPTIONS")
    assert driver_java_options() == f"{JAVA_OPTIONS} {class_archive.archive_options()}".strip()
