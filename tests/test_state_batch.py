"""Batched MapState access (spark/evaluator/state_batch.py) against a stand-in state server on a real socket.

The stand-in answers like the JVM's: one request at a time, in order, each response written
(blocking) before the next request is read. It records whether the next request had already
arrived when one was answered, which tells a pipelined client from a synchronous one.
"""

from __future__ import annotations

import inspect
import os
import pickle
import random
import re
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import weakref
from unittest import mock
from datetime import datetime, timedelta
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import functions as F
from pyspark.sql.streaming.map_state_client import MapStateClient
from pyspark.sql.streaming.stateful_processor import MapState
from pyspark.sql.streaming.stateful_processor_api_client import StatefulProcessorApiClient
from pyspark.sql.types import BinaryType, StringType, StructField, StructType

from conftest import why_it_failed
from rulewatch.spark.evaluator import history
from rulewatch.spark.storage import schema
from rulewatch.spark.evaluator import state_batch
from rulewatch.spark.evaluator.history import GENERATION_KEYS, check_layout, history_store, unrecorded_layout
from rulewatch.spark.layers.gold import GoldSettings, start_gold
from rulewatch.spark.storage.lakehouse import Lakehouse, exclusive
from rulewatch.engine.rules import parse_rule
from rulewatch.spark.control.rules_table import apply_rules
from rulewatch.spark.layers.silver import ensure_silver_tables
from rulewatch.spark.evaluator.state_batch import PIPELINE_ENV, PipelinedMap, PublicMap, batched_map, pipeline_requested

KEY = StructType([StructField("key", StringType())])
BLOB = StructType([StructField("blob", BinaryType())])
REFUSED = "refuse-me"
UNIX_SOCKETS = "AF_UNIX" in inspect.getsource(StatefulProcessorApiClient.__init__)


class StandInServer:
    """A state server that keeps one map per state name, keyed by serialised user key."""

    def __init__(self, buffer_bytes: int | None = None) -> None:
        import pyspark.sql.streaming.proto.StateMessage_pb2 as pb

        self.pb = pb
        self.maps: dict[str, dict[bytes, bytes]] = {}
        self.answered = 0
        self.answered_with_next_waiting = 0
        # A Unix socket where pyspark's client speaks it (4.1 on): TCP with tiny buffers is slowed by
        # ACK timing. pyspark 4.0's client only connects to a TCP port on localhost.
        if UNIX_SOCKETS:
            folder = tempfile.mkdtemp(prefix="rulewatch-state-")
            # Removed when the server is collected or, at the latest, when the test process exits.
            weakref.finalize(self, shutil.rmtree, folder, True)
            self.path = os.path.join(folder, "server.sock")
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.listener.bind(self.path)
        else:
            self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.listener.bind(("localhost", 0))
            self.path = self.listener.getsockname()[1]
        self.listener.listen(1)
        self.buffer_bytes = buffer_bytes
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        if self.buffer_bytes:
            shrink(conn, self.buffer_bytes)
        self.pending, self.offset = bytearray(), 0
        with conn:
            while True:
                header = self._read(conn, 8)
                if header is None:
                    return
                _, length = struct.unpack(">ii", header)
                request = self.pb.StateRequest.FromString(self._read(conn, length))
                response = self._handle(request.stateVariableRequest.mapStateCall)
                self.answered += 1
                waiting = len(self.pending) > self.offset or select.select([conn], [], [], 0)[0]
                self.answered_with_next_waiting += bool(waiting)
                encoded = response.SerializeToString()
                conn.sendall(struct.pack(">i", len(encoded)) + encoded)
                if response.statusCode != 0:
                    # Like the JVM after an unexpected error: no more answers, socket left open.
                    threading.Event().wait()

    def _read(self, conn: socket.socket, n: int) -> bytes | None:
        while len(self.pending) - self.offset < n:
            chunk = conn.recv(1 << 16)
            if not chunk:
                return None
            del self.pending[: self.offset]
            self.offset = 0
            self.pending += chunk
        out = bytes(self.pending[self.offset : self.offset + n])
        self.offset += n
        return out

    def _handle(self, call) -> object:
        entries = self.maps.setdefault(call.stateName, {})
        kind = call.WhichOneof("method")
        if kind == "getValue":
            return self.pb.StateResponse(statusCode=0, value=entries.get(call.getValue.userKey, b""))
        if kind == "updateValue":
            if pickle.loads(call.updateValue.userKey) == (REFUSED,):
                return self.pb.StateResponse(statusCode=1, errorMessage="refused")
            entries[call.updateValue.userKey] = call.updateValue.value
        elif kind == "removeKey":
            entries.pop(call.removeKey.userKey, None)
        else:
            return self.pb.StateResponse(statusCode=1, errorMessage=f"unexpected {kind}")
        return self.pb.StateResponse(statusCode=0)

    def contents(self, name: str) -> dict:
        return {pickle.loads(k): pickle.loads(v) for k, v in self.maps.get(name, {}).items()}


