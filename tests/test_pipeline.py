"""The fixture set through the real pipeline (local Spark + Delta) against hand-checked results."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from chispa import assert_df_equality
from pyspark.sql import functions as F
from pyspark.sql.types import DecimalType, IntegerType, LongType, StringType, StructField, StructType

from conftest import FIXTURES
from rulewatch.engine.rules import RuleSetError, parse_rule
from rulewatch.spark.storage import schema
from rulewatch.spark.storage.checkpoints import delta_version_read
from rulewatch.spark.storage.delta_log import actions, live_files
from rulewatch.spark.storage.tables import CHECKPOINT_INTERVAL, ensure_table
from rulewatch.spark.layers.gold import GoldSettings, HeldKeysets
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.layers.pipeline import Summary, _counted_from_files, run_all, run_bronze, summarize
from rulewatch.spark.control.rules_table import apply_rules

ALERT_KEY = StructType([
    StructField("rule_id", IntegerType(), False),
    StructField("transaction_id", StringType()),
    StructField("group_key", StringType()),
    StructField("aggregate_value", DecimalType(38, 6)),
    StructField("event_count", LongType()),
])  # fmt: skip


def test_every_bronze_row_is_accounted_for(fixture_run):
    s = fixture_run.summary
    assert (s.bronze, s.silver, s.quarantined, s.duplicates) == (50, 42, 6, 2)
    assert s.balanced


def test_alerts_match_the_hand_checked_fixture(spark, fixture_run, expected_alerts):
    expected = spark.createDataFrame(
        [(a["rule_id"], a["transaction_id"], a["group_key"], Decimal(str(a["aggregate_value"])), a["event_count"])
         for a in expected_alerts],
        ALERT_KEY,
    )  # fmt: skip
    actual = spark.read.format("delta").load(fixture_run.lakehouse.alerts).select(*ALERT_KEY.fieldNames())
    assert_df_equality(actual, expected, ignore_row_order=True, ignore_nullable=True, ignore_metadata=True)


def test_alerts_are_explainable(spark, fixture_run):
    rules = json.loads((FIXTURES / "rules.json").read_text())
    descriptions = {r["ruleId"]: r["description"] for r in rules}
    grouping = {r["ruleId"]: r["groupingKeyNames"] for r in rules}
    rows = spark.read.format("delta").load(fixture_run.lakehouse.alerts).collect()
    assert len({r.alert_id for r in rows}) == len(rows)
    for r in rows:
        assert r.rule_version >= 1 and r.decision_time is not None
        assert r.window_start <= r.event_time == r.window_end
        assert r.rule_description == descriptions[r.rule_id]
        assert "|".join(r.key_parts[name] for name in grouping[r.rule_id]) == r.group_key
        assert r.ingest_time <= r.decision_time
        assert r.latency_ms == (r.decision_time - r.ingest_time) // timedelta(milliseconds=1)
        if r.rule_id == 3:  # UNIQUE_COUNT carries the distinct IPs behind the count
            assert len(r.distinct_values) == int(r.aggregate_value)


def test_paused_rule_never_alerts(spark, fixture_run):
    alerts = spark.read.format("delta").load(fixture_run.lakehouse.alerts)
    assert alerts.where("rule_id = 4").count() == 0


def test_quarantine_names_each_reason(spark, fixture_run):
    reasons = Counter(r.reason for r in spark.read.format("delta").load(fixture_run.lakehouse.silver_quarantine).collect())
    assert reasons == Counter({
        "malformed JSON (not a JSON object on one line)": 1,
        "missing transactionId": 1,
        "missing eventTime": 1,
        "unparsable eventTime 'yesterday' (expected epoch milliseconds or an ISO-8601 date and time)": 1,
        "paymentAmount is not a number: 'abc'": 1,
        "negative paymentAmount -100": 1,
    })  # fmt: skip


def test_duplicates_keep_the_first_occurrence(spark, fixture_run):
    dups = spark.read.format("delta").load(fixture_run.lakehouse.silver_duplicates)
    assert sorted(r.transaction_id for r in dups.collect()) == ["pay-a2", "pay-d3"]
    silver = spark.read.format("delta").load(fixture_run.lakehouse.silver_transactions)
    assert silver.groupBy("transaction_id").count().where("count > 1").count() == 0


def test_window_metrics_cover_every_alert_key(spark, fixture_run):
    metrics = spark.read.format("delta").load(fixture_run.lakehouse.window_metrics)
    alerts = spark.read.format("delta").load(fixture_run.lakehouse.alerts)
    missing = alerts.select("rule_id", "group_key").distinct().join(
        metrics.select("rule_id", "group_key"), ["rule_id", "group_key"], "left_anti"
    )
    assert missing.count() == 0
    # The peak of a batch is never below the value at its last event.
    assert metrics.where(F.col("max_aggregate") < F.col("aggregate_value")).count() == 0


def test_window_metrics_keep_the_keys_near_a_limit_and_count_every_key(spark, fixture_run):
    """Counted from silver and the rules file, not from gold: every key an active rule evaluates is
    counted in the rule's summary row; only keys that came near or over the limit have rows of their own."""
    lakehouse = fixture_run.lakehouse
    silver = spark.read.format("delta").load(lakehouse.silver_transactions)
    late = spark.read.format("delta").load(lakehouse.late_events).select("transaction_id")
    evaluated = silver.join(late, "transaction_id", "left_anti")
    window_metrics = spark.read.format("delta").load(lakehouse.window_metrics)
    summaries, metrics = window_metrics.where("keys_sketch IS NOT NULL"), window_metrics.where("keys_sketch IS NULL")
    assert summaries.where("group_key IS NOT NULL OR keys_evaluated IS NULL").count() == 0
    for rule in json.loads((FIXTURES / "rules.json").read_text()):
        rid, columns = rule["ruleId"], [schema.FIELD_COLUMNS[f] for f in rule["groupingKeyNames"]]
        seen = evaluated.where(F.expr(" AND ".join(f"{c} IS NOT NULL" for c in columns)))
        for field, value in rule.get("filter", {}).items():
            seen = seen.where(F.col(schema.FIELD_COLUMNS[field]) == value)
        keys = {r.k for r in seen.select(F.concat_ws("|", *columns).alias("k")).distinct().collect()}
        if rule["ruleState"] != "ACTIVE":
            keys = set()
        counted = summaries.where(F.col("rule_id") == rid)
        assert counted.select("gold_batch_id").distinct().count() <= 1  # so the batch's exact count is the run's
        assert sum(r.keys_evaluated for r in counted.collect()) == len(keys), rid
        estimate = counted.agg(F.hll_sketch_estimate(F.hll_union_agg("keys_sketch"))).first()[0]
        assert (estimate or 0) == len(keys), rid

        peaks = metrics.where(F.col("rule_id") == rid).groupBy("group_key").agg(F.max("max_aggregate").alias("peak")).collect()
        near = {r.group_key for r in peaks if r.peak is not None and r.peak >= Decimal(str(rule["limit"])) * Decimal("0.8")}
        assert {r.group_key for r in peaks} == near, rid
        assert near < keys or not keys, rid  # every active rule has keys far below its limit here


