"""Shared fixtures: one local SparkSession and one pipeline run over the fixtures per test session."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"

# The commands and notebooks the tests start (they inherit the environment) compile with C1 only: a
# short-lived JVM otherwise spends most of its CPU in the JIT (docs/journal/benchmarks.md, "The test suite's
# JVMs"). This process's own session lives through the suite and keeps the full JIT (see spark()).
# C1 alone gets HotSpot's small code cache (48 MB instead of 240 MB), which a live stream restarting
# its queries filled in CI ("Out of space in CodeCache for method handle intrinsic" killed the JVM),
# so the cache keeps the full JIT's size. An explicit RULEWATCH_JAVA_OPTIONS, even an empty one, is kept.
os.environ.setdefault("RULEWATCH_JAVA_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m")


# The fast tier (`make test-fast`: no test marked jvm, kafka, ...) must not start a JVM. Its runs
# point JAVA_HOME at a folder that names the fix, so a JVM started by a test that lacks the jvm marker
# (in this process, a command or a notebook) fails with that name in its error instead of slowing the tier.
NO_JVM_HOME = "/nonexistent/the-fast-tier-starts-no-JVM--mark-this-test-jvm"


def fast_tier(config) -> bool:
    """Whether this run leaves out the tests that start a JVM (``-m "not jvm and not kafka and ..."``)."""
    expression = config.option.markexpr or ""
    return all(f"not {marker}" in expression for marker in ("jvm", "kafka"))


def pytest_configure(config):
    if fast_tier(config):
        os.environ["JAVA_HOME"] = NO_JVM_HOME


def pytest_collection_modifyitems(config, items):
    """jvm and kafka from the fixtures a test uses, so a new test is put in its tier without a decorator."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if "kafka_broker" in fixtures:
            item.add_marker(pytest.mark.kafka)
        if "spark" in fixtures or item.get_closest_marker("kafka"):
            item.add_marker(pytest.mark.jvm)


def cell_text(cell) -> str:
    """Everything an executed notebook code cell showed: printed text, and the HTML or text of displayed tables."""
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", ""))
        data = out.get("data", {})
        parts.append(data.get("text/html", "") or data.get("text/plain", ""))
    return "".join(parts)


def why_it_failed(stderr: str, limit: int = 6000) -> str:
    """A failed subprocess's stderr for an assertion message: its errors and their causes without
    the JVM's stack frames, which would otherwise fill the tail and hide the messages."""
    lines = [line for line in stderr.splitlines() if not line.lstrip().startswith(("at ", "... "))]
    return "\n".join(lines)[-limit:]


@pytest.fixture(scope="session")
def spark():
    from rulewatch.spark.runtime.session import get_spark

    if os.environ.get("JAVA_HOME") == NO_JVM_HOME:
        pytest.fail("this test uses Spark: mark it jvm (the fast tier starts no JVM)")
    started_commands = os.environ.pop("RULEWATCH_JAVA_OPTIONS", None)
    try:
        return get_spark("rulewatch-tests")
    finally:
        if started_commands is not None:
            os.environ["RULEWATCH_JAVA_OPTIONS"] = started_commands


@pytest.fixture(scope="session")
def notebook_kernel():
    """One Jupyter kernel for the suite's notebook and local job runs (tests/test_notebooks.py,
    test_job_local.py, test_explore_notebook.py, the Kafka bronze notebook): each notebook starts with
    an empty namespace, its own widget values and working directory, as a job's tasks do in the kernel
    a local job run starts; the kernel's JVM is started once instead of once per test (~20 s each). A
    test whose subject is a kernel's start or its environment (the lakehouse holder it inherits) starts
    its own."""
    from rulewatch.cli.jobs import SharedKernel

    with SharedKernel(ROOT) as shared:
        yield shared


@pytest.fixture
def job_kernel(notebook_kernel, monkeypatch):
    """``run_job_locally`` on this repository's bundle runs its tasks in ``notebook_kernel``. A job run
    inside ``rulewatch job run``'s hold on its lakehouse names this process as the holder to the kernels it
    starts (``jobs._named_holder``, inherited at their start); the lent kernel started earlier, so it is told
    the holder for the job's length. (That a kernel inherits it: test_job_local's tiny job run.)"""
    import nbformat

    from rulewatch.cli import jobs
    from rulewatch.spark.storage.lakehouse import HOLDER_ENV

    def name_holder(pid: str | None) -> None:
        source = f"import os\nos.environ[{HOLDER_ENV!r}] = {pid!r}" if pid else f"import os\nos.environ.pop({HOLDER_ENV!r}, None)"
        notebook_kernel.run(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)]), {}, timeout=60)

    class Borrowed:
        def __init__(self, cwd) -> None:
            assert Path(cwd).resolve() == ROOT, f"a job of another bundle ({cwd}) needs a kernel of its own"

        def __enter__(self):
            name_holder(os.environ.get(HOLDER_ENV))
            return notebook_kernel

        def __exit__(self, *_) -> None:
            name_holder(None)

    monkeypatch.setattr(jobs, "SharedKernel", Borrowed)


