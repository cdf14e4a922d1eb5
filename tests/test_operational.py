"""Operational safety: one run per lakehouse; clear errors instead of corrupted checkpoints."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import FIXTURES, ROOT
from rulewatch.lakehouse import Lakehouse, LakehouseBusy, exclusive


def test_a_second_run_on_a_busy_lakehouse_fails_fast_with_a_clear_message(tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    with exclusive(lakehouse):
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "rulewatch.cli", "run", "--lakehouse", lakehouse.root,
             "--transactions", str(FIXTURES / "transactions"), "--rules", str(FIXTURES / "rules.json")],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert time.monotonic() - started < 30  # before any Spark start-up
    assert result.returncode == 2
    assert f"lakehouse {lakehouse.root} is in use by pid" in result.stderr
    assert "wait for that run to finish" in result.stderr


def test_the_lock_is_released_after_a_run(tmp_path):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    with exclusive(lakehouse):
        with pytest.raises(LakehouseBusy):
            with exclusive(lakehouse):
                pass
    with exclusive(lakehouse):  # free again
        pass