def test_a_run_brings_the_rule_history_up_to_its_rules_file(spark, fixture_run):
    """The rule history runs beside the run's metrics commit; it still holds every change the run made."""
    history = spark.read.format("delta").load(fixture_run.lakehouse.rule_history).collect()
    in_file = sorted(rule["ruleId"] for rule in json.loads((FIXTURES / "rules.json").read_text()))
    assert sorted((r.rule_id, r.change, r.commit_version) for r in history) == [(i, "inserted", 1) for i in in_file]


def test_only_the_rules_tables_commits_are_tagged_as_a_rules_apply(fixture_run):
    """The MERGE tags its commit through a session setting while bronze runs beside it: no other table's
    commit may take the tag (the rules' history names who applied them from it)."""
    tagged = {}
    for table in fixture_run.lakehouse.tables():
        for commit in Path(table, "_delta_log").glob("*.json"):
            infos = [json.loads(line)["commitInfo"] for line in commit.read_text().splitlines() if line.startswith('{"commitInfo"')]
            tagged[Path(table).name] = tagged.get(Path(table).name, 0) + sum('"rules apply"' in (i.get("userMetadata") or "") for i in infos)
    assert {name: n for name, n in tagged.items() if n} == {"rules": 1}


def test_a_bad_rules_file_stops_the_run_before_anything_is_ingested(spark, tmp_path):
    """The file's MERGE runs beside bronze, but the file is checked whole before either starts."""
    landing, rules = tmp_path / "landing", tmp_path / "rules.json"
    shutil.copytree(FIXTURES / "transactions", landing)
    rules.write_text(json.dumps([{**json.loads((FIXTURES / "rules.json").read_text())[0], "windowMinutes": -1}]))
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    with pytest.raises(RuleSetError, match="windowMinutes"):
        run_all(spark, lakehouse, str(landing), str(rules), log=lambda _: None)
    assert not Path(lakehouse.root).exists()


