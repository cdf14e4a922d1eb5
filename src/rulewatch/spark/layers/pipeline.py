"""Run the whole job once: bronze -> silver -> gold over everything landed, then summarise.

The CLI, the notebooks and the bundle job all go through these functions, so a local run
exercises exactly what production runs.
"""

from __future__ import annotations

import os
import time
from functools import partial
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Callable

from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from rulewatch.spark.layers.bronze import Source, check_source, ensure_bronze_table, start_bronze
from rulewatch.spark.storage.checkpoints import check_queries, delta_version_read
from rulewatch.spark.storage.delta_log import UNREADABLE, column_values, live_files, table_version
from rulewatch.spark.layers.gold import GoldSettings, ensure_gold_tables, start_gold
from rulewatch.spark.storage.lakehouse import Lakehouse, holding
from rulewatch.kafka.health import TIMEOUT_ENV, KafkaUnreachable, Watch, timeout_s
from rulewatch.kafka.source import KafkaSource
from rulewatch.spark.layers.landing import LandingReport, audit
from rulewatch.spark.storage.metrics import Recorder, ensure_metrics_table, flush_pending
from rulewatch.spark.control.rules_table import (
    RuleChange, apply_rules, checked_rules_file, ensure_rule_history_table, finish_rule_history, start_rule_history,
)  # fmt: skip
from rulewatch.spark.runtime.session import foreach_batch_runs_here, is_connect
from rulewatch.spark.layers.silver import ensure_silver_tables, start_silver
from rulewatch.spark.storage import first_commit, schema, tables
from rulewatch.spark.storage.sinks import beside, together

Log = Callable[[str], None]


def _run(query: StreamingQuery, name: str, log: Log, kafka: KafkaSource | None = None) -> None:
    started = time.monotonic()
    if kafka is None:
        query.awaitTermination()
    else:
        _await_watched(query, kafka, log)
    if query.exception() is not None:
        raise RuntimeError(f"{name} query failed: {query.exception()}")
    log(f"{name}: done in {time.monotonic() - started:.1f}s, {_read(query)}")


def _read(query: StreamingQuery) -> str:
    """What the run's query read, from its progress reports: a rerun with nothing new says so."""
    progress = query.recentProgress
    rows = sum(p.numInputRows for p in progress)
    if not rows:
        return "nothing new to read"
    # Spark keeps the latest 100 reports (spark.sql.streaming.numRecentProgressUpdates): past that, at least.
    more = "+" if len(progress) >= 100 else ""
    return f"{rows:,}{more} rows read in {len(progress)}{more} batch(es)"


def _await_watched(query: StreamingQuery, kafka: KafkaSource, log: Log) -> None:
    """Wait for ``query`` while probing its Kafka cluster: against a dead one Spark waits forever."""
    timeout = timeout_s()
    with Watch(kafka.topic, log) as watch:
        while not query.awaitTermination(1):
            if (outage := watch.down) is not None and outage.seconds() >= timeout:
                query.stop()
                raise KafkaUnreachable(
                    f"Kafka at {kafka.topic.bootstrap} has not answered for {outage.seconds():.0f}s ({TIMEOUT_ENV} is "
                    f"{timeout:g}s): the run stopped. Its checkpoint is intact; run again once the broker is back"
                )


def ensure_all_tables(spark: SparkSession, lakehouse: Lakehouse) -> None:
    """Every table the job reads or writes, so each stream can start on an empty lakehouse.

    The layers' tables are created at once (each creation is mostly the driver waiting on its log),
    after the metrics table they share: two creations of one table at once would conflict."""
    with first_commit.settings_read_once(spark):
        ensure_metrics_table(spark, lakehouse)
        together([
            partial(ensure, spark, lakehouse)
            for ensure in (ensure_bronze_table, ensure_silver_tables, ensure_gold_tables, ensure_rule_history_table)
        ])


JOB_LAYERS = ("bronze", "silver", "gold")


