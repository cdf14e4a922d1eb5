"""Batched MapState access: a batch's state requests are written ahead of reading their responses.

Why: every MapState call from Python is a synchronous round trip to the JVM state server
(60-150 µs, more on a busy machine) and the evaluator makes one or two per touched key. The server
reads requests from one socket and answers each in order, so requests can be written ahead of
their responses (perf-notes.md, "State calls can be pipelined"). pyspark 4.2's public API has no
multi-get or multi-put for MapState, so the pipelined path drives pyspark's internal state client.

This module is the only place that touches those internals. ``batched_map`` checks them when a map
is wrapped (in the processor's ``init``) and falls back to the public per-key calls when anything is
missing or shaped differently, or when ``RULEWATCH_STATE_PIPELINE=0``. Both paths send the same
requests in the same order, so they leave the same state.

Building a request cost more than sending it (pyspark pickles each key through cloudpickle after
normalising numpy values, then builds four protobuf objects): for the plain str/bytes rows the
evaluator sends, a plain pickle and concatenated protobuf fields give the same bytes, checked on
probes when a map is wrapped, at about a third of the cost.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import itertools
import logging
import os
import pickle
import queue
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

from pyspark.sql.streaming.stateful_processor import MapState
from pyspark.serializers import pickle_protocol as _PROTOCOL
from pyspark.sql.types import BinaryType, BooleanType, DoubleType, IntegerType, LongType, StringType, StructType

from rulewatch.spark.runtime.env import switched_off
from rulewatch.spark.runtime.jars import SPARK_LINE

PIPELINE_ENV = "RULEWATCH_STATE_PIPELINE"

Key = tuple[Any, ...]
Value = tuple[Any, ...]

_log = logging.getLogger(__name__)

# On pyspark 4.0 (Databricks Runtime 17.x) the state server refused pipelined updates ("invalid
# pickle opcode: 0", in the gold test with 8 state slots and through Spark Connect) although every
# check below passes; 4.1 was never tried. Older lines take the public path.
MIN_PYSPARK = (4, 2)

# Internal methods used, with the parameters (after self) they are expected to take.
_API_METHODS: dict[str, tuple[str, ...]] = {
    "_serialize_to_bytes": ("schema", "data"),
    "_deserialize_from_bytes": ("value",),
    "_send_proto_message": ("message",),
    "_receive_proto_message": (),
}
# Protobuf messages built or read, with the fields used.
_PROTO_FIELDS: dict[str, tuple[str, ...]] = {
    "StateRequest": ("stateVariableRequest",),
    "StateVariableRequest": ("mapStateCall",),
    "MapStateCall": ("stateName", "getValue", "updateValue", "removeKey"),
    "GetValue": ("userKey",),
    "UpdateValue": ("userKey", "value"),
    "RemoveKey": ("userKey",),
    "StateResponse": ("statusCode", "errorMessage", "value"),
}


def pipeline_requested() -> bool:
    """Whether the environment allows the pipelined path (``RULEWATCH_STATE_PIPELINE=0`` forbids it)."""
    return not switched_off(PIPELINE_ENV)


class BatchedMap(Protocol):
    pipelined: bool

    def get_many(self, keys: Sequence[Key]) -> list[Value | None]:
        """Each key's value (None: absent), in the order of ``keys``."""
        ...

    def write_many(self, items: Sequence[tuple[Key, Value | None]]) -> None:
        """Update each key to its value, or remove it where the value is None, in order."""
        ...


class PublicMap:
    """The public API: one synchronous round trip per key."""

    pipelined = False

    def __init__(self, state: MapState) -> None:
        self.state = state

    def get_many(self, keys: Sequence[Key]) -> list[Value | None]:
        return [self.state.getValue(key) for key in keys]

    def write_many(self, items: Sequence[tuple[Key, Value | None]]) -> None:
        for key, value in items:
            if value is None:
                self.state.removeKey(key)
            else:
                self.state.updateValue(key, value)


@dataclass(frozen=True)
class _Internals:
    api: Any  # pyspark's StatefulProcessorApiClient: the state socket and its (de)serialisers
    name: str
    key_schema: StructType
    value_schema: StructType
    proto: Any  # pyspark's StateMessage_pb2 module