@pytest.fixture
def landed_later(fixture_run):
    """A file to land in the session's fixture run's landing folder; removed again after the test."""
    path = fixture_run.landing / "day2.jsonl"
    yield path
    path.unlink(missing_ok=True)


def test_rerun_continues_from_checkpoints(spark, fixture_run, landed_later, tmp_path):
    """A second run only processes new files: new alerts appear, nothing is re-emitted or lost."""
    # On a copy of the session's run, reading its landing folder (a lakehouse ingests one folder, by path).
    shutil.copytree(fixture_run.lakehouse.root, tmp_path / "lakehouse")
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    before = {r.alert_id for r in spark.read.format("delta").load(lakehouse.alerts).collect()}
    # Five distinct IPs logging into a new account within 3 minutes fire rule 3 once, on the fifth;
    # a repeat of an old transaction id is a duplicate; an event far behind the watermark
    # (fixture events reach 12:13, lateness is 1h) is recorded as late, not evaluated.
    new_lines = [
        {"transactionId": f"attack-{i}", "eventTime": f"2026-11-01T12:20:{10 * i:02d}Z", "userId": "u-2002",
         "ip": f"198.51.100.{i}", "action": "login"}
        for i in range(1, 6)
    ] + [
        {"transactionId": "pay-a1", "eventTime": "2026-11-01T12:21:00Z", "payeeId": "payee-A",
         "beneficiaryId": "ben-1", "paymentAmount": 5000, "paymentType": "CSH"},
        {"transactionId": "pay-old-1", "eventTime": "2026-11-01T10:00:00Z", "payeeId": "payee-A",
         "beneficiaryId": "ben-1", "paymentAmount": 5000, "paymentType": "CSH"},
    ]  # fmt: skip
    landed_later.write_text("\n".join(json.dumps(x) for x in new_lines) + "\n")
    _, summary = run_all(spark, lakehouse, str(fixture_run.landing), log=lambda _: None)
    assert (summary.bronze, summary.silver, summary.duplicates) == (57, 48, 3)
    assert summary.active_rules == 3  # fixtures/rules.json: three ACTIVE, one paused
    after = spark.read.format("delta").load(lakehouse.alerts)
    assert after.count() == after.select("alert_id").distinct().count()
    new = after.where(~F.col("alert_id").isin(list(before))).collect()
    assert [(r.rule_id, r.transaction_id, r.group_key) for r in new] == [(3, "attack-5", "u-2002")]
    late = spark.read.format("delta").load(lakehouse.late_events).collect()
    assert {r.transaction_id for r in late} == {"pay-old-1"}
    assert all("watermark" in r.reason for r in late)