@contextmanager
def metrics_gathered(spark: SparkSession, lakehouse: Lakehouse) -> Iterator[dict[str, Recorder]]:
    """Recorders for the job's layers that keep their metrics rows, appended in one commit when the
    block ends instead of one commit per layer (~0.7-1 s each, docs/journal/benchmarks.md). A block that
    raises appends them too; if that fails as well, the next start does (checkpoints.check_queries).
    Under a Spark Connect server elsewhere, whose copies of the recorders write on its disk, each
    batch's rows are committed at once instead."""
    here = foreach_batch_runs_here(spark)
    recorders = {layer: Recorder.gathered(lakehouse, layer) if here else Recorder(lakehouse, layer) for layer in JOB_LAYERS}
    try:
        yield recorders
    except BaseException:
        with suppress(Exception):
            flush_pending(spark, lakehouse, *JOB_LAYERS)
        raise
    flush_pending(spark, lakehouse, *JOB_LAYERS)


def run_bronze(
    spark: SparkSession, lakehouse: Lakehouse, source: Source, log: Log = print, recorder: Recorder | None = None
) -> LandingReport | None:
    """Ingest everything landed (or on the topic) once; a landing folder is then reconciled with bronze (landing.py).

    Returns the landing report, or None for Kafka: its offsets are in the checkpoint, and records
    lost to retention before they were read stop the query instead of being skipped. Each batch's
    metrics row is committed at once unless ``recorder`` gathers them (``metrics_gathered``).
    """
    if isinstance(source, str) and "://" not in source:
        # Read and reconciled as one absolute folder: the file source logs absolute paths, and the JVM
        # would take a relative one against its own working directory, not this process's.
        source = os.path.abspath(source)
    with holding(lakehouse, "bronze run"):  # as every layer's run: one writer at a time (lakehouse.exclusive)
        ensure_bronze_table(spark, lakehouse)
        check_queries(lakehouse, "bronze", spark=spark)
        check_source(lakehouse, source)
        started = time.time()
        if isinstance(source, KafkaSource):
            _run(start_bronze(spark, source, lakehouse, recorder=recorder), "bronze", log, kafka=source)
            return None
        _run(start_bronze(spark, source, lakehouse, recorder=recorder), "bronze", log)
        report = audit(spark, lakehouse, source, "bronze", started)
        for problem in report.problems:
            log(f"bronze: NOT INGESTED: {problem}")
        return report


def run_silver(spark: SparkSession, lakehouse: Lakehouse, log: Log = print, recorder: Recorder | None = None) -> None:
    with holding(lakehouse, "silver run"):
        check_queries(lakehouse, "silver", spark=spark)
        _run(start_silver(spark, lakehouse, recorder=recorder), "silver", log)


def run_gold(
    spark: SparkSession, lakehouse: Lakehouse, settings: GoldSettings = GoldSettings(), log: Log = print, recorder: Recorder | None = None
) -> None:
    with holding(lakehouse, "gold run"):
        check_queries(lakehouse, "gold", spark=spark)
        _run(start_gold(spark, lakehouse, settings, recorder=recorder), "gold", log)


NO_RULES_WARNING = (
    "WARNING: no ACTIVE rule in config/rules, so nothing was evaluated and no alert could be raised; "
    "add rules with --rules FILE or `rulewatch rules apply`"
)


