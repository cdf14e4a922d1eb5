"""``rulewatch bench``: the evaluator against a stateless grouped pass-through on the same input.

Both queries read the same silver Delta table with the same keying, packing (spark/evaluator/packing.py) and shard
grouping, in micro-batches of ``--batch-events``; the pass-through only unpacks each shard's events
in Python and counts them, which is the floor any Python evaluator sits on. The ratio says how much the window math and
state cost on top of that floor.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

import numpy as np
import pandas as pd
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from rulewatch.spark.storage import schema, tables
from rulewatch.spark.layers.gold import SHUFFLE_PARTITIONS, Continued, GoldSettings, _events, ensure_gold_tables, evaluated, query_confs, start_gold
from rulewatch.spark.storage.lakehouse import Lakehouse, write_whole
from rulewatch.spark.evaluator.packing import PACKED_COLUMN, pack, unpack
from rulewatch.engine.rules import Rule, parse_rules
from rulewatch.spark.control.rules_table import apply_rules
from rulewatch.spark.layers.silver import ensure_silver_tables

# Amounts are uniform in 1..5,000; with 10k payees over 24 h a limit of 12,500 fires on ~1.6% of
# events (5,000: ~35%), closer to what fraud rules do. ``--limit`` changes it.
BENCH_RULES = [
    {"ruleId": 1, "groupingKeyNames": ["payeeId"], "aggregateFieldName": "paymentAmount",
     "aggregatorFunctionType": "SUM", "limitOperatorType": ">", "limit": 12_500, "window": "1h"},
]  # fmt: skip


@dataclass
class Measurement:
    name: str
    events: int
    seconds: float
    state_rows_updated: int = 0
    state_bytes: int = 0
    # Where the seconds went, from the query's progress reports: the driver's per-batch phases
    # (wall time) and the stateful operator's parts (task time, summed over its partitions).
    phases_ms: dict[str, int] = field(default_factory=dict)
    operator_ms: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0


def generate(spark: SparkSession, lakehouse: Lakehouse, events: int, keys: int, span_ms: int, files: int) -> None:
    """Synthetic payments over ``span_ms``, spread over ``keys`` payees, as ``files`` silver commits."""
    ensure_silver_tables(spark, lakehouse)
    rng = np.random.default_rng(42)
    start = 1_793_500_000_000
    times = np.sort(rng.integers(start, start + span_ms, events))
    for part in np.array_split(np.arange(events), files):
        frame = pd.DataFrame({
            "transaction_id": [f"t{i}" for i in part],
            "event_time": pd.to_datetime(times[part], unit="ms"),
            "payee_id": [f"p{k}" for k in rng.integers(0, keys, len(part))],
            "payment_amount": [f"{a / 100:.2f}" for a in rng.integers(100, 500_000, len(part))],
        })  # fmt: skip
        df = schema.conform(spark.createDataFrame(frame), schema.SILVER)
        tables.save(df.coalesce(1).write.format("delta").mode("append"), lakehouse.silver_transactions)


PHASES = ("queryPlanning", "latestOffset", "addBatch")  # the rest of a batch's trigger is ~0 here
OPERATOR_PARTS = {"updates": "allUpdatesTimeMs", "commit": "commitTimeMs", "removals": "allRemovalsTimeMs"}


def _run(name: str, df: DataFrame, checkpoint: str, events: int) -> Measurement:
    started = time.monotonic()
    query = (
        df.writeStream.format("noop")
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    seconds = time.monotonic() - started
    updated = memory = 0
    phases: Counter[str] = Counter()
    parts: Counter[str] = Counter()
    for progress in query.recentProgress:
        phases.update({phase: progress.get("durationMs", {}).get(phase, 0) for phase in PHASES})
        for op in progress.get("stateOperators", []):
            updated += op.get("numRowsUpdated", 0)
            memory = max(memory, op.get("memoryUsedBytes", 0))
            parts.update({part: op.get(key, 0) for part, key in OPERATOR_PARTS.items()})
    return Measurement(name, events, seconds, updated, memory, dict(phases), dict(parts))



def time_split(m: Measurement) -> str:
    """One line naming where a measurement's seconds went (``Measurement.phases_ms`` / ``operator_ms``)."""
    text = ", ".join(f"{phase} {m.phases_ms.get(phase, 0) / 1000:.1f}s" for phase in PHASES)
    if m.operator_ms:
        text += "; stateful operator, task time: " + ", ".join(f"{part} {ms / 1000:.1f}s" for part, ms in m.operator_ms.items())
    return text