def test_pipeline_metrics_account_for_every_batch_of_every_layer(spark, fixture_run):
    rows = spark.read.format("delta").load(fixture_run.lakehouse.pipeline_metrics).collect()
    by_layer = {layer: [r for r in rows if r.layer == layer] for layer in ("bronze", "silver", "gold")}
    assert sum(r.rows_in for r in by_layer["bronze"]) == 50
    silver = by_layer["silver"]
    assert [sum(getattr(r, c) for r in silver) for c in ("rows_in", "rows_out", "quarantined", "duplicates")] == [50, 42, 6, 2]
    gold = by_layer["gold"]
    assert sum(r.alerts for r in gold) == 10
    # Gold counts what it evaluates: one row per (event, keyset whose fields the event has).
    fanned = spark.read.format("delta").load(fixture_run.lakehouse.silver_transactions)
    per_keyset = fanned.where("payee_id IS NOT NULL AND beneficiary_id IS NOT NULL").count()
    per_keyset += fanned.where("payee_id IS NOT NULL").count() + fanned.where("user_id IS NOT NULL").count()
    assert sum(r.rows_in for r in gold) == per_keyset
    firing = [r for r in gold if r.alerts]
    assert firing and all(r.latency_p50_ms <= r.latency_p95_ms <= r.latency_p99_ms <= r.latency_max_ms for r in firing)
    assert all(r.active_rules == 3 and r.rules_version >= 1 and r.state_rows_written >= 1 for r in firing)
    for layer, batches in by_layer.items():
        ids = sorted(r.batch_id for r in batches)
        assert ids == list(range(len(ids))), f"{layer} metrics batches {ids}"
        assert all(r.batch_start <= r.batch_end and r.processing_ms >= 0 for r in batches)
    # Where each batch's time went: the steps each layer runs, none timed longer than its batch.
    steps = {"bronze": {"landing", "append"}, "silver": {"parse", "dedup", "transactions", "quarantine", "duplicates"},
             "gold": {"evaluate", "alerts", "window_metrics", "late_events", "rule_errors"}}  # fmt: skip
    for layer, batches in by_layer.items():
        assert all(steps[layer] <= set(r.step_ms) for r in batches), [r.step_ms for r in batches]
        assert all(0 <= ms <= r.processing_ms for r in batches for ms in r.step_ms.values())


def test_latest_alerts_are_the_newest_by_event_time_in_reading_order(spark, fixture_run):
    from rulewatch.spark.layers.pipeline import latest_alerts

    every = spark.read.format("delta").load(fixture_run.lakehouse.alerts).orderBy("event_time", "rule_id", "transaction_id").collect()
    assert len(every) > 3
    shown = latest_alerts(spark, fixture_run.lakehouse, limit=3).collect()
    assert [r.transaction_id for r in shown] == [r.transaction_id for r in every[-3:]]


def test_latest_alerts_of_a_gold_table_without_a_file_are_none(spark, tmp_path):
    from rulewatch.spark.layers.gold import ensure_gold_tables
    from rulewatch.spark.layers.pipeline import latest_alerts

    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    ensure_gold_tables(spark, lakehouse)
    assert latest_alerts(spark, lakehouse).collect() == []


def test_the_big_tables_keep_file_statistics_only_for_the_columns_reads_filter_on(fixture_run):
    # Statistics of every column cost each large append ~35 %; the ones kept are what the duplicate
    # lookup (silver batch, event time) and the alert explanations (time, id, key) skip files by.
    lakehouse = fixture_run.lakehouse
    for table, kept in [
        (lakehouse.bronze_transactions, {"ingest_time", "source_file", "kafka_partition", "kafka_offset"}),
        (lakehouse.silver_transactions, {"event_time", "silver_batch_id", "transaction_id", "payee_id", "ingest_time"}),
        (lakehouse.window_metrics, {"rule_id", "group_key", "event_time", "gold_batch_id"}),
    ]:
        stats = [json.loads(add["stats"]) for _, add in actions(Path(table, "_delta_log"), ("add",)) if add.get("stats")]
        assert stats, table
        for file_stats in stats:
            # nullCount names every column with statistics (minValues leaves out a column null in the whole file).
            assert set(file_stats["nullCount"]) == kept, (table, file_stats["nullCount"])
            assert file_stats["numRecords"] > 0


