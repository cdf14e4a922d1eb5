"""Helpers for tests whose subject is a process: a command run in its own process group and reaped whole,
``rulewatch`` attempts killed at a crash point, and the generated files the crash tests land.

test_crash, test_live_crash, test_kafka_pipeline, test_connect, test_gold_layout, test_scale (and its
cluster driver script, which imports this module and nothing of pytest's) and conftest's ``uninterrupted``
share them.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from pyspark.sql import functions as F

from rulewatch.cli.main import main
from rulewatch.spark.storage.checkpoints import last_planned_batch
from rulewatch.spark.storage.delta_log import sink_batches
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.storage.sinks import CRASH_AT_ENV

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
RULES = str(FIXTURES / "rules.json")
# Columns that record when a row was processed, not what was decided: they differ between any two runs.
PROCESSING_COLUMNS = {"decision_time", "ingest_time", "latency_ms", "gold_batch_id"}
START = datetime(2026, 11, 1, 8, 0, tzinfo=timezone.utc)


def _events(rng: random.Random, start: datetime, count: int, prefix: str) -> list[str]:
    """``count`` payment / login lines in time order (a few seconds apart), one malformed and one repeated line."""
    lines, now = [], start
    for i in range(count):
        now += timedelta(seconds=rng.randint(5, 40))
        ms = int(now.timestamp() * 1000)
        if rng.random() < 0.7:
            event = {"transactionId": f"{prefix}-p{i}", "eventTime": ms, "payeeId": f"payee-{rng.randint(0, 4)}",
                     "beneficiaryId": f"ben-{rng.randint(0, 1)}", "paymentAmount": rng.randint(50, 400),
                     "paymentType": rng.choice(["CSH", "CRD"])}  # fmt: skip
        else:
            event = {"transactionId": f"{prefix}-l{i}", "eventTime": ms, "userId": f"u-{rng.randint(0, 2)}",
                     "ip": f"203.0.113.{rng.randint(1, 8)}", "action": "login"}  # fmt: skip
        lines.append(json.dumps(event))
    lines.insert(count // 2, lines[count // 3])  # a repeated transaction id
    lines.insert(count // 4, '{"transactionId": "' + prefix + '-torn", "eventTime": 17')  # a torn line
    return lines


def crash_files() -> list[tuple[str, list[str]]]:
    rng = random.Random(7)
    first = _events(rng, START, 150, "a")
    second = _events(rng, START + timedelta(hours=2), 150, "b")
    third = _events(rng, START + timedelta(hours=4), 60, "c")
    return [("part-1.jsonl", first), ("part-2.jsonl", second), ("part-3.jsonl", third)]


def land(landing: Path, name: str, lines: list[str]) -> None:
    landing.mkdir(parents=True, exist_ok=True)
    tmp = landing.parent / f".{name}.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    tmp.rename(landing / name)  # appears whole, as a real upload would


def reap(group: int) -> None:
    """Kill what is left of an attempt (the JVM outlives a killed Python driver for a moment)."""
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise AssertionError(f"process group {group} survived SIGKILL")


def run_cli(
    args: list[str], crash_at: str | None = None, kill_after: float | None = None, timeout: float = 600, output: list[str] | None = None
) -> int:
    """``python -m rulewatch.cli.main ARGS`` in its own process group; its exit code (-9 when killed).
    Its stdout, then its stderr, as the user's terminal would show them, are appended to ``output``."""
    env = {k: v for k, v in os.environ.items() if k not in (CRASH_AT_ENV, "RULEWATCH_JVM_OUTPUT")}
    env["PYTHONUNBUFFERED"] = "1"  # what a killed attempt printed before the kill reaches the pipe
    if crash_at:
        env[CRASH_AT_ENV] = crash_at
    code, out, err = run_grouped([sys.executable, "-m", "rulewatch.cli.main", *args], kill_after or timeout, env)
    printed = out + err
    if output is not None:
        output.append(printed)
    if code not in (0, -signal.SIGKILL):
        # Spark appends whole query plans to its errors; the lines naming an error are what matter.
        errors = [line[:400] for line in printed.splitlines() if re.search(r"Error|Exception|rulewatch:", line)]
        raise AssertionError(f"{args[0]} {crash_at or kill_after} exited {code}:\n" + "\n".join(errors[:20]))
    return code


