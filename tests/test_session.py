"""The local session's file settings: commits and checkpoints written without starting a process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import why_it_failed

# A Delta append, then a streaming query with a checkpoint (offsets, commits) into another Delta table.
WRITES = """
import sys
from rulewatch.spark.runtime.session import get_spark

root = sys.argv[1]
spark = get_spark("rulewatch-file-probe")
spark.range(10).write.format("delta").save(root + "/source")
query = (
    spark.readStream.format("delta").load(root + "/source")
    .writeStream.format("delta").option("checkpointLocation", root + "/checkpoint")
    .trigger(availableNow=True).start(root + "/sink")
)
query.awaitTermination()
print("ROWS", spark.read.format("delta").load(root + "/sink").count())
"""


def _logging_command(folder, name: str, log) -> None:
    """``name`` on ``folder``: writes its arguments to ``log``, then runs the real one."""
    real = shutil.which(name)
    script = folder / name
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {real} "$@"\n')
    script.chmod(0o755)


@pytest.mark.jvm
def test_commits_and_checkpoints_rename_without_a_readlink_process(tmp_path):
    # Hadoop's local file system runs `readlink` for every rename through its FileContext API (the
    # default for Spark's checkpoints and Delta's log on file paths), and `chmod` for every file it
    # creates: a process each, ~3-5 ms on this machine (docs/journal/benchmarks.md). The session's settings
    # take the renames through the FileSystem API, which runs none; chmod is unavoidable without
    # Hadoop's native library, and its log shows the wrappers were on the path.
    folder = tmp_path / "bin"
    folder.mkdir()
    logs = {name: tmp_path / f"{name}.log" for name in ("readlink", "chmod")}
    for name, log in logs.items():
        _logging_command(folder, name, log)
    env = {k: v for k, v in os.environ.items() if k != "RULEWATCH_REMOTE"} | {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run([sys.executable, "-c", WRITES, str(tmp_path / "lake")], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, why_it_failed(result.stderr)
    assert "ROWS 10" in result.stdout
    assert logs["chmod"].exists(), "the wrappers were not used: the test cannot see what Hadoop runs"
    assert not logs["readlink"].exists(), logs["readlink"].read_text()[:2000]


@pytest.mark.parametrize(
    ("remote", "set_here"),
    [(None, True), ("local[2]", True), ("sc://workspace:443", False)],  # a server elsewhere: its own classes
)
def test_the_file_settings_are_for_sessions_on_this_machine(remote, set_here):
    from rulewatch.spark.runtime.session import local_file_confs

    confs = local_file_confs(remote)
    assert ("spark.delta.logStore.file.impl" in confs) == set_here
    assert ("spark.sql.streaming.checkpointFileManagerClass" in confs) == set_here