def bronze_frame(spark, lines: list[str], source: str = "f.jsonl", ingest_time=None):
    """Lines as bronze rows (valid UTF-8, numbered in order), for silver tests without a landing folder."""
    from rulewatch.spark.storage.schema import BRONZE

    unset = (None,) * (len(BRONZE.fields) - 4)  # exact bytes, file size and time, Kafka coordinates
    return spark.createDataFrame([(line, source, ingest_time, i, *unset) for i, line in enumerate(lines)], BRONZE)


@dataclass
class PipelineRun:
    lakehouse: "object"
    landing: Path
    summary: "object"


def run_fixture_pipeline(spark, root: Path) -> PipelineRun:
    from rulewatch.spark.storage.lakehouse import Lakehouse
    from rulewatch.spark.layers.pipeline import run_all

    landing = root / "landing"
    shutil.copytree(FIXTURES / "transactions", landing)
    lakehouse = Lakehouse(str(root / "lakehouse"))
    _, summary = run_all(spark, lakehouse, str(landing), str(FIXTURES / "rules.json"), log=lambda _: None)
    return PipelineRun(lakehouse, landing, summary)


@pytest.fixture(scope="session")
def fixture_run(spark, tmp_path_factory) -> PipelineRun:
    """The fixtures through bronze -> silver -> gold once; tests must not modify it."""
    return run_fixture_pipeline(spark, tmp_path_factory.mktemp("fixture-run"))


@pytest.fixture(scope="session")
def uninterrupted(spark, tmp_path_factory):
    """The batch job over test_crash's three generated files in one run: what every killed and restarted
    run there and in test_live_crash must equal. The files follow each other in event time, so how they are
    cut into runs and micro-batches changes no decision (gold is exact to the event). Tests only read it."""
    from processes import RULES, crash_files, land

    from rulewatch.spark.layers.pipeline import run_all
    from rulewatch.spark.storage.lakehouse import Lakehouse

    root = tmp_path_factory.mktemp("uninterrupted")
    for name, lines in crash_files():
        land(root / "landing", name, lines)
    lakehouse = Lakehouse(str(root / "lakehouse"))
    run_all(spark, lakehouse, str(root / "landing"), RULES, log=lambda _: None)
    return lakehouse


@pytest.fixture(scope="session")
def expected_alerts() -> list[dict]:
    return json.loads((FIXTURES / "expected_alerts.json").read_text())


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory):
    """A real local Kafka broker (KRaft) for the session; yields its bootstrap address."""
    from rulewatch.kafka import broker

    directory = tmp_path_factory.mktemp("kafka")
    started = broker.start(directory)
    yield started.bootstrap
    broker.stop(directory)


def consume_all(topic, expected: int, timeout: float = 60) -> list[dict]:
    """Every record on ``topic`` (values as JSON), reading until ``expected`` arrived and the topic stays quiet."""
    import time
    import uuid

    from confluent_kafka import Consumer

    from rulewatch.kafka.client import client_config

    consumer = Consumer(client_config(topic) | {"group.id": f"test-{uuid.uuid4()}", "auto.offset.reset": "earliest"})
    consumer.subscribe([topic.topic])
    records: list[dict] = []
    deadline, quiet_since = time.monotonic() + timeout, time.monotonic()
    try:
        while time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None:
                if len(records) >= expected and time.monotonic() - quiet_since > 3:
                    break
                continue
            assert message.error() is None, message.error()
            records.append({"key": message.key().decode(), **json.loads(message.value())})
            quiet_since = time.monotonic()
    finally:
        consumer.close()
    return records


@pytest.fixture
def stream_ends_when(monkeypatch):
    """``stream_ends_when(holds)``: an in-process `rulewatch stream` stops once ``holds(lines)`` is true of
    the lines its progress loop has logged, the way its ``--duration`` would stop it, so a test waits for
    what it is about instead of a fixed time. Its ``--duration`` stays as the bound on a stream that never
    gets there (the test then fails on what did not happen)."""
    from rulewatch.spark.live import streams

    def install(holds) -> None:
        follow = streams.follow

        def follow_until(monitor, until, log, **kwargs):
            logged: list[str] = []

            def keep(line: str) -> None:
                logged.append(line)
                log(line)

            follow(monitor, lambda: until() or holds(logged), keep, **kwargs)

        monkeypatch.setattr(streams, "follow", follow_until)

    return install
