"""sinks: a batch's table writes run at once, and a failure surfaces only after all ended; each
append happens once per (sink, batch), checked only where a run can repeat a batch."""

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pytest
from pyspark.util import disable_gc

from rulewatch.spark.storage import delta_log
from rulewatch.spark.storage.delta_log import batch_metadata, batch_told_by_commits, committed_batches, newest_committed_batch, sink_batches
from rulewatch.spark.storage.lakehouse import Lakehouse, exclusive, held_here
from rulewatch.spark.storage.metrics import metrics_sink
from rulewatch.spark.storage.sinks import CRASH_AT_ENV, HISTORY_SINK, append_once, beside, history_batches, per_run, sink_name, together
from rulewatch.spark.storage.tables import ensure_table, read


def test_sink_names_stay_what_existing_tables_and_the_crash_tests_name():
    # Tables written by earlier versions name their sinks in each commit (userMetadata, txnAppId): a
    # renamed sink would not see its own committed batches and would append them again on a replay.
    assert sink_name("gold", "alerts") == "rulewatch.gold.alerts"
    assert sink_name("ingest", "transactions") == "rulewatch.ingest.transactions"
    assert sink_name("silver") == "rulewatch.silver."  # the prefix checkpoints.py checks a query's tables by
    assert metrics_sink("gold") == "rulewatch.metrics.gold"
    assert HISTORY_SINK == "rulewatch.gold.rule_history"


def test_a_crash_point_may_name_the_table_where_one_sink_writes_two():
    # Live ingest's bronze and silver appends share one sink name and run at once: only the table tells them apart.
    script = (
        "from rulewatch.spark.storage.sinks import crash_point\n"
        "for table in ['/l/bronze/transactions', '/l/silver/quarantine', '/l/silver/transactions/']:\n"
        "    crash_point('rulewatch.ingest.transactions', 0, 'after', table)\n"
        "    print('passed', table, flush=True)\n"
    )
    def run(point: str) -> subprocess.CompletedProcess:
        env = {**os.environ, CRASH_AT_ENV: point}
        return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)

    named = run("rulewatch.ingest.transactions@silver/transactions:0:after")
    assert named.returncode == -signal.SIGKILL and named.stdout.split("\n")[:-1] == ["passed /l/bronze/transactions", "passed /l/silver/quarantine"], named
    unnamed = run("rulewatch.ingest.transactions:0:after")  # the first write of the sink, whichever table
    assert unnamed.returncode == -signal.SIGKILL and unnamed.stdout == "", unnamed
    other_batch = run("rulewatch.ingest.transactions@silver/transactions:1:after")
    assert other_batch.returncode == 0 and other_batch.stdout.count("passed") == 3, other_batch


def test_a_commit_names_its_own_batch_and_the_others_it_holds():
    assert sink_batches(batch_metadata("rulewatch.metrics.bronze", 4)) == [("rulewatch.metrics.bronze", 4)]
    both = batch_metadata("rulewatch.metrics.bronze", 4, {"rulewatch.metrics.silver": 2})
    assert sink_batches(both) == [("rulewatch.metrics.bronze", 4), ("rulewatch.metrics.silver", 2)]
    # Someone else's metadata, or none, names nothing.
    for other in [None, "", "audit run 7", "[1, 2]", '{"txnAppId": 5, "txnVersion": 1}', '{"txnAppId": "x"}', '{"author": "ana"}']:
        assert sink_batches(other) == [], other


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


def test_a_connect_call_ending_in_one_write_leaves_the_collector_off_in_the_others():
    # The order that turned the collector back on under a call still running: the first call in
    # (which found it on) ends while the second (which found it off) is still inside.
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with disable_gc():  # what pyspark's Connect client does around each call to the server
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second():
        first_in.wait(5)
        with disable_gc():
            second_in.set()
            first_out.wait(5)
            seen["collector on mid-call"] = gc.isenabled()

    assert gc.isenabled()
    together([first, second])
    assert seen == {"collector on mid-call": False}
    assert gc.isenabled()  # and back on once every write has ended