class _FrameSink:
    """Stands in for the API client so pyspark's own ``_send_proto_message`` frames a request into
    memory: the wire format then stays pyspark's, and many frames go out in one socket write."""

    def __init__(self) -> None:
        self.sockfile = io.BytesIO()


class _Writer:
    """One thread per process that writes queued payloads to their state sockets, in order.

    Writing from another thread than the one reading the responses is what rules out a deadlock:
    with both sides writing (requests here, responses in the JVM) and neither reading, a large
    batch would fill both socket buffers. One long-lived thread, because starting a thread per
    batch costs more than the round trips of a small batch.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[_Internals, bytes]] = queue.SimpleQueue()
        self._pid: int | None = None
        self._lock = threading.Lock()

    def submit(self, parts: _Internals, payload: bytes) -> None:
        with self._lock:
            # Threads do not survive a fork: a child process starts its own.
            if self._pid != os.getpid():
                self._pid, self._jobs = os.getpid(), queue.SimpleQueue()
                threading.Thread(target=self._run, args=(self._jobs,), name="rulewatch-state-writer", daemon=True).start()
            self._jobs.put((parts, payload))

    @staticmethod
    def _run(jobs: queue.SimpleQueue[tuple[_Internals, bytes]]) -> None:
        while True:
            parts, payload = jobs.get()
            try:
                parts.api.sockfile.write(payload)
                parts.api.sockfile.flush()
            except Exception:
                _log.exception("rulewatch: writing pipelined state requests failed; closing the state socket")
                # The reading thread then fails on the closed socket instead of waiting forever.
                with contextlib.suppress(OSError):
                    parts.api._client_socket.shutdown(socket.SHUT_RDWR)


_writer = _Writer()

# Requests framed per socket write. Small enough that the JVM starts on the first ones while the
# rest are still being serialised here, large enough that a write carries many.
_CHUNK = 128


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SHORT = [bytes((n,)) for n in range(0x80)]  # the varint of a length below 128: most keys and requests


def _field(tag: bytes, payload: bytes) -> bytes:
    """One length-delimited protobuf field; ``tag`` from ``_tag``."""
    n = len(payload)
    return tag + (_SHORT[n] if n < 0x80 else _varint(n)) + payload


def _tag(number: int) -> bytes:
    return _varint(number << 3 | 2)


class _Requests:
    """A MapState call's StateRequest bytes, by protobuf or, where that gives the same bytes (checked
    on probes when built), by concatenating fields: the message objects cost more than the call."""

    def __init__(self, proto: Any, name: str) -> None:
        self._pb, self._name = proto, name

        def number(message: str, name: str) -> int:
            return getattr(proto, message).DESCRIPTOR.fields_by_name[name].number

        self._n = {
            (m, f): _tag(number(m, f))
            for m, fields in _PROTO_FIELDS.items() if m != "StateResponse"
            for f in fields
        }  # fmt: skip
        self._prefix = _field(self._n["MapStateCall", "stateName"], name.encode())
        self.fast = False
        probes = [(b"k" * size, b"v" * (size * 3 + 1)) for size in (1, 40, 127, 128, 300, 20_000)]
        self.fast = all(
            self.get(k) == self._slow(getValue=proto.GetValue(userKey=k))
            and self.update(k, v) == self._slow(updateValue=proto.UpdateValue(userKey=k, value=v))
            and self.remove(k) == self._slow(removeKey=proto.RemoveKey(userKey=k))
            for k, v in probes
        )

    def get(self, key: bytes) -> bytes:
        if not self.fast:
            return self._slow(getValue=self._pb.GetValue(userKey=key))
        return self._wrap(_field(self._n["MapStateCall", "getValue"], _field(self._n["GetValue", "userKey"], key)))

    def update(self, key: bytes, value: bytes) -> bytes:
        if not self.fast:
            return self._slow(updateValue=self._pb.UpdateValue(userKey=key, value=value))
        body = _field(self._n["UpdateValue", "userKey"], key) + _field(self._n["UpdateValue", "value"], value)
        return self._wrap(_field(self._n["MapStateCall", "updateValue"], body))

    def remove(self, key: bytes) -> bytes:
        if not self.fast:
            return self._slow(removeKey=self._pb.RemoveKey(userKey=key))
        return self._wrap(_field(self._n["MapStateCall", "removeKey"], _field(self._n["RemoveKey", "userKey"], key)))

    def _wrap(self, call: bytes) -> bytes:
        variable = _field(self._n["StateVariableRequest", "mapStateCall"], self._prefix + call)
        return _field(self._n["StateRequest", "stateVariableRequest"], variable)

    def _slow(self, **call: Any) -> bytes:
        pb = self._pb
        map_call = pb.MapStateCall(stateName=self._name, **call)
        return pb.StateRequest(stateVariableRequest=pb.StateVariableRequest(mapStateCall=map_call)).SerializeToString()


# Values pickled as they are: pyspark's serialiser converts nothing else for the schemas checked below.
_PLAIN = frozenset({str, bytes, int, float, bool, type(None)})
_PROBES = {StringType: "prob\u00e9", BinaryType: b"\x00probe", LongType: 7, IntegerType: 7, DoubleType: 1.5, BooleanType: True}


class _Encoder:
    """pyspark's bytes for a row of ``schema``: a plain pickle where that gives the same bytes
    (checked on a probe row when built), pyspark's serialiser otherwise (it first normalises numpy
    and pandas values, which costs more than the pickle)."""

    def __init__(self, api: Any, schema: StructType) -> None:
        self._api, self._schema = api, schema
        types = [type(f.dataType) for f in schema.fields]
        self.fast = all(t in _PROBES for t in types) and not any(f.needConversion() for f in schema.fields)
        if self.fast:
            probe = tuple(_PROBES[t] for t in types)
            self.fast = pickle.dumps(probe, _PROTOCOL) == api._serialize_to_bytes(schema, probe)

    def __call__(self, row: tuple[Any, ...]) -> bytes:
        if self.fast and type(row) is tuple and all(type(v) in _PLAIN for v in row):
            return pickle.dumps(row, _PROTOCOL)
        return self._api._serialize_to_bytes(self._schema, row)


class PipelinedMap:
    """Sends a batch's requests through the writer thread, chunk by chunk as they are serialised,
    then reads the responses in order on the calling thread."""

    pipelined = True

    def __init__(self, parts: _Internals) -> None:
        self._parts = parts
        self._send: Callable[[Any, bytes], None] = type(parts.api)._send_proto_message
        self._key = _Encoder(parts.api, parts.key_schema)
        self._value = _Encoder(parts.api, parts.value_schema)
        self._requests = _Requests(parts.proto, parts.name)

    def get_many(self, keys: Sequence[Key]) -> list[Value | None]:
        values = self._exchange(self._requests.get(self._key(key)) for key in keys)
        # An absent key comes back as an empty value (as in pyspark's MapStateClient.get_value).
        return [self._parts.api._deserialize_from_bytes(value) if value else None for value in values]

    def write_many(self, items: Sequence[tuple[Key, Value | None]]) -> None:
        self._exchange(
            self._requests.remove(self._key(key)) if value is None else self._requests.update(self._key(key), self._value(value))
            for key, value in items
        )

    def _exchange(self, requests: Iterable[bytes]) -> list[bytes]:
        """Every request's response value, in order."""
        sent = 0
        pending = iter(requests)
        try:
            while chunk := list(itertools.islice(pending, _CHUNK)):
                sink = _FrameSink()
                for request in chunk:
                    self._send(sink, request)
                _writer.submit(self._parts, sink.sockfile.getvalue())
                sent += len(chunk)
        except BaseException:
            # A request that cannot be built fails the batch; what was sent is answered first, so
            # the socket stays in step for the calls after this one.
            self._responses(sent)
            raise
        return self._responses(sent)

    def _responses(self, count: int) -> list[bytes]:
        try:
            return [self._response() for _ in range(count)]
        except BaseException:
            # The server may stop reading after an error, with requests of this batch still to
            # send: close the socket so the writer thread is not stuck on it. The task fails, and
            # its state socket with it.
            with contextlib.suppress(OSError):
                self._parts.api._client_socket.shutdown(socket.SHUT_RDWR)
            raise

    def _response(self) -> bytes:
        status, error, value = self._parts.api._receive_proto_message()
        if status != 0:
            raise RuntimeError(f"state server refused a pipelined MapState call (status {status}): {error}")
        return value