def shrink(sock: socket.socket, buffer_bytes: int) -> None:
    """Small socket buffers, so that modest batches overflow them."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)


def map_state(server: StandInServer, name: str = "history") -> MapState:
    api = StatefulProcessorApiClient(server.path, KEY)
    return MapState(MapStateClient(api, KEY, BLOB), name)


def run_with_deadline(fn, seconds: float = 60):
    """``fn()``'s result; fails (instead of hanging the suite) if it does not return in time."""
    result: dict = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as error:
            result["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"no answer within {seconds} s: deadlocked"
    if "error" in result:
        raise result["error"]
    return result.get("value")


def workload(batched) -> list:
    """Updates, removes, reads of present and absent keys, small and large values."""
    small = [((f"k{i}",), (f"v{i}".encode() * (i % 7),)) for i in range(3_000)]
    large = [((f"big{i}",), (bytes([i]) * 300_000,)) for i in range(20)]
    batched.write_many(small + large)
    batched.write_many([((f"k{i}",), None) for i in range(0, 3_000, 3)] + [(("never-stored",), None)])
    batched.write_many([(("k1",), (b"rewritten",))])
    keys = [(f"k{i}",) for i in range(3_000)] + [(f"big{i}",) for i in range(20)] + [("absent",)]
    return batched.get_many(keys)


def test_pipelined_and_public_paths_read_and_leave_the_same_state():
    public_server, pipelined_server = StandInServer(), StandInServer()
    public = batched_map(map_state(public_server), pipeline=False)
    pipelined = batched_map(map_state(pipelined_server), pipeline=True)
    assert isinstance(public, PublicMap) and isinstance(pipelined, PipelinedMap)

    public_reads = run_with_deadline(lambda: workload(public))
    pipelined_reads = run_with_deadline(lambda: workload(pipelined))

    assert pipelined_reads == public_reads
    assert public_reads[1] == (b"rewritten",) and public_reads[0] is None and public_reads[-1] is None
    assert pipelined_server.contents("history") == public_server.contents("history")
    assert pipelined_server.answered == public_server.answered
    # Synchronous calls never have the next request waiting; pipelined ones nearly always do.
    assert public_server.answered_with_next_waiting == 0
    assert pipelined_server.answered_with_next_waiting > pipelined_server.answered * 0.9


def test_batches_larger_than_both_socket_buffers_do_not_deadlock():
    # 3 MB of requests, then 3 MB of responses, through buffers of a few kB: writing every request
    # before reading any response would leave both sides blocked writing.
    state = map_state(StandInServer(buffer_bytes=4_096))
    shrink(state._mapStateClient._stateful_processor_api_client._client_socket, 4_096)
    batched = batched_map(state, pipeline=True)
    blobs = [((f"b{i}",), (os.urandom(100_000),)) for i in range(30)]
    run_with_deadline(lambda: batched.write_many(blobs))
    assert run_with_deadline(lambda: batched.get_many([key for key, _ in blobs])) == [value for _, value in blobs]


def test_a_refused_call_raises_and_leaves_the_writer_thread_free():
    # The stand-in stops reading after the refusal, with most of the batch still to be written.
    batched = batched_map(map_state(StandInServer(buffer_bytes=4_096)), pipeline=True)
    items = [((f"k{i}",), (b"x",)) for i in range(500)] + [((REFUSED,), (b"x",))] + [((f"z{i}",), (b"x" * 1000,)) for i in range(500)]
    with pytest.raises(RuntimeError, match="refused"):
        run_with_deadline(lambda: batched.write_many(items))
    other = batched_map(map_state(StandInServer()), pipeline=True)
    assert run_with_deadline(lambda: other.get_many([("k",)]), seconds=10) == [None]


def test_a_key_that_cannot_be_serialised_fails_before_anything_is_sent():
    server = StandInServer()
    batched = batched_map(map_state(server), pipeline=True)
    with pytest.raises(Exception):
        batched.write_many([(("ok",), (b"x",)), (5, (b"x",))])
    assert server.answered == 0
    batched.write_many([(("ok",), (b"x",))])  # the socket is still in step
    assert run_with_deadline(lambda: batched.get_many([("ok",)])) == [(b"x",)]


# Entries each layout writes in the test below (a seed key, 400 keys, then the new key with half of
# them deleted): slots=0 one per written key; slots=4 each touched slot every flush; batch: the seed
# as a generation (its shard was empty), the 400 keys one entry each (the shard was not empty and
# nothing stored was read), then the new key as a generation, since the call read most stored keys;
# and each flush's record.
ROWS_WRITTEN = {"slots=0": 1 + 400 + 1, "slots=4": 1 + 4 + 4, "batch": 2 + (400 + 1) + 2}


@pytest.mark.parametrize("layout", list(ROWS_WRITTEN))
def test_history_store_state_and_counts_are_the_same_on_both_paths(layout):
    outcomes = []
    for pipeline in (False, True):
        server = StandInServer()
        store = history_store(map_state(server), layout, pipeline)
        assert store.state.pipelined is pipeline
        store.put_many({"ks\x1fseed": b"seed"})  # a batch-layout shard that is not empty writes per key
        store.flush()
        first = {f"ks\x1fg{i}": f"blob{i}".encode() * 50 for i in range(400)}
        store.put_many(first)
        store.flush()
        read = store.get_many(list(first) + ["ks\x1fmissing"])
        store.put_many({**{key: None for key in list(first)[::2]}, "ks\x1fnew": b"new"})
        store.flush()
        outcomes.append((read, store.get_many(list(first) + ["ks\x1fnew"]), server.contents("history"), store.rows_written, store.bytes_written))
    assert outcomes[0] == outcomes[1]
    read, after, _, rows, _ = outcomes[0]
    assert read["ks\x1fg3"] == b"blob3" * 50 and read["ks\x1fmissing"] is None
    assert after["ks\x1fg0"] is None and after["ks\x1fg1"] == b"blob1" * 50 and after["ks\x1fnew"] == b"new"
    assert rows == ROWS_WRITTEN[layout]


def test_a_fresh_shard_writes_its_first_call_as_one_generation():
    # A shard's first call (a backfill's first batch, a new job's first window) stores many keys at
    # once and its next calls are likely to read many of them: one entry, not one per key.
    server = StandInServer()
    state = map_state(server)  # the stand-in serves one connection
    store = history_store(state, "batch", True)
    store.open(fresh=True)
    blobs = {f"ks\x1fk{i}": f"blob{i}".encode() for i in range(10)}
    store.put_many({**blobs, "ks\x1fexpired": None})
    store.flush()
    assert {key[0] for key in server.contents("history")} == {"#gen1", "#where"} and store.rows_written == 2
    again = history_store(state, "batch", True)
    again.open(fresh=False)
    assert again.get_many([*blobs, "ks\x1fexpired"]) == {**blobs, "ks\x1fexpired": None}


@pytest.mark.parametrize("kept, expired", [(100, GENERATION_KEYS - 101), (100, GENERATION_KEYS - 100), (0, GENERATION_KEYS)])
def test_a_call_writes_a_generation_by_the_keys_it_touches_not_the_few_it_keeps(kept, expired):
    # A backfill over a million keys: each call keeps few of the keys it touches, the rest expire
    # before the next watermark and are dropped (None) without ever having been stored.
    server = StandInServer()
    state = map_state(server)  # the stand-in serves one connection
    first = history_store(state, "batch", True)
    first.open(fresh=True)
    first.put_many({"ks\x1fseed": b"seed"})  # a shard that stores something: not its first call
    first.flush()
    store = history_store(state, "batch", True)
    store.open(fresh=False)
    blobs = {f"ks\x1fk{i}": b"blob" for i in range(kept)}
    store.put_many({**blobs, **{f"ks\x1fx{i}": None for i in range(expired)}})
    store.flush()
    stored = {key[0] for key in server.contents("history")} - {"#gen1", "#where"}
    if not kept:  # nothing changed: nothing written
        assert stored == set() and store.rows_written == 0
    elif kept + expired < GENERATION_KEYS:  # one entry per kept key, and the record
        assert stored == set(blobs) and store.rows_written == kept + 1
    else:  # one generation, and the record
        assert stored == {"#gen2"} and store.rows_written == 2
    again = history_store(state, "batch", True)
    again.open(fresh=False)
    assert again.get_many([*blobs, "ks\x1fseed", "ks\x1fx0"]) == {**blobs, "ks\x1fseed": b"seed", "ks\x1fx0": None}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(
    st.lists(st.integers(0, 30), max_size=12),                                  # keys read first
    st.dictionaries(st.integers(0, 30), st.one_of(st.none(), st.binary(min_size=1, max_size=8)), max_size=12),
    st.booleans(),                                                               # a new store (another batch) first
), min_size=1, max_size=15), st.sampled_from([GENERATION_KEYS, 6]))
def test_the_batch_layout_reads_what_was_written_and_keeps_no_dead_entry(calls, generation_keys):
    # At 6 the touched-keys rule writes generations too (at 4,096 only the read-a-quarter rule can).
    with mock.patch.object(history, "GENERATION_KEYS", generation_keys):
        check_the_batch_layout_against_a_dict(calls)


