"""sinks: a batch's table writes run at once, and a failure surfaces only after all ended; each
append happens once per (sink, batch), checked only where a run can repeat a batch."""

import json
import threading
import time
from pathlib import Path

import pytest

from rulewatch.spark.checkpoints import committed_batches
from rulewatch.spark.sinks import append_once, per_run, together
from rulewatch.spark.tables import ensure_table


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


def _commits(table: str) -> list[tuple[dict | None, bool]]:
    """Each commit's (userMetadata as JSON, whether it holds a Delta txn record), oldest first."""
    found = []
    for commit in sorted(Path(table, "_delta_log").glob("*.json")):
        actions = [json.loads(line) for line in commit.read_text().splitlines()]
        meta = next(a["commitInfo"].get("userMetadata") for a in actions if "commitInfo" in a)
        found.append((json.loads(meta) if meta else None, any("txn" in a for a in actions)))
    return found


@pytest.mark.spark
def test_only_a_runs_first_batch_is_checked_and_a_repeat_of_it_is_skipped(spark, tmp_path):
    tables = [str(tmp_path / "a"), str(tmp_path / "b")]
    for table in tables:
        ensure_table(spark, table, spark.range(1).schema)

    def write(batch, batch_id):  # two tables at once, as a micro-batch writes them
        together([lambda t=t: append_once(batch, t, f"rulewatch.test.{Path(t).name}", batch_id) for t in tables])

    run = per_run(write)
    for batch_id in (5, 6, 7):
        run(spark.range(batch_id), batch_id)  # batch 5: 5 rows, 6: 6, 7: 7
    for table in tables:
        # The run's first batch writes Delta's txn record; later ones only name themselves.
        assert [(m["txnVersion"], txn) for m, txn in _commits(table)[1:]] == [(5, True), (6, False), (7, False)]
        assert committed_batches(table, "rulewatch.test.") == {f"rulewatch.test.{Path(table).name}": 7}

    # A new run starts with the batch the last one planned: 7 repeats (skipped although Delta's
    # txn record says 5), 8 is new.
    again = per_run(write)
    again(spark.range(7), 7)
    again(spark.range(8), 8)
    for table in tables:
        assert spark.read.format("delta").load(table).count() == 5 + 6 + 7 + 8
    # Outside a streaming query every write is checked.
    append_once(spark.range(3), tables[0], "rulewatch.test.a", 8)
    assert spark.read.format("delta").load(tables[0]).count() == 26
