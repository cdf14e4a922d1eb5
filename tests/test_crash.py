"""Exactly-once under SIGKILL: a run killed at any point and restarted ends where an uninterrupted run ends.

One lakehouse is driven by ``python -m rulewatch.cli.main run`` subprocesses over three landed files, each
attempt killed: at fixed points inside the idempotent writes (the ``RULEWATCH_CRASH_AT`` hook in
spark/storage/sinks.py; the kill between two gold tables of one micro-batch is test_kafka_pipeline's, the
same command over the same gold) and once at a random wall-clock moment, each later attempt resuming what
the kill before it left; a run in the test process finishes after the last kill (and after the random one
when it came before gold planned a batch, so that gold's kill is in a later batch). The result must equal
an uninterrupted in-process run over the same files (conftest's ``uninterrupted``, which
test_live_crash's streams must equal too). The checkpoint checks (spark/storage/checkpoints.py) are
tested on copies of the crashed lakehouse.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from pyspark.sql import functions as F

from rulewatch.cli.main import main
from rulewatch.spark.storage.checkpoints import CheckpointError, check_queries, last_planned_batch
from rulewatch.spark.storage.delta_log import committed_batches
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.storage.metrics import PENDING
from rulewatch.spark.layers.pipeline import run_bronze, run_gold, run_silver, summarize
from rulewatch.spark.storage.sinks import append_once
from rulewatch.spark.storage.tables import ensure_table

from processes import RULES, attempt, crash_files, decided_alerts, finish, held_keysets, land, metrics_commits, next_batch

pytestmark = [pytest.mark.jvm, pytest.mark.subprocess, pytest.mark.slow]


def _attempt(lakehouse: Lakehouse, landing: Path, crash_at: str | None = None, kill_after: float | None = None, output: list[str] | None = None) -> int:
    return attempt(lakehouse, ["--landing", str(landing)], crash_at, kill_after, output=output)


@dataclass
class Crashed:
    lakehouse: Lakehouse
    reference: Lakehouse
    landed_lines: int
    kills: list[str]
    printed: str  # what the attempt killed after its metrics commit printed: every layer ran, gold included


@pytest.fixture(scope="module")
def crashed(spark, uninterrupted, tmp_path_factory) -> Crashed:
    root = tmp_path_factory.mktemp("crash")
    (part1, lines1), (part2, lines2), (part3, lines3) = crash_files()
    lakehouse, landing, kills = Lakehouse(str(root / "lakehouse")), root / "landing", []
    land(landing, part1, lines1)
    # Gold's first batch killed after its alerts committed (the batch not) is the same `rulewatch run`,
    # the same gold over silver, as test_kafka_pipeline's third kill, whose end state gets these checks too.
    for point in ["rulewatch.bronze.transactions:0:after",  # bronze committed, its checkpoint not
                  "rulewatch.silver.quarantine:0:after"]:  # silver half written
        started = time.monotonic()
        assert _attempt(lakehouse, landing, crash_at=point) == -signal.SIGKILL, f"crash point {point} was not reached"
        reached = time.monotonic() - started
        kills.append(point)
    # Wall-clock, wherever the run happens to be: from its start to past the time the last attempt took
    # to reach silver's writes, so into gold's batch, which still has everything to do (a fixed range
    # can outlast a fast run; a kill that comes too late finds the run done, which the next one resumes).
    seconds = random.Random(time.time_ns()).uniform(0.2, 1.3) * reached
    if _attempt(lakehouse, landing, kill_after=seconds) == -signal.SIGKILL:
        kills.append(f"random kill after {seconds:.0f}s")
    if next_batch(lakehouse, "gold") == 0:  # the random kill came before gold planned: the next kill is to be in a later batch
        assert finish(lakehouse, ["--landing", str(landing)]) == 0

    # Each later attempt first resumes what the kill before it left (a gold batch planned by the killed
    # attempt is replayed before the next is planned), then reads the file landed for it.
    land(landing, part2, lines2)
    point = f"rulewatch.gold.alerts:{next_batch(lakehouse, 'gold')}:before"  # a later micro-batch, nothing written yet
    assert _attempt(lakehouse, landing, crash_at=point) == -signal.SIGKILL, f"crash point {point} was not reached"
    kills.append(point)

    land(landing, part3, lines3)
    # Every layer ran a batch: their metrics rows are appended in one commit at the run's end, named
    # by bronze's batch; the kill comes after it commits, before the kept files are removed.
    point = f"rulewatch.metrics.bronze:{next_batch(lakehouse, 'bronze')}:after"
    printed: list[str] = []
    assert _attempt(lakehouse, landing, crash_at=point, output=printed) == -signal.SIGKILL, f"crash point {point} was not reached"
    kills.append(point)
    # Killed in that one commit's wake: it names every layer, and each layer's kept file is still there.
    assert metrics_commits(lakehouse)[-1] == {"rulewatch.metrics.bronze", "rulewatch.metrics.silver", "rulewatch.metrics.gold"}
    assert all(list(Path(lakehouse.checkpoint(layer), PENDING).glob("*.json")) for layer in ("bronze", "silver", "gold"))
    assert finish(lakehouse, ["--landing", str(landing)]) == 0
    assert not list(Path(lakehouse.root).glob(f"_checkpoints/*/{PENDING}/*.json"))
    return Crashed(lakehouse, uninterrupted, len(lines1) + len(lines2) + len(lines3), kills, printed[0])


def test_killed_and_restarted_runs_give_exactly_the_uninterrupted_alerts(spark, crashed):
    assert len(crashed.kills) >= 4, crashed.kills
    expected, actual = decided_alerts(spark, crashed.reference), decided_alerts(spark, crashed.lakehouse)
    assert len(expected) > 20  # the generated stream makes the rules fire
    assert actual == expected  # no alert missing, none twice
    ids = [r.alert_id for r in spark.read.format("delta").load(crashed.lakehouse.alerts).select("alert_id").collect()]
    assert len(ids) == len(set(ids))
    assert held_keysets(spark, crashed.lakehouse) == held_keysets(spark, crashed.reference)


def test_a_run_prints_no_python_worker_or_banner_lines(crashed):
    # The stateful operator's Python driver worker prints its UDF and schemas (kilobytes) through the
    # JVM's stderr at every query start; spark/runtime/session.py filters those lines (and other JVM noise)
    # out of the user's terminal. (The run this reads was killed only after all its layers had run.)
    output = crashed.printed
    assert "gold: done" in output and "silver: done" in output, output[-3000:]
    assert "TransformWithStateInPandas" not in output and "setLogLevel" not in output
    # DataSketches' off-heap warning (Java > 11), printed as gold's window metrics first build a sketch
    assert "restricted mode" not in output
    assert max(len(line) for line in output.splitlines()) < 300


def test_every_landed_line_is_accounted_for_exactly_once(spark, crashed):
    after, before = summarize(spark, crashed.lakehouse), summarize(spark, crashed.reference)
    assert after.bronze == crashed.landed_lines  # no file ingested twice, no line lost
    assert after.balanced
    assert (after.silver, after.quarantined, after.duplicates, after.late) == (before.silver, before.quarantined, before.duplicates, before.late)
    assert (after.quarantined, after.duplicates) == (3, 3)
    bronze = spark.read.format("delta").load(crashed.lakehouse.bronze_transactions)
    assert bronze.groupBy("value", "source_file").count().where("count > 1").count() == 3  # only the repeated lines
    # Bronze's first batch was killed after its append committed: the replay skipped the append and
    # must still count the batch's lines for its metrics row.
    metrics = spark.read.format("delta").load(crashed.lakehouse.pipeline_metrics)
    for layer in ("bronze", "silver"):  # each counts every landed line once
        assert metrics.where(F.col("layer") == layer).agg(F.sum("rows_in")).first()[0] == crashed.landed_lines, layer
    assert metrics.groupBy("layer", "batch_id").count().where("count > 1").count() == 0


@pytest.fixture
def copy(crashed, tmp_path) -> Lakehouse:
    """A private copy of the crashed lakehouse, free to damage."""
    shutil.copytree(crashed.lakehouse.root, tmp_path / "lakehouse")
    return Lakehouse(str(tmp_path / "lakehouse"))


def test_a_missing_checkpoint_fails_instead_of_skipping_new_batches(spark, copy):
    shutil.rmtree(copy.checkpoint("gold"))
    with pytest.raises(CheckpointError) as err:
        run_gold(spark, copy, log=lambda _: None)
    message = str(err.value)
    assert f"checkpoint {copy.checkpoint('gold')} is missing or empty" in message
    assert f"{copy.alerts} already holds batch" in message and "docs/reliability.md" in message
    for path in Path(copy.checkpoint("bronze"), "offsets").iterdir():
        path.unlink()  # emptied rather than removed: the same danger
    with pytest.raises(CheckpointError, match="is missing or empty"):
        run_bronze(spark, copy, str(Path(copy.root).parent / "unused"), log=lambda _: None)


def test_every_query_checkpoint_is_checked_against_its_own_tables(copy):
    check_queries(copy, "bronze", "silver", "gold", "rule_history")  # intact: fine
    shutil.rmtree(copy.checkpoint("rule_history"))
    check_queries(copy, "bronze", "silver", "gold")  # gold/rule_history is not the gold query's table
    with pytest.raises(CheckpointError, match=r"_checkpoints/rule_history is missing .* rulewatch\.gold\.rule_history"):
        check_queries(copy, "rule_history")


@pytest.mark.parametrize("damaged", ["metadata", "offsets", "commits"])
def test_a_corrupt_checkpoint_names_the_file_and_the_recovery(spark, copy, damaged):
    checkpoint = Path(copy.checkpoint("silver"))
    target = checkpoint / "metadata" if damaged == "metadata" else checkpoint / damaged / str(last_planned_batch(str(checkpoint)))
    target.write_bytes(b"\x00garbage{")
    with pytest.raises(CheckpointError) as err:
        run_silver(spark, copy, log=lambda _: None)
    assert f"checkpoint file {target} is corrupt" in str(err.value)
    assert "restore the checkpoint folder from a backup or rebuild the layer" in str(err.value).lower()


def test_an_older_checkpoint_than_the_tables_is_refused(spark, copy):
    offsets = Path(copy.checkpoint("gold"), "offsets")
    newest = max(int(p.name) for p in offsets.iterdir() if p.name.isdigit())
    for folder in ("offsets", "commits"):
        Path(copy.checkpoint("gold"), folder, str(newest)).unlink()  # as if restored from a backup one batch old
    with pytest.raises(CheckpointError, match=f"has batches only up to {newest - 1}, but .* already holds batch {newest}"):
        run_gold(spark, copy, log=lambda _: None)


def test_committed_batches_survive_delta_log_checkpoints_and_cleanup(spark, tmp_path):
    table = str(tmp_path / "t")
    ensure_table(spark, table, spark.range(1).schema, properties={"delta.checkpointInterval": "2"})
    for batch in range(3):
        append_once(spark.range(1), table, "rulewatch.test.t", batch)
    append_once(spark.range(1), table, "rulewatch.other.t", 7)
    log = Path(table, "_delta_log")
    assert list(log.glob("*.checkpoint*.parquet"))
    for commit in log.glob("0000000000000000000[0-2].json"):
        commit.unlink()  # what log cleanup does once a checkpoint covers them
    assert committed_batches(table, "rulewatch.test.") == {"rulewatch.test.t": 2}
    assert committed_batches(table, "rulewatch.") == {"rulewatch.test.t": 2, "rulewatch.other.t": 7}


def test_live_mode_refuses_a_lakehouse_the_job_ingested(copy):
    with pytest.raises(CheckpointError, match="ingested by the batch job"):
        check_queries(copy, "ingest")


def _newest_commit_after_checkpoint(table: str) -> Path:
    """The newest commit file of a Delta table, if no log checkpoint covers it (else the test has nothing to lose)."""
    log = Path(table, "_delta_log")
    newest = max(log.glob("*.json"))
    covered = json.loads((log / "_last_checkpoint").read_text())["version"] if (log / "_last_checkpoint").exists() else -1
    assert int(newest.name.split(".")[0]) > covered
    return newest


@pytest.mark.parametrize("table", ["alerts", "silver_quarantine", "pipeline_metrics"])
def test_a_lost_newest_commit_is_found_before_more_is_written(spark, copy, table):
    """The newest commit of a table removed by hand: its rows would vanish while the checkpoint never replays them."""
    _newest_commit_after_checkpoint(getattr(copy, table)).unlink()
    with pytest.raises(CheckpointError) as err:
        check_queries(copy, "bronze", "silver", "gold")
    message = str(err.value)
    assert ("lost rows" in message and getattr(copy, table) in message) or (
        table == "pipeline_metrics" and "commits of that table are lost" in message
    )
    assert "docs/reliability.md" in message


def test_a_lost_middle_commit_is_found(copy):
    log = Path(copy.silver_transactions, "_delta_log")
    middle = sorted(log.glob("*.json"))[1]
    middle.unlink()
    with pytest.raises(CheckpointError, match=f"{copy.silver_transactions} is missing commit 1 .*{middle.name}"):
        check_queries(copy, "silver")


def test_the_cli_names_a_lost_commit_in_one_line_and_exits_2(crashed, copy, capsys):
    log = Path(copy.silver_transactions, "_delta_log")
    sorted(log.glob("*.json"))[1].unlink()
    landing = str(Path(crashed.lakehouse.root).parent / "landing")
    assert main(["run", "--lakehouse", copy.root, "--landing", landing, "--rules", RULES]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rulewatch: Delta table {copy.silver_transactions} is missing commit 1 ") and "Traceback" not in err


def test_a_deleted_state_folder_is_refused(spark, copy):
    shutil.rmtree(Path(copy.checkpoint("gold"), "state", "0", "1"))
    with pytest.raises(CheckpointError, match=r"state .*partitions \[1\]\) is gone"):
        run_gold(spark, copy, log=lambda _: None)
    shutil.rmtree(Path(copy.checkpoint("gold"), "state"))
    with pytest.raises(CheckpointError, match="is gone: the evaluator would start without the windows"):
        check_queries(copy, "gold")