def check_the_batch_layout_against_a_dict(calls):
    server = StandInServer()
    state = map_state(server)  # the stand-in serves one connection
    model: dict[str, bytes] = {}
    store = history_store(state, "batch", True)
    store.open(fresh=True)
    for reads, writes, reopen in calls:
        if reopen:
            store = history_store(state, "batch", True)
            store.open(fresh=False)
        keys = [f"ks\x1fk{k}" for k in reads]
        assert store.get_many(keys) == {key: model.get(key) for key in keys}
        blobs = {f"ks\x1fk{k}": v for k, v in writes.items()}
        store.put_many(blobs)
        store.flush()
        model = {k: v for k, v in {**model, **blobs}.items() if v is not None}
        stored = {key[0]: value[0] for key, value in server.contents("history").items()}
        names, places, sizes, _ = pickle.loads(stored.pop("#where")) if "#where" in stored else ([], [], {}, 1)
        where = dict(zip(names, places))
        assert where.keys() == model.keys()
        # Every entry is a key of its own or a generation some key still lives in, and holds its blob.
        gens = {f"#gen{g}": pickle.loads(blob) for g, blob in ((int(k[4:]), b) for k, b in stored.items() if k.startswith("#gen"))}
        assert set(gens) == {f"#gen{g}" for g in set(places) - {0}} == {f"#gen{g}" for g in sizes}
        assert {k for k in stored if not k.startswith("#gen")} == {key for key, place in where.items() if place == 0}
        for key, place in where.items():
            assert (stored[key] if place == 0 else gens[f"#gen{place}"][key]) == model[key]
    reopened = history_store(state, "batch", False)
    reopened.open(fresh=False)
    every = [f"ks\x1fk{k}" for k in range(31)]
    assert reopened.get_many(every) == {key: model.get(key) for key in every}