def layout_name(state_slots: int) -> str:
    return "batch layout" if not state_slots else f"{state_slots} slots/shard"


def _measure(
    spark: SparkSession, lakehouse: Lakehouse, events: int, settings: GoldSettings, slot_options: list[int]
) -> list[Measurement]:
    """The pass-through, then the evaluator in each layout, over ``lakehouse``'s silver table."""
    # The same read, keying and packing as the evaluator; each shard's events unpacked and counted.
    passthrough = (
        pack(_events(spark, lakehouse, settings, Continued()))
        .groupBy("shard")
        .applyInPandas(lambda frame: pd.DataFrame({"n": [len(unpack(frame[PACKED_COLUMN]))]}), "n long")
    )
    results = [_run("stateless pass-through", passthrough, lakehouse.checkpoint("bench-passthrough"), events)]
    # As gold runs it: without a last batch that has no input (its timers fire in the next run's first batch).
    with query_confs(spark, settings):
        for slots in slot_options:
            layout = replace(settings, state_slots=slots)
            name = f"evaluator, {layout_name(slots)}"
            results.append(_run(name, evaluated(spark, lakehouse, layout), lakehouse.checkpoint(f"bench-evaluator-{slots}"), events))
    return results


def bench(
    spark: SparkSession,
    events: int,
    keys: int,
    batch_events: int,
    shards: int,
    slot_options: list[int],
    limit: int = BENCH_RULES[0]["limit"],
    workdir: str | None = None,
) -> list[Measurement]:
    root = workdir or tempfile.mkdtemp(prefix="rulewatch-bench-")
    shutil.rmtree(root, ignore_errors=True)
    slot_options = list(dict.fromkeys(slot_options))  # a layout given twice is measured once
    # Spread as a new checkpoint of gold's would be (start_gold), for the pass-through as for the evaluator.
    settings = GoldSettings(shards=shards, max_files_per_trigger=1, shard_partitions=int(spark.conf.get(SHUFFLE_PARTITIONS)))
    rules = parse_rules([{**BENCH_RULES[0], "limit": limit}])
    lakehouses = []
    for name, n, k, files in [("warmup", 2_000, 100, 2), ("lakehouse", events, keys, max(1, events // batch_events))]:
        lakehouse = Lakehouse(f"{root}/{name}")
        generate(spark, lakehouse, n, k, span_ms=24 * 3600 * 1000, files=files)
        apply_rules(spark, lakehouse, rules)
        ensure_gold_tables(spark, lakehouse)
        lakehouses.append(lakehouse)
    # Every query once on a tiny input first: otherwise whichever runs first pays the start-up of
    # Python workers, the state server and code generation (~4 s, measured), and the order decides the ratio.
    _measure(spark, lakehouses[0], 2_000, settings, slot_options)
    results = _measure(spark, lakehouses[1], events, settings, slot_options)
    if workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return results


def rule_propagation(spark: SparkSession, trials: int = 5, trigger: str = "100 milliseconds") -> list[float]:
    """Seconds from a rule change's commit to the first alert evaluated with it, in continuous mode.

    A thread lands one payment every 100 ms into silver while a continuous gold query runs; each
    trial lowers a rule's limit so every event alerts, and times the first alert carrying the new
    ``rule_version`` against that rules-table commit. The limit is raised again between trials.
    """
    import threading

    root = tempfile.mkdtemp(prefix="rulewatch-propagation-")
    lakehouse = Lakehouse(root)
    ensure_silver_tables(spark, lakehouse)
    quiet = {**BENCH_RULES[0], "limit": 10**15}
    apply_rules(spark, lakehouse, parse_rules([quiet]))
    query = start_gold(spark, lakehouse, GoldSettings(), available_now=False, processing_time=trigger)
    stop = threading.Event()

    def land() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            frame = spark.createDataFrame(
                [(f"t{n}", datetime.now(timezone.utc).replace(tzinfo=None), "p1", Decimal("1.00"))],
                "transaction_id string, event_time timestamp, payee_id string, payment_amount decimal(18,2)",
            )
            tables.save(schema.conform(frame, schema.SILVER).write.format("delta").mode("append"), lakehouse.silver_transactions)
            stop.wait(0.1)

    lander = threading.Thread(target=land, daemon=True)
    lander.start()
    latencies: list[float] = []
    try:
        time.sleep(5)  # let the stream warm up
        for trial in range(trials):
            apply_rules(spark, lakehouse, parse_rules([{**BENCH_RULES[0], "limit": 0}]))
            history = tables.latest_commit(spark, lakehouse.rules)
            version, committed = history["version"], history["timestamp"]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                first = (
                    tables.read(spark, lakehouse.alerts)
                    .where(F.col("rule_version") == version)
                    .agg(F.min("decision_time")).first()[0]
                )  # fmt: skip
                if first is not None:
                    latencies.append((first - committed).total_seconds())
                    break
                time.sleep(0.05)
            apply_rules(spark, lakehouse, parse_rules([quiet]))
            time.sleep(1)
    finally:
        stop.set()
        lander.join()
        query.stop()
        shutil.rmtree(root, ignore_errors=True)
    return latencies


@dataclass
class CurvePoint:
    window_events: int  # events per key inside one window
    exact_us: float  # evaluator microseconds per event, exact window
    bucketed_us: float  # the same rule with 1-minute buckets
    exact_rows: int  # raw events stored per key after the run
    bucketed_rows: int


def scale_curve(window_events: list[int], keys: int = 100, batch_events: int = 5_000, batches: int = 10) -> list[CurvePoint]:
    """Engine-only (no Spark): per-event cost of a 1 h SUM rule as its window fills with more
    events per key, exact vs bucketed. State round trips are per key, not per window event, so
    the engine is where window size shows. Each point fills one window, then times ``batches``."""
    from rulewatch.engine.book import RuleBook
    from rulewatch.engine.engine import decode_history, evaluate_batch

    hour = 3_600_000
    points = []
    for per_window in window_events:
        timings, rows = [], []
        for bucket in (None, "1m"):
            book = RuleBook()
            book.apply("insert", {**BENCH_RULES[0], **({"bucket": bucket} if bucket else {})}, 1)
            store: dict[str, bytes] = {}
            rng = np.random.default_rng(7)
            gap = hour / per_window / keys  # mean ms between events of any key
            fill = int(hour / gap)
            t, elapsed, timed = 1_793_500_000_000, 0.0, 0
            for i in range(-(-fill // batch_events) + batches):
                n = batch_events
                times = t + np.cumsum(rng.exponential(gap, n)).astype(np.int64)
                payees = [f"p{k}" for k in rng.integers(0, keys, n)]
                frame = pd.DataFrame({
                    "keyset": "payeeId", "group_key": payees, "eventTime": times,
                    "transactionId": [f"t{i}-{j}" for j in range(n)], "payeeId": payees,
                    "beneficiaryId": None, "paymentType": None, "userId": None, "ip": None, "action": None,
                    "paymentAmount": rng.integers(100, 500_000, n), "paymentAmount_null": False,
                })  # fmt: skip
                started = time.perf_counter()
                result = evaluate_batch(frame, book, lambda keys: {k: store.get(k) for k in keys}, t - 60_000)
                for key, blob in result.writes.items():
                    if blob is None:
                        store.pop(key, None)
                    else:
                        store[key] = blob
                if i * batch_events >= fill:
                    elapsed += time.perf_counter() - started
                    timed += n
                t = int(times[-1])
            timings.append(elapsed / timed * 1e6)
            rows.append(round(np.mean([len(decode_history(b)[0]["eventTime"]) for b in store.values()])))
        points.append(CurvePoint(per_window, timings[0], timings[1], rows[0], rows[1]))
    return points


# The benchmark shape: the reference Flink engine was run on exactly these payments.
PIPELINE_LIMITS = {10_000: 25_000, 1_000_000: 7_000}  # keys -> the SUM rule's limit


def land_payments(landing: str, events: int, keys: int, files: int, seed: int = 42) -> None:
    """``events`` payments, time-ordered over 24 h, as ``files`` JSON-lines files in ``landing``.

    payeeId uniform over ``keys``, beneficiaryId over 1,000, amounts uniform 1.00-5,000.00, 40% CSH.
    """
    rng = np.random.default_rng(seed)
    start = 1_793_500_000_000
    times = np.sort(rng.integers(start, start + 24 * 3600 * 1000, events))
    payees = rng.integers(0, keys, events)
    beneficiaries = rng.integers(0, 1000, events)
    cents = rng.integers(100, 500_001, events)
    cash = rng.random(events) < 0.4
    Path(landing).mkdir(parents=True, exist_ok=True)
    for n, part in enumerate(np.array_split(np.arange(events), files)):
        lines = [
            f'{{"transactionId":"t{i}","eventTime":{times[i]},"payeeId":"p{payees[i]}","beneficiaryId":"b{beneficiaries[i]}",'
            f'"paymentAmount":{cents[i] // 100}.{cents[i] % 100:02d},"paymentType":"{"CSH" if cash[i] else "CRD"}"}}\n'
            for i in part
        ]
        write_whole(Path(landing, f"part-{n:03d}.jsonl"), "".join(lines))  # the landing contract: complete files only


@dataclass
class PipelineResult:
    layers: list[Measurement]  # bronze, silver, gold, whole job (after start-up)
    passthrough: Measurement  # landing -> parsed JSON -> shuffled by key, no state, no Delta
    alerts: int


def bench_pipeline(
    spark: SparkSession, events: int, keys: int, files: int = 10, workdir: str | None = None, state_slots: int = 0, rounds: int = 1
) -> list[PipelineResult]:
    """The real job (``rulewatch run``'s functions) over generated landing files, per layer, beside a
    stateless read-parse-shuffle of the same files measured in the same session; ``rounds`` times,
    each on a fresh lakehouse. The first round is what a job run in a new process pays; the later ones
    run in a JVM whose JIT has compiled the job's code (a long-lived cluster's, or a stream's)."""
    from rulewatch.spark.layers.pipeline import run_bronze, run_gold, run_silver

    root = workdir or tempfile.mkdtemp(prefix="rulewatch-pipeline-bench-")
    shutil.rmtree(root, ignore_errors=True)
    landing = f"{root}/landing"
    land_payments(landing, events, keys, files)
    rules = parse_rules([{**BENCH_RULES[0], "limit": PIPELINE_LIMITS.get(keys, 25_000)}])
    # A warm-up on a tiny landing folder pays JVM, Delta and Python worker start-up outside the timings.
    land_payments(f"{root}/warmup-landing", 1_000, 100, 1)
    warm = Lakehouse(f"{root}/warmup")
    apply_rules(spark, warm, rules)
    run_bronze(spark, warm, f"{root}/warmup-landing", _quiet)
    run_silver(spark, warm, _quiet)
    settings = GoldSettings(state_slots=state_slots)
    run_gold(spark, warm, settings, log=_quiet)
    results = [_pipeline_round(spark, f"{root}/round-{n}", landing, events, rules, settings) for n in range(1, rounds + 1)]
    if workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return results


def _quiet(_: str) -> None:
    """A layer's log, unprinted: the bench prints its figures only."""


def _pipeline_round(spark: SparkSession, root: str, landing: str, events: int, rules: list[Rule], settings: GoldSettings) -> PipelineResult:
    from rulewatch.spark.layers.pipeline import metrics_gathered, run_bronze, run_gold, run_silver

    raw = spark.readStream.format("text").load(landing)
    parsed = raw.select(F.from_json("value", schema.RAW_SCHEMA).alias("j")).select("j.*")
    passthrough = _run("stateless pass-through", parsed.repartition("payeeId"), f"{root}/passthrough-checkpoint", events)

    lakehouse = Lakehouse(f"{root}/lakehouse")
    apply_rules(spark, lakehouse, rules)
    layers = []
    job_started = time.monotonic()
    # As rulewatch run: the layers' metrics rows in one commit at the end, counted in the whole job only.
    with metrics_gathered(spark, lakehouse) as recorders:
        for name, step in [
            ("bronze", lambda: run_bronze(spark, lakehouse, landing, _quiet, recorders["bronze"])),
            ("silver", lambda: run_silver(spark, lakehouse, _quiet, recorders["silver"])),
            ("gold", lambda: run_gold(spark, lakehouse, settings, _quiet, recorders["gold"])),
        ]:
            started = time.monotonic()
            step()
            layers.append(Measurement(name, events, time.monotonic() - started))
    layers.append(Measurement("whole job", events, time.monotonic() - job_started))
    alerts = tables.read(spark, lakehouse.alerts).count()
    return PipelineResult(layers, passthrough, alerts)