@dataclass
class Summary:
    bronze: int
    silver: int
    quarantined: int
    duplicates: int
    alerts: int
    late: int
    alerts_per_rule: dict[int, int] = field(default_factory=dict)
    quarantine_reasons: dict[str, int] = field(default_factory=dict)  # reason code -> lines
    quarantine_examples: dict[str, str] = field(default_factory=dict)  # reason code -> one reason text
    landing: LandingReport | None = field(default_factory=LandingReport)  # None: a Kafka source (no files)
    source: str | None = None  # what was ingested, when not a landing folder
    # ACTIVE rows in config/rules at rules_version, or after the run where that is not known (None: not counted)
    active_rules: int | None = None
    rules_version: int | None = None  # the config/rules version gold's newest batch evaluated with (None: not known here)
    rules_current: int | None = None  # config/rules' newest version when summarised

    @property
    def rules_changed(self) -> bool:
        """Whether config/rules has a newer version than gold evaluated with: committed after gold read it."""
        return self.rules_version is not None and self.rules_current is not None and self.rules_current > self.rules_version

    @property
    def balanced(self) -> bool:
        return self.bronze == self.silver + self.quarantined + self.duplicates

    @property
    def ok(self) -> bool:
        """Every landed line is in bronze and every bronze line in silver, quarantine or duplicates."""
        return self.balanced and not (self.landing and self.landing.problems)

    def _landing_check(self) -> str:
        problems = self.landing.problems if self.landing else []
        return f"  every landed file read whole: {'ok' if not problems else f'NO ({len(problems)} file(s) above)'}"

    def _evaluated(self) -> str:
        return f" (config/rules version {self.rules_version}, as gold evaluated)" if self.rules_version is not None else ""

    def _rules_change(self) -> str:
        return (
            f"  config/rules changed after gold read it: this run evaluated with version {self.rules_version}, "
            f"version {self.rules_current} is current and applies from the next run"
        )

    def lines(self) -> list[str]:
        check = "ok" if self.balanced else "MISMATCH"
        # Zero alerts from zero rules is not safety: say so first, where it cannot be missed.
        warning = [NO_RULES_WARNING] if self.active_rules == 0 else []
        out = [
            *warning,
            *(self.landing.lines() if self.landing else []),
            *([f"source           {self.source}"] if self.source else []),
            f"bronze rows      {self.bronze}",
            f"silver rows      {self.silver}",
            f"quarantined      {self.quarantined}",
            f"duplicates       {self.duplicates}",
            f"  bronze = silver + quarantined + duplicates: {check}",
            *([self._landing_check()] if self.landing else []),
            f"late events      {self.late}",
            f"alerts           {self.alerts}",
            *([f"active rules     {self.active_rules}{self._evaluated()}"] if self.active_rules is not None else []),
            *([self._rules_change()] if self.rules_changed else []),
        ]
        out += [f"  rule {rule_id}: {n} alert(s)" for rule_id, n in sorted(self.alerts_per_rule.items())]
        if self.quarantine_reasons:
            out.append("quarantine reasons:")
            out += [
                f"  {n} x {code}" + (f"  (e.g. {self.quarantine_examples[code]})" if code in self.quarantine_examples else "")
                for code, n in sorted(self.quarantine_reasons.items())
            ]
        return out


def _counted_from_files(lakehouse: Lakehouse) -> dict[str, Any] | None:
    """The summary's figures read from the tables' logs and Parquet files on the driver, without a Spark
    job (a run's summary was ~10 of them: 2 s warm, 3.4 s in a new process, ~12 s on a slow host,
    docs/testing.md); None where the tables cannot be read that way (catalog tables, a Spark Connect
    server elsewhere, a table delta_log.live_files refuses)."""
    if lakehouse.schema:
        return None
    tables_ = {
        "bronze": lakehouse.bronze_transactions, "silver": lakehouse.silver_transactions,
        "quarantined": lakehouse.silver_quarantine, "duplicates": lakehouse.silver_duplicates,
        "alerts": lakehouse.alerts, "late": lakehouse.late_events, "rules": lakehouse.rules,
    }  # fmt: skip
    try:
        return _count_files({name: live_files(path) for name, path in tables_.items()})
    except UNREADABLE:  # a file gone under a concurrent VACUUM, an unexpected log: ask Spark
        return None


