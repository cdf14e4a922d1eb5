"""Dashboard views and every dashboard widget, run for real over the gold tables of a fixture pipeline run.

Locally the dashboard's datasets (unqualified view names, as on Databricks where the bundle sets
their catalog and schema) resolve to the temp views ``register_views`` creates; each widget's
query is then run the way Lakeview runs it: its field expressions over the dataset, grouped by the
fields that are not aggregates.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from datetime import datetime, timezone
from decimal import Decimal

import pytest
from pyspark.sql import Row

from conftest import ROOT
from rulewatch.spark.storage import schema
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.present.views import VIEW_NAMES, catalog_view_statements, register_views

pytestmark = pytest.mark.jvm

DASHBOARD = json.loads((ROOT / "resources" / "rulewatch.lvdash.json").read_text())
DATASETS = {d["name"]: "".join(d["queryLines"]) for d in DASHBOARD["datasets"]}
PARAMETERS = {d["name"]: {p["keyword"]: p for p in d.get("parameters", [])} for d in DASHBOARD["datasets"]}
FILTERS = {
    item["widget"]["name"]: item["widget"]
    for page in DASHBOARD["pages"]
    for item in page["layout"]
    if item["widget"].get("spec", {}).get("widgetType", "").startswith("filter-")
}
WIDGETS = [
    (page["name"], item["widget"])
    for page in DASHBOARD["pages"]
    for item in page["layout"]
    if "queries" in item["widget"] and item["widget"]["name"] not in FILTERS
]
_AGGREGATE = re.compile(r"^\s*(SUM|COUNT|AVG|MIN|MAX|MEDIAN)\s*\(", re.IGNORECASE)
# What a widget may compute itself: a column, or one aggregate of one column. Anything more (a CASE,
# arithmetic) belongs in the dataset SQL, where the other widgets and the report see the same number.
_PLAIN_FIELD = re.compile(r"^(`\w+`|(SUM|COUNT|AVG|MIN|MAX)\((DISTINCT )?`\w+`\)|COUNT\(\*\))$")
# Filter values as an analyst would pick them on the fixture run: its events are all on 2026-11-01.
FIXTURE_DAY = ("2026-11-01", "2026-11-01")


def _bindings(filter_widget: dict) -> dict[str, dict]:
    """Dataset name -> the encoding (``fieldName`` or ``parameterName``) through which the filter reaches it."""
    datasets = {q["name"]: q["query"]["datasetName"] for q in filter_widget["queries"]}
    return {datasets[f["queryName"]]: f for f in filter_widget["spec"]["encodings"]["fields"]}


def _literal(value) -> str:
    return str(value) if isinstance(value, int) else "'" + str(value).replace("'", "''") + "'"


def dataset_sql(name: str, selections: dict[str, object]) -> str:
    """A dataset's query as Lakeview runs it with ``selections`` (filter widget name -> a ``(first, last)``
    date pair for a date range picker, a list of values for a multi-select): parameters bound, and the
    field filters as a predicate around the dataset, days inclusive on both ends."""
    sql = DATASETS[name]
    ranges = {kw: (p["defaultSelection"]["range"]["min"]["value"], p["defaultSelection"]["range"]["max"]["value"])
              for kw, p in PARAMETERS[name].items()}  # fmt: skip
    predicates = []
    for filter_name, value in selections.items():
        binding = _bindings(FILTERS[filter_name]).get(name)
        if binding is None:
            continue
        if "parameterName" in binding:
            ranges[binding["parameterName"]] = value
        elif FILTERS[filter_name]["spec"]["widgetType"] == "filter-date-range-picker":
            predicates.append(f"CAST(`{binding['fieldName']}` AS DATE) BETWEEN DATE'{value[0]}' AND DATE'{value[1]}'")
        else:
            predicates.append(f"`{binding['fieldName']}` IN ({', '.join(_literal(v) for v in value)})")
    for keyword, (first, last) in ranges.items():
        sql = sql.replace(f":{keyword}.min", f"DATE'{first}'").replace(f":{keyword}.max", f"DATE'{last}'")
    assert not re.search(r":\w+\.(min|max)\b", sql), f"{name}: a parameter no filter or default binds"
    where = f" WHERE {' AND '.join(predicates)}" if predicates else ""
    return f"SELECT * FROM ({sql}) AS unfiltered{where}"


def widget_sql(query: dict, selections: dict[str, object] | None = None) -> str:
    """The SQL Lakeview runs for one widget query: its fields over the (filtered) dataset, aggregated unless disaggregated."""
    fields = query["fields"]
    select = ", ".join(f"{f['expression']} AS `{f['name']}`" for f in fields)
    sql = f"SELECT {select} FROM ({dataset_sql(query['datasetName'], selections or {})}) AS dataset"
    groups = [f["expression"] for f in fields if not _AGGREGATE.match(f["expression"])]
    if not query.get("disaggregated") and groups and len(groups) < len(fields):
        sql += " GROUP BY " + ", ".join(groups)
    return sql


def _field_names(node) -> set[str]:
    if isinstance(node, dict):
        own = {node["fieldName"]} if "fieldName" in node else set()
        return own | {n for v in node.values() for n in _field_names(v)}
    if isinstance(node, list):
        return {n for v in node for n in _field_names(v)}
    return set()


@pytest.fixture
def masked(spark, fixture_run):
    """Views as a viewer outside the PII group sees them (the dashboard's default audience).

    Registered per test: temp views are per session, and the masking tests point them elsewhere."""
    register_views(spark, fixture_run.lakehouse, viewer_in_pii_group=False)
    return spark


def _widget(name: str) -> dict:
    return next(w for _, w in WIDGETS if w["name"] == name)


def _run_widget(spark, name: str, selections: dict[str, object] | None = None) -> list[Row]:
    return spark.sql(widget_sql(_widget(name)["queries"][0]["query"], selections)).collect()


@pytest.mark.parametrize(("page", "widget"), WIDGETS, ids=[w["name"] for _, w in WIDGETS])
def test_every_widget_query_runs_with_and_without_filters_and_reads_only_its_own_fields(masked, page, widget):
    today = datetime.now(timezone.utc).date().isoformat()
    for selections in ({}, {"event_date": FIXTURE_DAY, "rule": [2], "batch_date": (today, today)}):
        for query in widget["queries"]:
            frame = masked.sql(widget_sql(query["query"], selections))
            frame.collect()
            encoded = _field_names(widget["spec"]["encodings"])
            assert encoded and encoded <= set(frame.columns), f"{page}/{widget['name']}: encodings read {encoded - set(frame.columns)}"
            unplain = [f["expression"] for f in query["query"]["fields"] if not _PLAIN_FIELD.match(f["expression"])]
            assert not unplain, f"{page}/{widget['name']}: compute {unplain} in the dataset SQL, not in the widget"


def test_every_dataset_reads_one_view_and_every_view_is_on_the_dashboard():
    read = {re.search(r"FROM\s+(\w+)", sql).group(1) for sql in DATASETS.values()}
    # key_window_metrics is per key over time: the explore notebook's, with a key picked first.
    # top_alerting_keys ranks over all time; the dashboard ranks within the picked event dates, so its
    # dataset counts alerts_masked itself (test_keys_dataset_ranks_like_the_view_over_all_dates ties them).
    assert read == set(VIEW_NAMES) - {"key_window_metrics", "top_alerting_keys"}


def test_filters_reach_every_dataset_with_their_column(masked):
    columns = {name: set(masked.sql(dataset_sql(name, {})).columns) for name in DATASETS}
    date_bound = {}
    for name, widget in FILTERS.items():
        for dataset, binding in _bindings(widget).items():
            if "parameterName" in binding:
                assert binding["parameterName"] in PARAMETERS[dataset], f"{name}: {dataset} has no parameter {binding['parameterName']}"
            else:
                assert binding["fieldName"] in columns[dataset], f"{name}: {dataset} has no column {binding['fieldName']}"
                # The filter's own query (its list of values) runs as well.
                masked.sql(f"SELECT `{binding['fieldName']}` FROM ({dataset_sql(dataset, {})}) GROUP BY 1").collect()
            if widget["spec"]["widgetType"] == "filter-date-range-picker":
                date_bound.setdefault(dataset, []).append(name)
    rule_bound = set(_bindings(FILTERS["rule"]))
    assert rule_bound == {name for name, cols in columns.items() if "rule_id" in cols}
    # Each dataset is cut by exactly one date filter, or is about all time (and its title says so).
    all_time = {"rule_effectiveness", "quarantine_reasons", "freshness"}
    assert {d: len(f) for d, f in date_bound.items()} == dict.fromkeys(set(DATASETS) - all_time, 1)
    global_page = next(p for p in DASHBOARD["pages"] if p.get("pageType") == "PAGE_TYPE_GLOBAL_FILTERS")
    assert {item["widget"]["name"] for item in global_page["layout"]} == {"event_date", "rule"}


def test_rule_filter_keeps_only_the_picked_rules(masked, expected_alerts):
    picked = [a for a in expected_alerts if a["rule_id"] in (1, 3)]
    only = {"rule": [1, 3]}
    assert [r[0] for r in _run_widget(masked, "total_alerts", only)] == [len(picked)]
    assert [r[0] for r in _run_widget(masked, "rules_alerting", only)] == [2]
    assert [r[0] for r in _run_widget(masked, "keys_alerted", only)] == [len({(a["rule_id"], a["group_key"]) for a in picked})]
    assert {r.rule for r in _run_widget(masked, "alerts_per_hour", only)} == {"rule 1", "rule 3"}
    assert sorted(r.transaction_id for r in _run_widget(masked, "alert_list", only)) == sorted(a["transaction_id"] for a in picked)
    assert {r.rule_id for r in _run_widget(masked, "top_keys", only)} == {1, 3}
    assert sorted(r.rule_id for r in _run_widget(masked, "effectiveness", only)) == [1, 3]
    assert {r.rule_id for r in _run_widget(masked, "rule_history", only)} == {1, 3}


def test_event_date_filter_counts_only_alerts_of_those_days(masked, expected_alerts):
    day = {"event_date": FIXTURE_DAY}
    assert [r[0] for r in _run_widget(masked, "total_alerts", day)] == [len(expected_alerts)]
    assert [r[0] for r in _run_widget(masked, "keys_alerted", day)] == [len({(a["rule_id"], a["group_key"]) for a in expected_alerts})]
    after = {"event_date": ("2026-11-02", "2026-11-30")}
    assert [r[0] for r in _run_widget(masked, "total_alerts", after)] == [None]
    assert [r[0] for r in _run_widget(masked, "keys_alerted", after)] == [0]
    assert _run_widget(masked, "top_keys", after) == [] and _run_widget(masked, "alert_list", after) == []
    before = {"event_date": ("2026-10-01", "2026-10-31")}
    assert _run_widget(masked, "alerts_per_hour", before) == []


def test_batch_date_filter_picks_batches_by_when_they_ran(masked, fixture_run):
    metrics = masked.read.format("delta").load(fixture_run.lakehouse.pipeline_metrics)
    days = sorted({r[0].isoformat() for r in metrics.selectExpr("CAST(batch_end AS DATE)").collect()})
    first, last = days[0], days[-1]
    bronze = masked.read.format("delta").load(fixture_run.lakehouse.bronze_transactions).count()
    assert [r[0] for r in _run_widget(masked, "rows_ingested", {"batch_date": (first, last)})] == [bronze]
    assert [r[0] for r in _run_widget(masked, "rows_ingested", {"batch_date": ("2000-01-01", "2000-01-02")})] == [None]
    gold_batches = metrics.where("layer = 'gold'").count()
    assert len(_run_widget(masked, "latency_chart", {"batch_date": (first, last)})) == gold_batches


def test_keys_dataset_ranks_like_the_view_over_all_dates(masked, fixture_run):
    # The keys counter and table read a dataset that re-counts alerts_masked per event-date range; with
    # the default range (every date) it must be the view, row for row, and count keys without a cap.
    dataset = masked.sql(dataset_sql("top_alerting_keys", {})).collect()
    assert sorted(dataset) == sorted(masked.sql("SELECT * FROM top_alerting_keys").collect())
    alerts = masked.read.format("delta").load(fixture_run.lakehouse.alerts)
    assert [r[0] for r in _run_widget(masked, "keys_alerted")] == [alerts.select("rule_id", "group_key").distinct().count()]


def test_freshness_is_the_newest_event_and_the_last_gold_batch(masked, fixture_run):
    before = datetime.now(timezone.utc).replace(tzinfo=None)
    (row,) = masked.sql(dataset_sql("freshness", {})).collect()
    after = datetime.now(timezone.utc).replace(tzinfo=None)
    silver = masked.read.format("delta").load(fixture_run.lakehouse.silver_transactions)
    metrics = masked.read.format("delta").load(fixture_run.lakehouse.pipeline_metrics)
    assert row.newest_event_time == silver.agg({"event_time": "max"}).first()[0]
    assert row.last_gold_batch_end == metrics.where("layer = 'gold'").agg({"batch_end": "max"}).first()[0]
    for lag, since in ((row.event_lag_minutes, row.newest_event_time), (row.gold_lag_minutes, row.last_gold_batch_end)):
        lowest, highest = ((t - since).total_seconds() / 60 for t in (before, after))
        assert lowest - 0.05 <= float(lag) <= highest + 0.05
    ((tile,),) = _run_widget(masked, "gold_lag")  # a later query: the lag has grown since
    assert row.gold_lag_minutes <= tile <= row.gold_lag_minutes + Decimal("0.5")


def test_overview_numbers_match_the_fixture_alerts(masked, expected_alerts):
    per_rule = Counter(a["rule_id"] for a in expected_alerts)
    assert [r[0] for r in _run_widget(masked, "total_alerts")] == [len(expected_alerts)]
    assert [r[0] for r in _run_widget(masked, "rules_alerting")] == [len(per_rule)]
    assert [r[0] for r in _run_widget(masked, "keys_alerted")] == [len({(a["rule_id"], a["group_key"]) for a in expected_alerts})]

    bars = _run_widget(masked, "alerts_per_hour")
    assert sum(r["sum(alerts)"] for r in bars) == len(expected_alerts)
    assert {(r["hour"], r["rule"]): r["sum(alerts)"] for r in bars} == {
        (datetime(2026, 11, 1, 10), "rule 1"): 2,
        (datetime(2026, 11, 1, 11), "rule 1"): 1,
        (datetime(2026, 11, 1, 10), "rule 2"): 2,
        (datetime(2026, 11, 1, 11), "rule 2"): 2,
        (datetime(2026, 11, 1, 12), "rule 3"): 3,
    }
    top = _run_widget(masked, "top_keys")
    assert [(r.key_rank, r.rule_id, r.alerts) for r in top] == [(1, 2, 4), (2, 3, 3), (3, 1, 2), (4, 1, 1)]


def test_rule_effectiveness_counts_alerts_per_1k_events_and_keys_near_their_limit(masked, fixture_run, expected_alerts):
    silver_events = masked.read.format("delta").load(fixture_run.lakehouse.silver_transactions).count()
    rows = {r.rule_id: r for r in _run_widget(masked, "effectiveness")}
    assert sorted(rows) == [1, 2, 3, 4]
    for rule_id, row in rows.items():
        alerts = sum(a["rule_id"] == rule_id for a in expected_alerts)
        assert row.alerts == alerts
        assert row.alerts_per_1k_events == Decimal(1000 * alerts / silver_events).quantize(Decimal("0.001"))
    # Peaks >= 80% of the limit that never alerted: payee-A|ben-3 at 900/1000 (rule 1), payee-D at
    # 4 of 5 payments (rule 2), u-2002 at 4 IPs against "more than 4" (rule 3). Paused rule 4 saw nothing.
    assert {k: (r.keys_evaluated, r.keys_alerted, r.keys_near_limit) for k, r in rows.items()} == {
        1: (5, 2, 1),
        2: (4, 1, 1),
        3: (3, 1, 1),
        4: (0, 0, 0),
    }
    assert rows[1].share_near_limit == 0.2 and rows[4].share_near_limit is None


def test_operations_page_counts_quarantine_reasons_and_rule_changes(masked, fixture_run):
    reasons = {r.reason_code: r["sum(lines)"] for r in _run_widget(masked, "quarantine_chart")}
    assert sum(reasons.values()) == fixture_run.summary.quarantined == 6
    assert reasons["missing_event_time"] == 1 and "other" not in reasons
    changes = _run_widget(masked, "rule_history")
    assert sorted((r.rule_id, r.change) for r in changes) == [(i, "inserted") for i in (1, 2, 3, 4)]
    assert all(r.rule_description for r in changes)


def test_pipeline_metrics_widgets_add_up_to_the_tables(masked, fixture_run):
    assert _run_widget(masked, "batches"), "every layer records its batches in gold/pipeline_metrics"
    bronze = masked.read.format("delta").load(fixture_run.lakehouse.bronze_transactions).count()
    assert [r[0] for r in _run_widget(masked, "rows_ingested")] == [bronze]
    assert [r[0] for r in _run_widget(masked, "rows_quarantined")] == [6]
    latencies = [r for r in _run_widget(masked, "latency_chart") if r.latency_p50_ms is not None]
    assert latencies and all(r.latency_p50_ms <= r.latency_p95_ms <= r.latency_p99_ms for r in latencies)


# ---- masking account identifiers ---------------------------------------------------------------------


def _alert(alert_id: str, group_key: str, key_parts: dict[str, str] | None, distinct: list[str] | None) -> dict:
    return {
        "alert_id": alert_id, "rule_id": 1, "group_key": group_key, "key_parts": key_parts, "transaction_id": "t-" + alert_id,
        "event_time": datetime(2026, 11, 1, 10), "distinct_values": distinct,
    }  # fmt: skip


@pytest.fixture(scope="module")
def masking_lakehouse(spark, tmp_path_factory) -> Lakehouse:
    """A gold/alerts table keyed by an account id, by a payment type only, and one row without key parts."""
    lakehouse = Lakehouse(str(tmp_path_factory.mktemp("masking")))
    rows = [
        _alert("a1", "payee-A|card", {"payeeId": "payee-A", "paymentType": "card"}, ["ben-1", "ben-2"]),
        _alert("a2", "payee-A|card", {"payeeId": "payee-A", "paymentType": "card"}, ["ben-1"]),
        _alert("a3", "card", {"paymentType": "card"}, None),
        _alert("a4", "u-1001", None, ["10.0.0.1"]),
    ]
    frame = spark.createDataFrame([tuple(r.get(f.name) for f in schema.ALERTS.fields) for r in rows], schema.ALERTS)
    frame.write.format("delta").save(lakehouse.alerts)
    return lakehouse


def _masked_alerts(spark, lakehouse: Lakehouse, member: bool) -> dict[str, Row]:
    register_views(spark, lakehouse, viewer_in_pii_group=member)
    return {r.alert_id: r for r in spark.sql("SELECT * FROM alerts_masked").collect()}


def test_group_members_see_account_identifiers(spark, masking_lakehouse):
    rows = _masked_alerts(spark, masking_lakehouse, member=True)
    assert rows["a1"].group_key == "payee-A|card" and rows["a1"].key_parts == {"payeeId": "payee-A", "paymentType": "card"}
    assert rows["a1"].distinct_values == ["ben-1", "ben-2"] and rows["a4"].group_key == "u-1001"


def test_other_viewers_get_stable_pseudonyms_for_account_identifiers_only(spark, masking_lakehouse):
    rows = _masked_alerts(spark, masking_lakehouse, member=False)
    a1, a2, a3, a4 = (rows[k] for k in ("a1", "a2", "a3", "a4"))
    shown = json.dumps([r.asDict(recursive=True) for r in rows.values()], default=str)
    for identifier in ("payee-A", "ben-1", "ben-2", "u-1001", "10.0.0.1"):
        assert identifier not in shown
    assert re.fullmatch(r"#[0-9a-f]{10}", a1.group_key) and a1.group_key == a2.group_key  # still countable per key
    assert a1.key_parts["paymentType"] == "card" and a1.key_parts["payeeId"].startswith("#")
    assert a1.distinct_values[0] == a2.distinct_values[0] != a1.distinct_values[1]
    assert a3.group_key == "card"  # no account field in the key: nothing to hide
    assert a4.group_key.startswith("#")  # key parts unknown: masked to be safe
    assert a1.transaction_id == "t-a1"


def test_catalog_statements_are_valid_sql_whatever_their_comments_say(spark, tmp_path):
    """Run here, each statement stops at its missing tables or the workspace-only group function,
    never at parsing: view comments hold apostrophes ("a key's ...")."""
    from pyspark.errors import AnalysisException, ParseException

    statements = catalog_view_statements("spark_catalog", "default", Lakehouse(str(tmp_path / "none")), "fraud-investigators")
    assert any("'s " in s.split(" AS ", 1)[0] for s in statements)  # an apostrophe in a comment
    for statement in statements:
        with pytest.raises(AnalysisException) as err:
            spark.sql(statement)
        assert not isinstance(err.value, ParseException), statement[:160]


def test_catalog_statements_qualify_views_and_test_group_membership():
    statements = catalog_view_statements("main", "rulewatch", Lakehouse("/Volumes/main/rulewatch/lakehouse"), "fraud-investigators")
    assert [re.match(r"CREATE OR REPLACE VIEW `main`\.`rulewatch`\.`(\w+)`", s).group(1) for s in statements] == list(VIEW_NAMES)
    assert "is_account_group_member('fraud-investigators')" in statements[0]
    assert "FROM delta.`/Volumes/main/rulewatch/lakehouse/gold/alerts`" in statements[0]
    assert "FROM `main`.`rulewatch`.`alerts_masked`" in statements[VIEW_NAMES.index("top_alerting_keys")]


@pytest.mark.parametrize(
    ("catalog", "group", "message"),
    [("main;drop", "g", "catalog 'main;drop' is not a plain identifier"), ("main", "x') OR TRUE --", "PII group")],
)
def test_catalog_statements_reject_unsafe_names(catalog, group, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        catalog_view_statements(catalog, "rulewatch", Lakehouse("/Volumes/main/rulewatch/lakehouse"), group)


def test_views_answer_empty_on_a_lakehouse_that_has_not_run_yet(spark, tmp_path):
    register_views(spark, Lakehouse(str(tmp_path / "fresh")), viewer_in_pii_group=False)
    # freshness always answers one row: with nothing run yet, nothing is fresh (nulls, not an empty tile).
    assert {name: spark.table(name).count() for name in VIEW_NAMES} == dict.fromkeys(VIEW_NAMES, 0) | {"freshness": 1}
    assert spark.table("freshness").first().asDict(recursive=True) | {"checked_at": None} == dict.fromkeys(
        ("newest_event_time", "last_gold_batch_end", "checked_at", "event_lag_minutes", "gold_lag_minutes")
    )


# ---- table and column comments ---------------------------------------------------------------------

GOLD_SCHEMAS = {"alerts": schema.ALERTS, "window_metrics": schema.WINDOW_METRICS, "pipeline_metrics": schema.PIPELINE_METRICS,
                "late_events": schema.LATE_EVENTS, "rule_history": schema.RULE_HISTORY}  # fmt: skip


@pytest.mark.parametrize("table", sorted(GOLD_SCHEMAS))
def test_every_gold_column_is_described_in_the_table_itself(spark, fixture_run, table):
    undocumented = [f.name for f in GOLD_SCHEMAS[table].fields if not f.metadata.get("comment")]
    assert not undocumented, f"spark/storage/schema.py: gold/{table} columns without a comment: {undocumented}"
    stored = {f.name: f.metadata.get("comment") for f in spark.read.format("delta").load(fixture_run.lakehouse.table("gold", table)).schema}
    assert stored == {f.name: f.metadata["comment"] for f in GOLD_SCHEMAS[table].fields}


def test_comments_with_quotes_and_backslashes_survive_table_creation(spark, tmp_path):
    from pyspark.sql.types import StringType, StructField, StructType

    from rulewatch.spark.storage.tables import ensure_table

    text = "it's a \\ path; -- not SQL"
    path = str(tmp_path / "t")
    ensure_table(spark, path, StructType([StructField("c", StringType(), metadata={"comment": text})]), comment=text)
    assert spark.read.format("delta").load(path).schema["c"].metadata["comment"] == text
    assert spark.sql(f"DESCRIBE DETAIL delta.`{path}`").first().description == text