def batched_map(state: MapState, pipeline: bool) -> BatchedMap:
    """``state`` with batched access: pipelined when asked for and pyspark's internals check out,
    the public per-key calls otherwise."""
    if not pipeline:
        return PublicMap(state)
    parts = internals(state)
    if isinstance(parts, str):
        _warn_fallback(parts)
        return PublicMap(state)
    return PipelinedMap(parts)


def internals(state: MapState) -> _Internals | str:
    """The internal objects the pipelined path drives, or why they cannot be used."""
    problem = _module_problem()
    if problem:
        return problem
    from pyspark.sql.streaming.map_state_client import MapStateClient
    from pyspark.sql.streaming.stateful_processor_api_client import StatefulProcessorApiClient

    client = getattr(state, "_mapStateClient", None)
    name = getattr(state, "_stateName", None)
    if not isinstance(client, MapStateClient) or not isinstance(name, str):
        return f"{type(state).__name__} has no MapStateClient and state name"
    api = getattr(client, "_stateful_processor_api_client", None)
    # Exactly pyspark's class: its framing and reading are what was checked, not a subclass's.
    if type(api) is not StatefulProcessorApiClient:
        return f"the MapStateClient talks through {type(api).__name__}, not pyspark's StatefulProcessorApiClient"
    key_schema, value_schema = getattr(client, "user_key_schema", None), getattr(client, "value_schema", None)
    if not isinstance(key_schema, StructType) or not isinstance(value_schema, StructType):
        return "the MapStateClient has no key and value schemas"
    sockfile = getattr(api, "sockfile", None)
    if not all(callable(getattr(sockfile, method, None)) for method in ("read", "write", "flush")):
        return "the StatefulProcessorApiClient has no readable and writable sockfile"
    if not isinstance(getattr(api, "_client_socket", None), socket.socket):
        return "the StatefulProcessorApiClient has no socket"
    import pyspark.sql.streaming.proto.StateMessage_pb2 as proto

    return _Internals(api, name, key_schema, value_schema, proto)