def test_one_write_runs_in_the_calling_thread():
    threads = []
    together([lambda: threads.append(threading.current_thread())])
    assert threads == [threading.current_thread()]


def test_work_beside_a_block_runs_at_the_same_time_and_its_outcome_is_kept():
    both_started = threading.Barrier(2, timeout=5)
    with beside(lambda: (both_started.wait(), threading.current_thread())[1], pause_collector=False) as other:
        both_started.wait()
        assert gc.isenabled()  # a classic session's long block keeps the collector
    assert other.result() is not threading.current_thread()


def test_a_failed_block_names_the_failure_beside_it_too():
    def fails():
        raise ValueError("MERGE failed")

    with pytest.raises(RuntimeError, match="bronze failed") as caught:
        with beside(fails):
            time.sleep(0.1)
            raise RuntimeError("bronze failed")
    assert caught.value.__notes__ == ["meanwhile, beside it: ValueError('MERGE failed')"]
    assert gc.isenabled()


def _log(spark, table: str) -> Path:
    """A path table's Delta log folder, or a catalog table's (from its location)."""
    if Path(table).is_absolute():
        return Path(table, "_delta_log")
    return Path(urlparse(spark.sql(f"DESCRIBE DETAIL {table}").first().location).path, "_delta_log")


def _commits(log: Path) -> list[tuple[dict | None, bool]]:
    """Each commit's (userMetadata as JSON, whether it holds a Delta txn record), oldest first."""
    found = []
    for commit in sorted(log.glob("*.json")):
        actions = [json.loads(line) for line in commit.read_text().splitlines()]
        meta = next(a["commitInfo"].get("userMetadata") for a in actions if "commitInfo" in a)
        found.append((json.loads(meta) if meta else None, any("txn" in a for a in actions)))
    return found


@pytest.fixture(params=["path", "catalog"])
def two_tables(request, spark, tmp_path):
    """Path tables are checked through their log files, catalog tables through DESCRIBE HISTORY."""
    if request.param == "path":
        yield [str(tmp_path / "a"), str(tmp_path / "b")]
        return
    schema = f"spark_catalog.rulewatch_sinks_{uuid.uuid4().hex[:8]}"
    spark.sql(f"CREATE SCHEMA {schema}")
    yield [f"{schema}.a", f"{schema}.b"]
    spark.sql(f"DROP SCHEMA {schema} CASCADE")


@pytest.mark.jvm
def test_only_a_runs_first_batch_is_checked_and_a_repeat_of_it_is_skipped(spark, two_tables):
    sink = {t: f"rulewatch.test.{t[-1]}" for t in two_tables}
    for table in two_tables:
        ensure_table(spark, table, spark.range(1).schema)

    def write(batch, batch_id):  # two tables at once, as a micro-batch writes them
        together([lambda t=t: append_once(batch, t, sink[t], batch_id) for t in two_tables])

    run = per_run(write)
    for batch_id in (5, 6, 7):
        run(spark.range(batch_id), batch_id)  # batch 5: 5 rows, 6: 6, 7: 7
    for table in two_tables:
        # The run's first batch writes Delta's txn record; later ones only name themselves.
        assert [(m["txnVersion"], txn) for m, txn in _commits(_log(spark, table))[1:]] == [(5, True), (6, False), (7, False)]
        # Both ways of reading which batches a table holds agree.
        assert committed_batches(str(_log(spark, table).parent), "rulewatch.test.") == {sink[table]: 7}
        assert history_batches(spark, table, "rulewatch.test.") == {sink[table]: 7}

    # A new run starts with the batch the last one planned: 7 repeats (skipped although Delta's
    # txn record says 5), 8 is new.
    again = per_run(write)
    again(spark.range(7), 7)
    again(spark.range(8), 8)
    for table in two_tables:
        assert read(spark, table).count() == 5 + 6 + 7 + 8
    # Outside a streaming query every write is checked.
    append_once(spark.range(3), two_tables[0], sink[two_tables[0]], 8)
    assert read(spark, two_tables[0]).count() == 26