def _count_files(files: dict[str, list[dict] | None]) -> dict[str, Any] | None:
    if any(found is None for found in files.values()):
        return None
    counted: dict[str, Any] = {name: sum(f["numRecords"] for f in found) for name, found in files.items() if name != "rules"}
    counted["alerts_per_rule"] = dict(Counter(rule for (rule,) in column_values(files["alerts"], ["rule_id"])))
    lines: Counter[str] = Counter()
    examples: dict[str, str] = {}
    # As the Spark path below: a line failing several checks counts under each code, its example the matching text.
    for codes, reasons in column_values(files["quarantined"], ["reason_code", "reason"]):
        texts = reasons.split("; ") if reasons is not None else []
        for i, code in enumerate((codes if codes is not None else "uncoded").split("; ")):
            lines[code] += 1
            if i < len(texts) and (code not in examples or texts[i] < examples[code]):
                examples[code] = texts[i]
    counted["quarantine_reasons"] = dict(lines)
    counted["quarantine_examples"] = {code: text for code, text in examples.items() if text}
    counted["active_rules"] = _active(files["rules"])
    return counted


def _active(rules_files: list[dict]) -> int:
    return sum(state == "ACTIVE" for (state,) in column_values(rules_files, ["ruleState"]))


def _rules_read(lakehouse: Lakehouse) -> tuple[int, int] | None:
    """(the config/rules version gold's newest batch evaluated with, the table's newest version), from gold's
    checkpoint and the table's log; None where those are no files here (catalog tables, a remote lakehouse)
    or gold has not run.

    A batch applies its rule changes before its events, and a run's gold (availableNow) reads the rules as
    they were when it started: a change committed later reaches the evaluator in the next run."""
    if lakehouse.schema or "://" in lakehouse.root:
        return None
    try:
        table = table_version(lakehouse.rules)
        if table is None:
            return None
        read = delta_version_read(lakehouse.checkpoint("gold"), table[0])
    except UNREADABLE:  # an unexpected log or checkpoint: say nothing rather than guess
        return None
    return None if read is None else (read, table[1])


def _active_at(lakehouse: Lakehouse, version: int) -> int | None:
    """ACTIVE rows of config/rules at ``version``, from its log and files (None: they no longer give it)."""
    try:
        files = live_files(lakehouse.rules, version)
    except UNREADABLE:
        return None
    return None if files is None else _active(files)


def _counted_by_spark(spark: SparkSession, lakehouse: Lakehouse) -> dict[str, Any]:
    def read(path: str):
        return tables.read(spark, path)

    alerts = read(lakehouse.alerts)
    quarantine = read(lakehouse.silver_quarantine)
    # By stable code, not by text: the texts name the bad values, so they would split into one group per
    # value. A line failing several checks counts under each code, as the quarantine_reasons view does.
    codes = quarantine.select(
        F.posexplode(F.split(F.coalesce("reason_code", F.lit("uncoded")), "; ")).alias("i", "code"), F.split("reason", "; ").alias("texts")
    )
    per_code = codes.groupBy("code").agg(F.count("*").alias("lines"), F.min(F.element_at("texts", F.col("i") + 1)).alias("example")).collect()
    return {
        "bronze": read(lakehouse.bronze_transactions).count(),
        "silver": read(lakehouse.silver_transactions).count(),
        "quarantined": quarantine.count(),
        "duplicates": read(lakehouse.silver_duplicates).count(),
        "alerts": alerts.count(),
        "late": read(lakehouse.late_events).count(),
        "alerts_per_rule": {r["rule_id"]: r["count"] for r in alerts.groupBy("rule_id").count().collect()},
        "quarantine_reasons": {r["code"]: r["lines"] for r in per_code},
        "quarantine_examples": {r["code"]: r["example"] for r in per_code if r["example"]},
        "active_rules": read(lakehouse.rules).where(F.col("ruleState") == "ACTIVE").count(),
    }