@functools.cache
def _module_problem() -> str | None:
    """What is wrong with pyspark's state client classes and messages for this use, if anything
    (checked once per process)."""
    import pyspark

    if SPARK_LINE < MIN_PYSPARK:
        return f"pipelining is verified on pyspark {'.'.join(map(str, MIN_PYSPARK))} and newer, this is {pyspark.__version__}"
    try:
        import pyspark.sql.streaming.proto.StateMessage_pb2 as proto
        from pyspark.sql.streaming.stateful_processor_api_client import StatefulProcessorApiClient
    except ImportError as error:
        return f"pyspark's state client cannot be imported: {error}"
    for method, params in _API_METHODS.items():
        found = getattr(StatefulProcessorApiClient, method, None)
        if not callable(found):
            return f"StatefulProcessorApiClient.{method} is missing"
        if tuple(inspect.signature(found).parameters)[1:] != params:
            return f"StatefulProcessorApiClient.{method} takes {inspect.signature(found)}, expected (self, {', '.join(params)})"
    for message, fields in _PROTO_FIELDS.items():
        descriptor = getattr(getattr(proto, message, None), "DESCRIPTOR", None)
        missing = [f for f in fields if descriptor is None or f not in descriptor.fields_by_name]
        if missing:
            return f"state protocol message {message} lacks {', '.join(missing)}"
    return _framing_problem(StatefulProcessorApiClient)


def _framing_problem(api_class: type) -> str | None:
    # Framing through a stand-in only works if _send_proto_message writes the message, behind a
    # header, to self.sockfile and nothing else.
    sink = _FrameSink()
    try:
        api_class._send_proto_message(sink, b"probe")
    except Exception as error:
        return f"StatefulProcessorApiClient._send_proto_message does not frame into a buffer: {error!r}"
    frame = sink.sockfile.getvalue()
    if not (frame.endswith(b"probe") and len(frame) > len(b"probe")):
        return "StatefulProcessorApiClient._send_proto_message writes an unexpected frame"
    return None


@functools.cache
def _warn_fallback(reason: str) -> None:
    _log.warning("rulewatch: MapState calls are not pipelined (%s); using one round trip per call", reason)
