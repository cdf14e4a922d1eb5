"""The pure parts of ``gold rescale``: a shard's stored keys read back from its entries in every layout,
where a checkpoint stopped, and the new checkpoint's refusal to start other than from the rescale."""

from __future__ import annotations

import json
import random
from unittest import mock

import pytest

from rulewatch.spark.evaluator import history
from rulewatch.spark.evaluator.history import history_store, stored_histories
from rulewatch.spark.storage.checkpoints import (
    GOLD_LAYOUT,
    STARTING_VERSIONS,
    CheckpointError,
    batch_base,
    check_checkpoint,
    check_gold_layout,
    committed_sources,
)
from rulewatch.spark.storage.sinks import shifted


class DictMap:
    """A MapState over a dict, as the public path calls it."""

    def __init__(self) -> None:
        self.entries: dict[str, bytes] = {}

    def getValue(self, key):  # noqa: N802
        value = self.entries.get(key[0])
        return None if value is None else (value,)

    def updateValue(self, key, value):  # noqa: N802
        self.entries[key[0]] = value[0]

    def removeKey(self, key):  # noqa: N802
        self.entries.pop(key[0], None)


@pytest.mark.parametrize("layout", ["batch", "slots=0", "slots=3"])
def test_every_stored_key_and_only_those_come_back_from_a_shards_entries(layout):
    rng = random.Random(5)
    state = DictMap()
    model: dict[str, bytes] = {}
    # Small generations, so keys move between them, own entries and deletions leave dead blobs behind.
    with mock.patch.object(history, "GENERATION_KEYS", 6):
        store = history_store(state, layout, pipeline=False)
        for call in range(30):
            store.open(fresh=not state.entries)
            keys = [f"payeeId\x1fp{rng.randrange(40)}" for _ in range(rng.choice([1, 2, 8, 20]))]
            store.get_many(keys)
            writes = {key: None if rng.random() < 0.2 else f"{key}@{call}".encode() for key in keys}
            store.put_many(writes)
            store.flush()
            for key, blob in writes.items():
                if blob is None:
                    model.pop(key, None)
                else:
                    model[key] = blob
    assert model
    if layout != "slots=0":  # one entry per key there; elsewhere entries hold several keys, some of them dead
        assert set(state.entries) != set(model)
    assert stored_histories(state.entries, layout) == model
    assert stored_histories({}, layout) == {}


def _checkpoint(root, offsets: list[str], commit: dict, record: dict | None = None):
    (root / "offsets").mkdir(parents=True)
    (root / "commits").mkdir()
    (root / "offsets" / "4").write_text("\n".join(["v1", json.dumps({"batchWatermarkMs": 0, "conf": {}}), *offsets]) + "\n")
    (root / "commits" / "4").write_text("v1\n" + json.dumps(commit) + "\n")
    if record is not None:
        (root / GOLD_LAYOUT).write_text(json.dumps(record))
    return str(root)


def _offset(table: str, version: int, index: int = -1) -> str:
    return json.dumps({"sourceVersion": 1, "reservoirId": table, "reservoirVersion": version, "index": index, "isStartingVersion": False})


def test_where_a_checkpoint_stopped_is_read_from_its_last_committed_batch(tmp_path):
    checkpoint = _checkpoint(tmp_path / "a", [_offset("silver-id", 7), "-", _offset("rules-id", 3)], {"nextBatchWatermarkMs": 123})
    assert committed_sources(checkpoint) == (4, 123, {"silver-id": 7, "rules-id": 3})
    inside = _checkpoint(tmp_path / "b", [_offset("silver-id", 7, index=2)], {"nextBatchWatermarkMs": 0})
    with pytest.raises(CheckpointError, match="stopped inside version 7"):
        committed_sources(inside)


def test_a_rescaled_checkpoint_starts_only_from_the_rescale_and_numbers_on_from_the_old(tmp_path):
    layout = {"shards": 8, "state_slots": 0}
    pending = tmp_path / "gold"
    pending.mkdir()
    (pending / GOLD_LAYOUT).write_text(json.dumps({**layout, "shard_partitions": 8, "batch_base": 5, STARTING_VERSIONS: {"silver": 7}}))
    with pytest.raises(CheckpointError, match="rescale to 8 shards did not finish"):
        check_gold_layout(str(pending), layout, partitions=8)
    assert check_gold_layout(str(pending), layout, partitions=8, rescaling=True) == 8
    # The record keeps what the rescale wrote beside the layout.
    assert batch_base(str(pending)) == 5 and STARTING_VERSIONS in json.loads((pending / GOLD_LAYOUT).read_text())
    # Its batch 0 is the tables' batch 5: a table holding batch 5 of the old query is not ahead of it...
    held = {"rulewatch.gold.alerts": 4}

    class Commits:
        def committed_batches(self, table, prefix):
            return held

    check_checkpoint(str(pending), [("alerts", "rulewatch.gold.")], Commits())
    held["rulewatch.gold.alerts"] = 5  # ...but one holding batch 5 already is: it would skip the new batch 0
    with pytest.raises(CheckpointError, match="batch 5"):
        check_checkpoint(str(pending), [("alerts", "rulewatch.gold.")], Commits())


def test_a_shifted_write_gets_the_tables_batch_ids():
    seen = []
    write = shifted(lambda frame, batch_id: seen.append(batch_id), 5)
    write(None, 0)
    write(None, 3)
    assert seen == [5, 8]
    plain = lambda frame, batch_id: None  # noqa: E731
    assert shifted(plain, 0) is plain
