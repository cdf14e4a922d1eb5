"""Gold's checkpoint is bound to its shard count and state layout: another one is refused before anything runs.

With another shard count a key hashes to a shard that holds neither its window history nor (for a
shard the query never had) any rule, so detection would silently stop for it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES
from rulewatch.cli.main import main
from rulewatch.spark.storage.checkpoints import GOLD_LAYOUT, CheckpointError, check_gold_layout, gold_layout, gold_source, last_planned_batch
from rulewatch.spark.storage.lakehouse import Lakehouse
from processes import RULES


def test_a_checkpoint_without_a_committed_batch_takes_the_layout_it_is_given(tmp_path):
    checkpoint = tmp_path / "gold"
    assert check_gold_layout(str(checkpoint), {"shards": 4, "state_slots": 0}, partitions=4) == 4
    # Nothing evaluated yet: nothing to move, and the shards spread over the partitions it starts with.
    assert check_gold_layout(str(checkpoint), {"shards": 8, "state_slots": 16}, partitions=2) == 2
    assert json.loads((checkpoint / GOLD_LAYOUT).read_text()) == {"shards": 8, "state_slots": 16, "shard_partitions": 2, "source": "silver"}


def _ran(checkpoint: Path, record: dict | None) -> Path:
    (checkpoint / "commits").mkdir(parents=True)
    (checkpoint / "commits" / "0").write_text("v1\n{}\n")
    if record is not None:
        (checkpoint / GOLD_LAYOUT).write_text(json.dumps(record))
    return checkpoint


def test_a_checkpoint_that_has_run_keeps_the_shard_labels_its_state_is_keyed_by(tmp_path):
    layout = {"shards": 4, "state_slots": 0}
    # Spark keeps a checkpoint's partition count, so a run asking for another keeps the recorded spread.
    spread = _ran(tmp_path / "spread", {**layout, "shard_partitions": 4})
    assert check_gold_layout(str(spread), layout, partitions=2) == 4
    # Before the record held the spread, shards were grouped by 0 .. shards-1: they stay so.
    older = _ran(tmp_path / "older", layout)
    assert check_gold_layout(str(older), layout, partitions=4) == 0
    unrecorded = _ran(tmp_path / "unrecorded", None)
    assert check_gold_layout(str(unrecorded), layout, partitions=4) == 0
    assert json.loads((unrecorded / GOLD_LAYOUT).read_text()) == {**layout, "shard_partitions": 0, "source": "silver"}
    assert check_gold_layout(str(unrecorded), layout, partitions=4) == 0
    assert check_gold_layout("s3://bucket/lakehouse/_checkpoints/gold", layout, partitions=4) == 0  # no record there


def test_a_checkpoint_keeps_the_source_gold_read(tmp_path):
    # Its offsets are that source's: silver's Delta versions or a topic's offsets, never the other's.
    layout = {"shards": 4, "state_slots": 0}
    direct = _ran(tmp_path / "direct", {**layout, "shard_partitions": 4, "source": "kafka:payments"})
    assert check_gold_layout(str(direct), layout, source="kafka:payments") == 4
    for other in ("silver", "kafka:other"):
        with pytest.raises(CheckpointError, match=f"reads kafka:payments; this run asks it to read {other}"):
            check_gold_layout(str(direct), layout, source=other)
    older = _ran(tmp_path / "older", {**layout, "shard_partitions": 4})  # before the record named it: silver
    with pytest.raises(CheckpointError, match="reads silver"):
        check_gold_layout(str(older), layout, source="kafka:payments")
    # What a live start goes on with when not told (streams._direct_source): the record's, once it has run.
    assert (gold_source(str(direct)), gold_source(str(older)), gold_source(str(tmp_path / "new"))) == ("kafka:payments", "silver", None)
    planned = tmp_path / "planned"  # a batch planned, none committed, from before records named their source
    (planned / "offsets").mkdir(parents=True)
    (planned / "offsets" / "0").write_text("v1\n{}\n")
    assert gold_source(str(planned)) == "silver" and gold_source("s3://bucket/lakehouse/_checkpoints/gold") == "silver"


def test_unset_flags_take_the_layout_the_checkpoint_began_with(tmp_path):
    defaults = {"shards": 16, "state_slots": 0}
    unset = {"shards": None, "state_slots": None}
    assert gold_layout(str(tmp_path / "new"), unset, defaults) == (defaults, {})
    assert gold_layout(str(tmp_path / "new"), {"shards": 3, "state_slots": None}, defaults) == ({"shards": 3, "state_slots": 0}, {})
    # Recorded but never committed a batch: nothing is bound yet, so the defaults hold.
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / GOLD_LAYOUT).write_text(json.dumps({"shards": 4, "state_slots": 8, "shard_partitions": 4}))
    assert gold_layout(str(tmp_path / "fresh"), unset, defaults) == (defaults, {})
    ran = str(_ran(tmp_path / "ran", {"shards": 4, "state_slots": 8, "shard_partitions": 4}))
    assert gold_layout(ran, unset, defaults) == ({"shards": 4, "state_slots": 8}, {"shards": 4, "state_slots": 8})
    # A value given is kept as given (check_gold_layout refuses it if it differs), the other filled in and named.
    assert gold_layout(ran, {"shards": 16, "state_slots": None}, defaults) == ({"shards": 16, "state_slots": 8}, {"state_slots": 8})
    # The record equal to the defaults: nothing to name.
    same = str(_ran(tmp_path / "same", {**defaults, "shard_partitions": 4}))
    assert gold_layout(same, unset, defaults) == (defaults, {})
    assert gold_layout("s3://bucket/lakehouse/_checkpoints/gold", unset, defaults) == (defaults, {})


def test_another_shard_count_or_layout_is_refused_once_gold_has_run(spark, tmp_path, capsys):
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    landing = tmp_path / "landing"
    shutil.copytree(FIXTURES / "transactions", landing)
    run = ["run", "--lakehouse", lakehouse.root, "--landing", str(landing), "--rules", RULES]
    assert main([*run, "--shards", "2"]) == 0
    gold_batches = last_planned_batch(lakehouse.checkpoint("gold"))
    bronze_commits = Path(lakehouse.bronze_transactions, "_delta_log")
    bronze_log = sorted(bronze_commits.glob("*.json"))
    shutil.copy(landing / "day1-a.jsonl", landing / "later.jsonl")  # new to bronze: a refused run must not read it

    for other, asked in [(["--shards", "3"], "--shards 3 --state-slots 0"), (["--shards", "2", "--state-slots", "4"], "--shards 2 --state-slots 4")]:
        assert main([*run, *other]) == 2
        err = capsys.readouterr().err
        assert f"began with --shards 2 --state-slots 0; this run asks for {asked}" in err
        assert "alerts would be missed silently" in err and "Traceback" not in err

    # Refused before bronze read the new file, and gold's checkpoint is as it was.
    assert sorted(bronze_commits.glob("*.json")) == bronze_log
    assert last_planned_batch(lakehouse.checkpoint("gold")) == gold_batches
    with pytest.raises(CheckpointError, match=r"rulewatch gold rescale --shards N. moves the state"):
        check_gold_layout(lakehouse.checkpoint("gold"), {"shards": 16, "state_slots": 0})

    # Without the flags the run resumes with the checkpoint's layout (not the default, so it is named) and
    # reads the new file (its lines repeat the first file's ids: silver calls them duplicates, gold gets no batch).
    assert main(run) == 0
    assert "gold's checkpoint began with --shards 2; resuming with it" in capsys.readouterr().out
    assert len(sorted(bronze_commits.glob("*.json"))) > len(bronze_log)
    assert json.loads((Path(lakehouse.checkpoint("gold")) / GOLD_LAYOUT).read_text())["shards"] == 2


def test_a_new_gold_reads_the_topic_by_default_over_kafka(tmp_path):
    from rulewatch.kafka.client import KafkaTopic
    from rulewatch.kafka.source import KafkaSource
    from rulewatch.spark.live.streams import LiveSettings, _direct_source

    kafka = KafkaSource(KafkaTopic("127.0.0.1:9092", "payments"))
    assert _direct_source(kafka, LiveSettings(), None) == kafka
    assert _direct_source(str(tmp_path / "landing"), LiveSettings(), None) is None
    assert _direct_source(kafka, LiveSettings(gold_from_source=False), None) is None
    with pytest.raises(ValueError, match="reads a Kafka topic"):
        _direct_source(str(tmp_path / "landing"), LiveSettings(gold_from_source=True), None)
    began = _ran(tmp_path / "began", {"shards": 4, "state_slots": 0, "shard_partitions": 4})  # a checkpoint keeps what it began with
    assert _direct_source(kafka, LiveSettings(), gold_source(str(began))) is None
    assert _direct_source(kafka, LiveSettings(gold_from_source=True), None) == kafka