def test_a_shard_keeps_the_layout_it_began_with():
    assert unrecorded_layout(0, fresh=True) == "batch" and unrecorded_layout(16, fresh=True) == "slots=16"
    # State from before the record was written as state_slots said: 0 was one entry per key.
    assert unrecorded_layout(0, fresh=False) == "slots=0" and unrecorded_layout(16, fresh=False) == "slots=16"
    for recorded, state_slots in [("batch", 0), ("slots=0", 0), ("slots=16", 16)]:
        check_layout(recorded, state_slots)
    for recorded, state_slots in [("batch", 16), ("slots=0", 16), ("slots=16", 0), ("slots=16", 8)]:
        with pytest.raises(ValueError, match=f"written with {recorded}.*keep the state_slots setting"):
            check_layout(recorded, state_slots)


def test_a_shard_from_before_the_batch_layout_skips_keys_it_never_stored():
    server = StandInServer()
    state = map_state(server)
    old = history_store(state, "slots=0", True)
    old.open(fresh=False)  # a shard recorded before #members existed: every key is read
    old.put_many({"ks\x1fa": b"a"})
    old.flush()
    assert "#members" not in {key[0] for key in server.contents("history")}
    reopened = history_store(state, "slots=0", True)
    reopened.open(fresh=False)
    assert reopened.get_many(["ks\x1fa", "ks\x1fb"]) == {"ks\x1fa": b"a", "ks\x1fb": None}
    state.updateValue(("#members",), (pickle.dumps(["ks\x1fa"]),))
    counted = history_store(state, "slots=0", True)
    counted.open(fresh=False)
    before = server.answered
    assert counted.get_many(["ks\x1fa", "ks\x1fb"]) == {"ks\x1fa": b"a", "ks\x1fb": None}
    assert server.answered - before == 1  # b is not a member: not read
    counted.put_many({"ks\x1fb": b"b", "ks\x1fa": None})
    counted.flush()
    assert pickle.loads(server.contents("history")[("#members",)][0]) == ["ks\x1fb"]