def summarize(
    spark: SparkSession, lakehouse: Lakehouse, landing: LandingReport | None = None, source: str | None = None, use_files: bool = True
) -> Summary:
    """What the lakehouse holds after a run. Read from the tables' files on the driver where it can be
    (``_counted_from_files``), else by Spark jobs; ``use_files=False`` always asks Spark. Where gold's
    checkpoint and the rules table's log are files here, the active rules are counted at the version
    gold evaluated with, which a change committed after gold read the table leaves behind."""
    here = foreach_batch_runs_here(spark)
    counted = (_counted_from_files(lakehouse) if use_files and here else None) or _counted_by_spark(spark, lakehouse)
    read = _rules_read(lakehouse) if here else None
    if read is not None:
        counted["rules_version"], counted["rules_current"] = read
        if read[0] != read[1]:
            counted["active_rules"] = _active_at(lakehouse, read[0])
    return Summary(
        **counted,
        landing=landing if landing or source else LandingReport(),
        source=source,
    )


def run_all(
    spark: SparkSession,
    lakehouse: Lakehouse,
    source: Source,
    rules_file: str | None = None,
    settings: GoldSettings = GoldSettings(),
    log: Log = print,
) -> tuple[list[RuleChange], Summary]:
    """Apply the rules file (if any), process everything landed once, and summarise the lakehouse.

    Steps that share no table run at once, each being mostly the driver waiting on Delta's log and
    small Spark jobs (docs/testing.md): the rules file's MERGE beside bronze and silver (gold waits for
    it), the rule history beside the commit of the run's metrics rows."""
    rules = checked_rules_file(rules_file) if rules_file else None  # a bad file stops the run before anything starts
    # The lakehouse held for the run, as `rulewatch run` holds it (already held there): a second run fails
    # fast, and the run's first appends skip Delta's concurrent-writer guard (sinks.replay_check).
    with holding(lakehouse, "rulewatch run"):
        # Every table first: the MERGE tags its commit through a session setting (rules_table._merge), which
        # a table created or altered beside it would take as well (appends name their batch themselves).
        ensure_all_tables(spark, lakehouse)

        def merge() -> list[RuleChange]:
            changes = apply_rules(spark, lakehouse, rules) if rules else []
            for change in changes:
                log(f"rules: {change}")
            return changes

        history: StreamingQuery | None = None
        try:
            with metrics_gathered(spark, lakehouse) as recorders:
                silver_said: list[str] = []  # said once the MERGE has ended as well: a caller acting on them must not race it
                with beside(merge, pause_collector=is_connect(spark)) as merged:
                    landed = run_bronze(spark, lakehouse, source, log, recorders["bronze"])
                    run_silver(spark, lakehouse, silver_said.append, recorders["silver"])
                changes = merged.result()
                for line in silver_said:
                    log(line)
                run_gold(spark, lakehouse, settings, log, recorders["gold"])
                wrapping_up = time.monotonic()
                check_queries(lakehouse, "rule_history", spark=spark)
                history = start_rule_history(spark, lakehouse)  # while the metrics rows are committed
        except BaseException:
            if history is not None:  # the metrics commit failed: the next start must not find it running
                history.stop()
            raise
        finish_rule_history(history)
        log(f"metrics rows and rule history: done in {time.monotonic() - wrapping_up:.1f}s")
        described = f"Kafka topic {source.topic.topic} at {source.topic.bootstrap}" if isinstance(source, KafkaSource) else None
        return changes, summarize(spark, lakehouse, landed, described)


def latest_alerts(spark: SparkSession, lakehouse: Lakehouse, limit: int = 20):
    """The ``limit`` alerts with the newest event times, shown oldest first so they read in order.

    Read from the files the table's log names (``tables.read_near``): gold has just added a version,
    for which a Delta read would first run a Spark job over the log (~1 s of a `rulewatch run`)."""
    alerts = tables.read_near(spark, lakehouse.alerts, schema.ALERTS, "event_time")
    newest = (
        (spark.createDataFrame([], schema.ALERTS) if alerts is None else alerts)
        .orderBy(F.col("event_time").desc(), F.col("rule_id").desc(), F.col("transaction_id").desc())
        .select("rule_id", "group_key", "transaction_id", "event_time", "aggregate_value", "operator", "limit", "event_count")
        .limit(limit)
    )
    return newest.orderBy("event_time", "rule_id", "transaction_id")