def test_every_table_writes_a_log_checkpoint_every_hundred_commits_not_every_ten(fixture_run):
    # A checkpoint is written inside the commit that reaches it and costs a live batch 2-4 s: at Delta's
    # default of 10 that was every tenth micro-batch of each query (docs/benchmarks.md, #70).
    made = [t for t in fixture_run.lakehouse.tables() if Path(t, "_delta_log").is_dir()]
    assert len(made) >= 10
    for table in made:
        metadata = [a for kind, a in actions(Path(table, "_delta_log"), ("metaData",)) if kind == "metaData"]
        assert dict(metadata[-1].get("configuration") or {}).get("delta.checkpointInterval") == str(CHECKPOINT_INTERVAL) == "100", table


def test_the_files_give_the_rows_spark_reads_across_a_log_checkpoint(spark, tmp_path):
    # Tables checkpoint their logs rarely now, so the fixtures' runs no longer reach one: read across one here.
    table = str(tmp_path / "t")
    ensure_table(spark, table, spark.range(1).schema, properties={"delta.checkpointInterval": "3"})
    for n in (3, 5, 7):  # versions 1-3; the log checkpoint at 3
        spark.range(n).write.format("delta").mode("append").save(table)
    spark.sql(f"DELETE FROM delta.`{table}` WHERE id >= 4")  # version 4 removes files the checkpoint adds
    spark.range(2).write.format("delta").mode("append").save(table)
    log = Path(table, "_delta_log")
    assert [p.name.split(".")[0] for p in log.glob("*.checkpoint*.parquet")] == [f"{3:020d}"]
    expected = {v: spark.read.format("delta").option("versionAsOf", v).load(table).count() for v in (2, 3, 4, 5)}
    assert len(set(expected.values())) == 4
    assert sum(f["numRecords"] for f in live_files(table, 2)) == expected[2]  # the commits alone
    for commit in log.glob(f"{0:019d}[0-2].json"):
        commit.unlink()  # what log cleanup does once the checkpoint covers them: from here only it has those files
    for version, rows in [(3, expected[3]), (4, expected[4]), (None, expected[5])]:
        assert sum(f["numRecords"] for f in live_files(table, version)) == rows, version


def test_a_table_an_older_release_made_is_given_the_columns_added_since(spark, tmp_path):
    table = str(tmp_path / "t")
    older = StructType([StructField("id", LongType())])
    ensure_table(spark, table, older)
    spark.range(2).write.format("delta").mode("append").save(table)
    ensure_table(spark, table, older.add(StructField("note", StringType())))  # the log lacks it: Spark adds it
    assert [(r.id, r.note) for r in spark.read.format("delta").load(table).orderBy("id").collect()] == [(0, None), (1, None)]


def test_the_summary_read_from_the_tables_files_is_the_one_spark_counts(spark, fixture_run):
    lakehouse = fixture_run.lakehouse
    assert _counted_from_files(lakehouse) is not None  # path tables here: the driver reads them itself
    from_files = summarize(spark, lakehouse)
    assert from_files.quarantine_reasons and from_files.alerts_per_rule and from_files.active_rules
    assert from_files == summarize(spark, lakehouse, use_files=False)


def test_a_column_s_largest_value_comes_from_the_files_statistics_or_else_from_delta(spark, fixture_run, tmp_path):
    from rulewatch.spark.storage.tables import column_max

    alerts = fixture_run.lakehouse.alerts
    assert column_max(spark, alerts, "gold_batch_id") == spark.read.format("delta").load(alerts).agg(F.max("gold_batch_id")).first()[0] is not None
    empty, unindexed = str(tmp_path / "empty"), str(tmp_path / "unindexed")
    ensure_table(spark, empty, spark.range(1).schema)
    assert column_max(spark, empty, "id") is None
    # A file without statistics for the column says nothing about it: Delta reads the rows.
    spark.sql(f"CREATE TABLE delta.`{unindexed}` (n BIGINT, id BIGINT) USING delta TBLPROPERTIES ('delta.dataSkippingNumIndexedCols' = '1')")
    spark.range(5).selectExpr("CAST(0 AS BIGINT) AS n", "id").write.format("delta").mode("append").save(unindexed)
    assert "id" not in json.loads(live_files(unindexed)[0]["stats"])["maxValues"]
    assert column_max(spark, unindexed, "id") == 4


