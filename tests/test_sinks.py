"""sinks.together: a batch's table writes run at once, and a failure surfaces only after all ended."""

import threading
import time

import pytest

from rulewatch.spark.sinks import together


def test_writes_run_at_the_same_time():
    both_started = threading.Barrier(2, timeout=5)  # one at a time, the first would wait in vain
    done = []

    def write(name):
        both_started.wait()
        done.append(name)

    together([lambda: write("alerts"), lambda: write("window_metrics")])
    assert sorted(done) == ["alerts", "window_metrics"]


def test_a_failed_write_is_raised_after_the_others_have_committed():
    committed = []

    def slow():
        time.sleep(0.3)
        committed.append("window_metrics")

    def fails():
        raise RuntimeError("alerts commit failed")

    with pytest.raises(RuntimeError, match="alerts commit failed"):
        together([fails, slow])
    # A replay must not start while a write of the failed batch is still running.
    assert committed == ["window_metrics"]


def test_one_write_runs_in_the_calling_thread():
    threads = []
    together([lambda: threads.append(threading.current_thread())])
    assert threads == [threading.current_thread()]