@pytest.mark.jvm
def test_a_sinks_newest_batch_comes_from_the_newest_commit_naming_it_else_from_delta_txn(spark, tmp_path):
    table = str(tmp_path / "t")
    ensure_table(spark, table, spark.range(1).schema)
    # As a table written before every append named itself: only Delta's txn record says batch 3.
    spark.range(1).write.format("delta").mode("append").option("txnAppId", "rulewatch.test.t").option("txnVersion", 3).save(table)
    assert newest_committed_batch(table, "rulewatch.test.t") == 3
    append_once(spark.range(1), table, "rulewatch.test.t", 4)
    append_once(spark.range(1), table, "rulewatch.test.u", 9)  # another sink's newer commit
    assert newest_committed_batch(table, "rulewatch.test.t") == 4
    assert newest_committed_batch(table, "rulewatch.test.u") == 9
    assert newest_committed_batch(table, "rulewatch.test.v") == -1


@pytest.mark.jvm
def test_in_a_lakehouse_this_process_holds_a_replay_is_told_by_the_commits_without_deltas_txn_check(spark, tmp_path, monkeypatch):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    table, sink = str(Path(lakehouse.root, "gold", "t")), "rulewatch.test.t"
    ensure_table(spark, table, spark.range(1).schema)
    assert not held_here(table)
    with exclusive(lakehouse):
        assert held_here(table) and not held_here(str(tmp_path / "lakehouse2" / "t")) and not held_here("main.gold.t")
        for _ in range(2):  # two runs whose first batch is 5: the second a replay
            per_run(lambda batch, batch_id: append_once(batch, table, sink, batch_id))(spark.range(3), 5)
    assert not held_here(table)
    # No other run could commit meanwhile and the commits since version 0 told the answer: no txn record.
    assert [(m["txnVersion"], txn) for m, txn in _commits(_log(spark, table))[1:]] == [(5, False)]
    assert read(spark, table).count() == 3  # the replay skipped
    append_once(spark.range(1), table, sink, 6)  # not held: Delta's guard as well
    assert _commits(_log(spark, table))[-1][1]

    # Held, but the commits read (the newest two here) do not name the sink and older ones went unread: guarded.
    monkeypatch.setattr(delta_log, "HISTORY_DEPTH", 2)
    with exclusive(lakehouse):
        append_once(spark.range(1), table, "rulewatch.test.u", 1)
        assert _commits(_log(spark, table))[-1][1]
        append_once(spark.range(1), table, sink, 7)  # named two commits back (batch 6): told
        assert not _commits(_log(spark, table))[-1][1]
        append_once(spark.range(1), table, sink, 7)  # and a replay of it skipped
    assert read(spark, table).count() == 3 + 1 + 1 + 1


def test_the_commit_files_tell_a_sinks_batch_only_from_a_whole_run_of_versions_or_a_commit_naming_it(tmp_path):
    log = tmp_path / "t" / "_delta_log"
    log.mkdir(parents=True)

    def commit(version: int, sink: str | None = None, batch: int = 0) -> None:
        info = {"commitInfo": {"operation": "WRITE", **({"userMetadata": batch_metadata(sink, batch)} if sink else {})}}
        (log / f"{version:020d}.json").write_text(json.dumps(info) + "\n")

    table = str(log.parent)
    commit(0)
    commit(1, "rulewatch.test.u", 4)
    assert batch_told_by_commits(table, "rulewatch.test.t") == -1  # every version read: none names it
    commit(3, "rulewatch.test.u", 5)  # version 2's file is missing: it might have named the sink
    assert batch_told_by_commits(table, "rulewatch.test.t") is None
    commit(2, "rulewatch.test.t", 7)
    assert batch_told_by_commits(table, "rulewatch.test.t") == 7
    (log / f"{0:020d}.json").unlink()  # log cleanup: a sink named among the commits left still answers
    assert batch_told_by_commits(table, "rulewatch.test.t") == 7
    assert batch_told_by_commits(table, "rulewatch.test.v") is None