def test_a_table_whose_rows_the_files_alone_do_not_give_is_left_to_spark(spark, tmp_path):
    rewritten, pruned = str(tmp_path / "rewritten"), str(tmp_path / "pruned")
    spark.range(10).write.format("delta").save(rewritten)
    spark.range(4).write.format("delta").mode("overwrite").save(rewritten)  # the first files removed
    assert sum(f["numRecords"] for f in live_files(rewritten)) == 4
    spark.sql(f"CREATE TABLE delta.`{pruned}` (id BIGINT) USING delta TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
    spark.range(10).write.format("delta").mode("append").save(pruned)
    spark.sql(f"DELETE FROM delta.`{pruned}` WHERE id = 3")  # a deletion vector, not a rewritten file
    assert live_files(pruned) is None
    assert live_files(str(tmp_path / "nothing")) is None


def _run_changing_rule_3_after_gold_batch_0(spark, tmp_path, monkeypatch, change: dict, also: list[dict] = (), log=None):
    """The fixtures run with one silver file per gold batch (so gold runs batches after the change's
    commit); right after gold's batch 0 commits, rule 3 (the only rule keyed by userId) gets ``change``,
    in one rules commit with ``also``. Returns the lakehouse, the landing folder and the run's summary."""
    from rulewatch.spark.layers import gold

    landing = tmp_path / "landing"
    shutil.copytree(FIXTURES / "transactions", landing)
    rule = next(r for r in json.loads((FIXTURES / "rules.json").read_text()) if r["ruleId"] == 3)
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    write_batch = gold.write_batch

    def write_then_change(out, batch_id: int, **kwargs) -> None:
        write_batch(out, batch_id, **kwargs)
        if batch_id == 0:
            apply_rules(spark, lakehouse, [parse_rule(r) for r in [*also, {**rule, **change}]])

    monkeypatch.setattr(gold, "write_batch", write_then_change)
    settings = GoldSettings(max_files_per_trigger=1)
    _, summary = run_all(spark, lakehouse, str(landing), str(FIXTURES / "rules.json"), settings, log=log or (lambda _: None))
    monkeypatch.undo()
    return lakehouse, landing, summary


def _rule_3_fired_as_if_nothing_changed(spark, lakehouse: Lakehouse, expected_alerts) -> None:
    # Rule 3 fires as in the hand-checked fixture run, every alert from a batch after the change. (One silver
    # file per batch makes some of rule 1's events late, so the other rules' alerts differ from that run.)
    rule_3 = spark.read.format("delta").load(lakehouse.alerts).where("rule_id = 3")
    assert sorted((r.group_key, r.transaction_id) for r in rule_3.collect()) == sorted(
        (a["group_key"], a["transaction_id"]) for a in expected_alerts if a["rule_id"] == 3
    )
    assert rule_3.count() == 3 and rule_3.where("gold_batch_id = 0").count() == 0


def _keysets_held(spark, lakehouse: Lakehouse) -> set[str]:
    return {r.keyset for r in spark.read.format("delta").load(lakehouse.rule_keysets).collect()}


def test_the_held_keysets_are_written_once_by_a_replayed_batch_and_replaced_when_they_change(spark, tmp_path):
    """A new table's first keysets are appended (no overwrite's state rebuild); a query that replays the
    batch (a new HeldKeysets, as after a restart) finds them and writes nothing; a change replaces them."""
    lakehouse = Lakehouse(str(tmp_path / "lakehouse"))
    ensure_table(spark, lakehouse.rule_keysets, schema.RULE_KEYSETS)

    def rows() -> list[tuple[str, int]]:
        return sorted((r.keyset, r.gold_batch_id) for r in spark.read.format("delta").load(lakehouse.rule_keysets).collect())

    HeldKeysets(lakehouse).record(spark, ["payeeId"], 0)
    replayed = HeldKeysets(lakehouse)
    replayed.record(spark, ["payeeId"], 0)
    assert rows() == [("payeeId", 0)]
    actions = [json.loads(line) for line in Path(lakehouse.rule_keysets, "_delta_log", f"{1:020d}.json").read_text().splitlines()]
    assert [a["commitInfo"]["operationParameters"]["mode"] for a in actions if "commitInfo" in a] == ["Append"]
    assert not Path(lakehouse.rule_keysets, "_delta_log", f"{2:020d}.json").exists()  # the replay wrote nothing
    replayed.record(spark, ["beneficiaryId,payeeId", "payeeId"], 1)
    assert rows() == [("beneficiaryId,payeeId", 1), ("payeeId", 1)]
    HeldKeysets(lakehouse).record(spark, [], 2)
    assert rows() == []
    HeldKeysets(lakehouse).record(spark, ["payeeId"], 3)
    assert rows() == [("payeeId", 3)]


def test_rules_changed_before_and_during_a_run_the_summary_and_the_deleted_rule(spark, tmp_path, monkeypatch, expected_alerts):
    """A change committed before gold starts is evaluated with; one committed while gold runs is not, even
    by its later batches (availableNow: the rules as they were when it started), and the summary says so.
    The change during the run deletes rule 3 and activates rule 4: gold still routes events to the keys the
    rules it started with read, so rule 3 fires exactly as if nothing changed, and the change applies next run."""
    rules = {r["ruleId"]: r for r in json.loads((FIXTURES / "rules.json").read_text())}

    def before_gold(line: str) -> None:  # the run's log: called as each layer ends
        if line.startswith("silver: done"):
            apply_rules(spark, Lakehouse(str(tmp_path / "lakehouse")), [parse_rule({**rules[1], "ruleState": "PAUSE"})])

    lakehouse, landing, summary = _run_changing_rule_3_after_gold_batch_0(
        spark, tmp_path, monkeypatch, {"ruleState": "DELETE"}, also=[{**rules[4], "ruleState": "ACTIVE"}], log=before_gold
    )
    # Versions: 0 the table created, 1 the rules file, 2 rule 1 paused, 3 rule 4 (paused in the file) active and rule 3 deleted.
    gold_rows = spark.read.format("delta").load(lakehouse.pipeline_metrics).where("layer = 'gold'").collect()
    assert len(gold_rows) > 1 and {r.rules_version for r in gold_rows} == {2}
    assert (summary.rules_version, summary.rules_current, summary.active_rules) == (2, 3, 2)
    assert summary.alerts_per_rule and not {1, 4} & set(summary.alerts_per_rule)
    assert "active rules     2 (config/rules version 2, as gold evaluated)" in summary.lines()
    assert (
        "  config/rules changed after gold read it: this run evaluated with version 2, version 3 is current "
        "and applies from the next run"
    ) in summary.lines()
    assert {r.ruleId for r in spark.read.format("delta").load(lakehouse.rules).where("ruleState = 'ACTIVE'").collect()} == {2, 4}
    _rule_3_fired_as_if_nothing_changed(spark, lakehouse, expected_alerts)
    assert _keysets_held(spark, lakehouse) == {"payeeId,beneficiaryId", "payeeId", "userId"}  # the evaluator never saw the change

    _, next_run = run_all(spark, lakehouse, str(landing), settings=GoldSettings(max_files_per_trigger=1), log=lambda _: None)
    assert (next_run.rules_version, next_run.rules_current, next_run.active_rules) == (3, 3, 2)
    assert not next_run.rules_changed
    assert _keysets_held(spark, lakehouse) == {"payeeId,beneficiaryId", "payeeId"}  # the change reached the evaluator: userId is routed no more


def test_the_rules_version_a_query_read_comes_from_its_newest_committed_batch(tmp_path):
    checkpoint = tmp_path / "gold"
    (checkpoint / "offsets").mkdir(parents=True)
    (checkpoint / "commits").mkdir()
    assert delta_version_read(str(checkpoint), "rules-id") is None  # no batch yet

    def batch(n: int, rules_offset: str, committed: bool = True) -> None:
        silver = '{"sourceVersion":1,"reservoirId":"silver-id","reservoirVersion":9,"index":0,"isStartingVersion":false}'
        (checkpoint / "offsets" / str(n)).write_text("\n".join(["v1", '{"batchWatermarkMs":0}', silver, rules_offset, "-"]))
        if committed:
            (checkpoint / "commits" / str(n)).write_text('v1\n{"nextBatchWatermarkMs":0}')

    # As Delta writes them: index -1, nothing of that version read yet; 0 and up, its changes read through that file.
    batch(0, '{"sourceVersion":1,"reservoirId":"rules-id","reservoirVersion":2,"index":-1,"isStartingVersion":false}')
    assert delta_version_read(str(checkpoint), "rules-id") == 1
    batch(1, '{"sourceVersion":1,"reservoirId":"rules-id","reservoirVersion":2,"index":0,"isStartingVersion":false}')
    batch(2, '{"sourceVersion":1,"reservoirId":"rules-id","reservoirVersion":5,"index":3,"isStartingVersion":false}', committed=False)
    assert delta_version_read(str(checkpoint), "rules-id") == 2  # batch 2 was planned, never run
    assert delta_version_read(str(checkpoint), "another-table") is None


def test_the_summary_names_the_rules_version_gold_evaluated_with_and_a_newer_one():
    counts = dict(bronze=3, silver=3, quarantined=0, duplicates=0, alerts=0, late=0)
    same = Summary(**counts, active_rules=2, rules_version=4, rules_current=4)
    assert "active rules     2 (config/rules version 4, as gold evaluated)" in same.lines()
    assert not same.rules_changed and not any("changed" in line for line in same.lines())
    behind = Summary(**counts, active_rules=0, rules_version=4, rules_current=6)
    lines = behind.lines()
    assert behind.rules_changed and lines[0].startswith("WARNING: no ACTIVE rule")  # nothing was evaluated, whatever is current
    at = lines.index("active rules     0 (config/rules version 4, as gold evaluated)")
    assert lines[at + 1] == (
        "  config/rules changed after gold read it: this run evaluated with version 4, version 6 is current and applies from the next run"
    )
    assert "active rules     2" in Summary(**counts, active_rules=2).lines()  # where gold's read is not known: as before



def test_a_rule_regrouped_during_a_run_keeps_seeing_events_while_gold_still_evaluates_it(spark, tmp_path, monkeypatch, expected_alerts):
    """A run's gold evaluates the rules as they were when it started, in every batch; events must be routed to
    the keys those rules read, not to the table's newest version's: rule 3, regrouped by ip while gold runs,
    fires exactly as if nothing changed, and the change applies next run. (Deleted: the test above.)"""
    lakehouse, landing, _ = _run_changing_rule_3_after_gold_batch_0(spark, tmp_path, monkeypatch, {"groupingKeyNames": ["ip"]})
    _rule_3_fired_as_if_nothing_changed(spark, lakehouse, expected_alerts)
    assert _keysets_held(spark, lakehouse) == {"payeeId,beneficiaryId", "payeeId", "userId"}  # the evaluator never saw the change
    run_all(spark, lakehouse, str(landing), log=lambda _: None)  # the change reaches the evaluator: userId is routed no more
    assert _keysets_held(spark, lakehouse) == {"payeeId,beneficiaryId", "payeeId", "ip"}


@pytest.mark.jvm
def test_a_relative_landing_folder_is_read_and_reconciled_as_this_processs_folder(spark, tmp_path, monkeypatch):
    # A notebook passes a folder relative to its own working directory, which the JVM need not share.
    (tmp_path / "landing").mkdir()
    shutil.copy(FIXTURES / "transactions" / "day1-a.jsonl", tmp_path / "landing")
    monkeypatch.chdir(tmp_path)
    said: list[str] = []
    report = run_bronze(spark, Lakehouse(str(tmp_path / "lakehouse")), "landing", said.append)
    assert report is not None and report.files == 1 and not report.problems, said
    assert not any("NOT INGESTED" in line for line in said)
    bronze = spark.read.format("delta").load(str(tmp_path / "lakehouse" / "bronze" / "transactions"))
    assert bronze.count() == len((FIXTURES / "transactions" / "day1-a.jsonl").read_text().splitlines())