def test_the_environment_switch_forces_the_public_path(monkeypatch):
    monkeypatch.setenv(PIPELINE_ENV, "0")
    assert not pipeline_requested()
    from rulewatch.spark.evaluator.processor import RuleProcessor

    assert RuleProcessor().state_pipeline is False
    monkeypatch.delenv(PIPELINE_ENV)
    assert pipeline_requested() and RuleProcessor().state_pipeline is True


def test_unpickling_the_processor_imports_neither_pandas_nor_numpy():
    # Spark unpickles it on the driver at every query start only to call init; the evaluator's
    # imports would cost that start ~0.5 s (docs/journal/benchmarks.md).
    from rulewatch.spark.evaluator.processor import RuleProcessor

    pickled = pickle.dumps(RuleProcessor(60_000, 0, 1000))
    code = "import pickle, sys; pickle.loads(sys.stdin.buffer.read()); print(sorted({'pandas', 'numpy'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], input=pickled, capture_output=True, check=True)
    assert result.stdout.decode().strip() == "[]"


def test_a_map_state_without_the_internal_client_falls_back():
    class OtherMapState(MapState):
        def __init__(self) -> None:
            pass

    assert "no MapStateClient" in state_batch.internals(OtherMapState())
    assert isinstance(batched_map(OtherMapState(), pipeline=True), PublicMap)


