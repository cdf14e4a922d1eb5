"""The notebook runner's kernel client: no heartbeat thread that could hang its end, and a dead
kernel still found (nbclient asks the kernel manager for the process, not the heartbeat)."""

from __future__ import annotations

import time

import nbformat
import pytest
from nbclient.exceptions import DeadKernelError

from rulewatch.cli.jobs import notebook_client

pytestmark = pytest.mark.notebook


def test_a_killed_kernel_is_found_and_the_run_ends_without_a_heartbeat():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('up')"),
                                         nbformat.v4.new_code_cell("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")])  # fmt: skip
    client = notebook_client(nb, timeout=120, kernel_name="python3")
    heartbeats = []
    client.on_cell_execute = lambda **_: heartbeats.append(client.kc.hb_channel.is_alive())
    started = time.monotonic()
    with pytest.raises(DeadKernelError):
        client.execute()
    assert time.monotonic() - started < 60
    assert heartbeats == [False, False]  # stopped before the first cell ran
    assert nb.cells[0].outputs[0]["text"] == "up\n"