def run_grouped(command: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``command`` in its own process group, the group killed once ``timeout`` seconds have passed; its exit
    code (-9 when killed then, even if its first process had ended and another held its output open), stdout
    and stderr. Nothing of the group outlives the call, whatever ends it (Ctrl-C reaches only the tests'
    process group)."""
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
        code = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        code = -signal.SIGKILL
    finally:
        if process.poll() is None:  # an interrupted wait: the leader goes first, a zombie would outlive reap's wait
            process.kill()
            process.wait()
        reap(process.pid)
    return code, out.decode(), err.decode()


def attempt(
    lakehouse: Lakehouse, source: list[str], crash_at: str | None = None, kill_after: float | None = None, extra: list[str] = (),
    output: list[str] | None = None,
) -> int:
    """One ``rulewatch run`` over ``source`` (its options); returns its exit code (-9 when killed)."""
    return run_cli(["run", "--lakehouse", lakehouse.root, *source, "--rules", RULES, *extra], crash_at, kill_after, output=output)


def next_batch(lakehouse: Lakehouse, query: str) -> int:
    """The id of ``query``'s next new micro-batch: one past the newest it planned (a planned batch is replayed first)."""
    return last_planned_batch(lakehouse.checkpoint(query)) + 1


def finish(lakehouse: Lakehouse, source: list[str], extra: list[str] = ()) -> int:
    """The run after the kills, in this process on the tests' session: what it must do is what a new
    process does (resume from the tables and checkpoints on disk), and it skips a JVM's start."""
    return main(["run", "--lakehouse", lakehouse.root, *source, "--rules", RULES, *extra])


def metrics_commits(lakehouse: Lakehouse) -> list[set[str]]:
    """The sinks each ``pipeline_metrics`` commit names (its own and ``alsoBatches``), oldest first."""
    log = Path(lakehouse.pipeline_metrics, "_delta_log")
    named = []
    for commit in sorted(log.glob("*.json"), key=lambda p: int(p.stem)):
        info = next(json.loads(line)["commitInfo"] for line in commit.read_text().splitlines() if line.startswith('{"commitInfo"'))
        if info.get("userMetadata"):
            named.append({name for name, _ in sink_batches(info["userMetadata"])})
    return named


def decided_alerts(spark, lakehouse: Lakehouse) -> list[tuple]:
    alerts = spark.read.format("delta").load(lakehouse.alerts)
    decided = [c for c in alerts.columns if c not in PROCESSING_COLUMNS]
    return sorted(tuple(r) for r in alerts.select(*[F.col(c).cast("string") for c in decided]).collect())


def held_keysets(spark, lakehouse: Lakehouse) -> list[str]:
    """``gold/rule_keysets``' keysets, sorted with repeats kept: a replayed batch must not add them twice."""
    return sorted(r.keyset for r in spark.read.format("delta").load(lakehouse.rule_keysets).collect())


def finished_tasks(workers: list[Path], before: set[Path]) -> dict[str, int]:
    """Tasks each worker's executors of the applications started since ``before`` finished, by their logs,
    once the logs have stopped growing for 2 s (executors' lines reach their files through the workers)."""

    def counted() -> dict[str, int]:
        return {
            work.name: sum(log.read_text(errors="replace").count("Finished task") for app in work.glob("app-*") if app not in before
                           for log in app.glob("*/stderr"))
            for work in workers
        }  # fmt: skip

    counts, steady = counted(), time.monotonic()
    while time.monotonic() - steady < 2:
        time.sleep(0.25)
        if (now := counted()) != counts:
            counts, steady = now, time.monotonic()
    return counts