def test_a_changed_internal_signature_falls_back(monkeypatch):
    server = StandInServer()
    state = map_state(server)
    monkeypatch.setattr(StatefulProcessorApiClient, "_receive_proto_message", lambda self, timeout: None)
    state_batch._module_problem.cache_clear()
    try:
        assert "_receive_proto_message" in state_batch.internals(state)
        assert isinstance(batched_map(state, pipeline=True), PublicMap)
    finally:
        monkeypatch.undo()
        state_batch._module_problem.cache_clear()
    assert isinstance(batched_map(state, pipeline=True), PipelinedMap)


# ---------------------------------------------------------------------------------- in Spark's workers

# Runs in its own process so that it can also be a Spark Connect client. The processor lives in
# __main__, so it travels to the Python workers by value.
WORKER_PROBE = """
import shutil
import tempfile
import pandas as pd
from pyspark.sql.streaming import StatefulProcessor
from pyspark.sql.types import BinaryType, StringType, StructField, StructType
from rulewatch.spark.runtime.session import get_spark
from rulewatch.spark.evaluator.state_batch import batched_map

KEY = StructType([StructField("key", StringType())])
BLOB = StructType([StructField("blob", BinaryType())])

class Probe(StatefulProcessor):
    def init(self, handle):
        self.batched = batched_map(handle.getMapState("m", KEY, BLOB), pipeline=True)

    def handleInputRows(self, key, rows, timerValues):
        keys = [(k,) for frame in rows for k in frame["k"]]
        self.batched.write_many([(k, (k[0].encode() * 50,)) for k in keys])
        self.batched.write_many([(k, None) for k in keys[::2]])
        got = self.batched.get_many(keys + [("absent",)])
        expected = [None if i % 2 == 0 else (k[0].encode() * 50,) for i, k in enumerate(keys)] + [None]
        yield pd.DataFrame({"pipelined": [self.batched.pipelined], "correct": [got == expected]})

spark = get_spark("rulewatch-state-probe")
root = tempfile.mkdtemp()
spark.range(6000).selectExpr("cast(id % 3 as string) g", "cast(id as string) k").write.parquet(root + "/in")
events = spark.readStream.schema("g string, k string").parquet(root + "/in")
out = events.groupBy("g").transformWithStateInPandas(Probe(), "pipelined boolean, correct boolean", "Append", "None")
query = out.writeStream.format("memory").queryName("probe").option("checkpointLocation", root + "/cp").trigger(availableNow=True).start()
query.awaitTermination()
print("PROBE", sorted(tuple(r) for r in spark.table("probe").collect()))
shutil.rmtree(root)
"""


@pytest.mark.jvm
@pytest.mark.parametrize("remote", [None, "local[2]"], ids=["classic", "connect"])
def test_spark_python_workers_take_the_pipelined_path(remote):
    env = {k: v for k, v in os.environ.items() if k != "RULEWATCH_REMOTE"} | ({"RULEWATCH_REMOTE": remote} if remote else {})
    result = subprocess.run([sys.executable, "-c", WORKER_PROBE], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, why_it_failed(result.stderr)
    # Pipelined wherever this pyspark's internals pass the module's check (4.2 on); correct either way.
    pipelined = state_batch._module_problem() is None
    assert f"PROBE [{', '.join([f'({pipelined}, True)'] * 3)}]" in result.stdout, result.stdout[-2000:]


# --------------------------------------------------------------------------------- through gold (Spark)

T0 = datetime(2026, 11, 1, 10)
GOLD_RULES = [
    {"ruleId": 1, "groupingKeyNames": ["payeeId"], "aggregateFieldName": "paymentAmount",
     "aggregatorFunctionType": "SUM", "limitOperatorType": ">", "limit": 900, "window": "1h"},
    {"ruleId": 2, "groupingKeyNames": ["beneficiaryId"], "aggregateFieldName": "payeeId",
     "aggregatorFunctionType": "UNIQUE_COUNT", "limitOperatorType": ">=", "limit": 3, "window": "30m",
     "cooldown": "10m"},
]  # fmt: skip
# Each landed batch's segments: minutes after T0 and payee count (p0, p1, ...). The second batch moves
# the watermark 3 h on: the keys it touches expire before the next batch's watermark and are written no more,
# and the third batch's timers purge the keys it left alone (p750 on), whose state the first batch wrote.
GOLD_BATCHES = [[(0, 1_500)], [(20, 750), (200, 40)], [(205, 40)]]


def _gold_batch(spark, n: int):
    rows = []
    for segment, (start, payees) in enumerate(GOLD_BATCHES[n]):
        rng = random.Random(f"{n}.{segment}")
        rows += [
            (f"t{n}.{segment}-{i}", T0 + timedelta(minutes=start, seconds=rng.randrange(1_200)), f"p{rng.randrange(payees)}",
             f"b{rng.randrange(payees // 4 + 1)}", Decimal(rng.randrange(1, 50_000)) / 100)
            for i in range(4 * payees)
        ]  # fmt: skip
    if n == 1:
        rows.append(("late-1", T0 - timedelta(hours=3), "p1", "b1", Decimal(5)))  # past the 1 h lateness
    frame = spark.createDataFrame(rows, "transaction_id string, event_time timestamp, payee_id string, beneficiary_id string, payment_amount decimal(18,2)")
    return schema.conform(frame.withColumn("ingest_time", F.lit(T0)), schema.SILVER)


def _gold_outputs(spark, lakehouse: Lakehouse) -> dict[str, list]:
    """Everything gold wrote, minus wall-clock columns, and every state entry it holds."""
    wall_clock = {"decision_time", "latency_ms", "batch_start", "batch_end", "duration_ms"}
    tables = {
        "alerts": lakehouse.alerts, "window_metrics": lakehouse.window_metrics, "late_events": lakehouse.late_events,
    }  # fmt: skip
    out = {}
    for name, path in tables.items():
        frame = spark.read.format("delta").load(path)
        # A sketch's bytes may depend on the order its partial sketches merged in: compare what it counts.
        columns = [F.hll_sketch_estimate(c).alias(c) if c == "keys_sketch" else c for c in frame.columns if c not in wall_clock]
        out[name] = sorted((tuple(r) for r in frame.select(*columns).collect()), key=repr)
    metrics = spark.read.format("delta").load(lakehouse.pipeline_metrics).where("layer = 'gold'")
    counted = ["batch_id", "rows_in", "alerts", "keys_touched", "state_rows_written", "state_bytes_written"]
    out["pipeline_metrics"] = sorted(tuple(r) for r in metrics.select(*counted).collect())
    state_options = [("stateVarName", name) for name in ("history", "expiry", "rules", "layout")]
    for option, value in [*state_options, ("readRegisteredTimers", "true")]:
        state = spark.read.format("statestore").option(option, value).load(lakehouse.checkpoint("gold"))
        out[f"state:{value}"] = sorted(repr(tuple(r)) for r in state.collect())
    return out


@pytest.mark.slow
@pytest.mark.jvm
@pytest.mark.parametrize("slots", [0, 8])  # 0: the batch layout
def test_gold_gives_the_same_alerts_and_state_with_the_pipeline_on_off_and_switched(spark, tmp_path, monkeypatch, slots):
    """Two lakehouses take the same micro-batches: one always pipelined, the other restarted from
    its checkpoint with the path switched every run (public, pipelined, public), so each path
    reads state the other wrote."""
    lakehouses = {mode: Lakehouse(str(tmp_path / mode)) for mode in ("pipelined", "switched")}
    for lakehouse in lakehouses.values():
        ensure_silver_tables(spark, lakehouse)
        apply_rules(spark, lakehouse, [parse_rule(r) for r in GOLD_RULES])
    settings = GoldSettings(shards=2, state_slots=slots)
    with exclusive(lakehouses["pipelined"]), exclusive(lakehouses["switched"]):  # held, as a run holds its lakehouse
        held = []  # the payees with a history in state after each run (a blob names a key as payeeId\x1fp7)
        for n in range(len(GOLD_BATCHES)):
            batch = _gold_batch(spark, n)
            outputs = {}
            for mode, lakehouse in lakehouses.items():
                batch.write.format("delta").mode("append").save(lakehouse.silver_transactions)
                monkeypatch.setenv(PIPELINE_ENV, "0" if mode == "switched" and n % 2 == 0 else "1")
                start_gold(spark, lakehouse, settings).awaitTermination()
                outputs[mode] = _gold_outputs(spark, lakehouse)
            assert outputs["pipelined"] == outputs["switched"], f"after run {n + 1}"
            held.append(set(re.findall(r"payeeId\\x1f(p\d+)", " ".join(outputs["pipelined"]["state:history"]))))
    final = outputs["pipelined"]
    assert final["alerts"] and final["late_events"] and final["state:history"] and final["state:true"]
    untouched = [{p for p in payees if int(p[1:]) >= 750} for payees in held]
    # The second run kept the keys it left alone; the third's timers purged them: only its 40 payees are left.
    assert len(held[0]) > 1_000 and len(untouched[0]) > 500 and untouched[1] == untouched[0], [len(p) for p in held]
    assert held[2] and held[2] <= {f"p{i}" for i in range(40)}, sorted(held[2])
    if not slots:  # new shards take the batch layout; the first batches wrote generations
        assert final["state:layout"] and all("'batch'" in entry for entry in final["state:layout"])
        assert any("'#where'" in entry for entry in final["state:history"])


# ---- request bytes: the shortcuts give exactly pyspark's bytes, or are not taken -------------------


def _pyspark_client() -> StatefulProcessorApiClient:
    from pyspark.serializers import CPickleSerializer

    api = StatefulProcessorApiClient.__new__(StatefulProcessorApiClient)  # its serialisers need no socket
    api.pickleSer = CPickleSerializer()
    return api


@settings(max_examples=200, deadline=None)
@given(key=st.text(max_size=300), value=st.binary(max_size=70_000), name=st.text(min_size=1, max_size=40))
def test_plain_pickle_and_concatenated_fields_give_pysparks_bytes(key, value, name):
    import numpy as np
    import pyspark.sql.streaming.proto.StateMessage_pb2 as pb

    api = _pyspark_client()
    keys, values = state_batch._Encoder(api, KEY), state_batch._Encoder(api, BLOB)
    requests = state_batch._Requests(pb, name)
    assert keys.fast and values.fast and requests.fast
    for row in [(key,), (np.str_(key),)]:  # a numpy string is normalised by pyspark first
        assert keys(row) == api._serialize_to_bytes(KEY, row)
    assert values((value,)) == api._serialize_to_bytes(BLOB, (value,))
    k, v = keys((key,)), values((value,))
    call = lambda **c: pb.StateRequest(stateVariableRequest=pb.StateVariableRequest(mapStateCall=pb.MapStateCall(stateName=name, **c))).SerializeToString()  # noqa: E731
    assert requests.get(k) == call(getValue=pb.GetValue(userKey=k))
    assert requests.update(k, v) == call(updateValue=pb.UpdateValue(userKey=k, value=v))
    assert requests.remove(k) == call(removeKey=pb.RemoveKey(userKey=k))


def test_a_schema_that_needs_conversion_keeps_pysparks_serialiser():
    from pyspark.sql.types import TimestampType

    api = _pyspark_client()
    schema = StructType([StructField("at", TimestampType())])
    encoder = state_batch._Encoder(api, schema)
    row = (datetime(2026, 11, 24, 5, 0),)
    assert not encoder.fast
    assert encoder(row) == api._serialize_to_bytes(schema, row) != pickle.dumps(row)
