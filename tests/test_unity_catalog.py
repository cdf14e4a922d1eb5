"""Unity Catalog managed tables: one naming layer (``Lakehouse.schema``) moves every table into a catalog.

Locally the catalog is Spark's own ``spark_catalog`` (managed Delta tables in the session's
warehouse folder), which resolves three-level names the way Unity Catalog does on Databricks; the
pipeline, the views and the explore helpers must then give the same answers as on Delta folders.
"""

from __future__ import annotations

import re
import uuid
from decimal import Decimal
from pathlib import Path

import pytest
from pyspark.sql import functions as F

from conftest import FIXTURES, ROOT
from rulewatch.spark.storage.checkpoints import CheckpointError, check_queries
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.present.views import VIEW_NAMES

def test_a_schema_names_every_table_in_it_and_keeps_checkpoints_in_the_volume():
    on_disk, in_catalog = Lakehouse("/tmp/lh"), Lakehouse("/tmp/lh", schema="main.rulewatch")
    assert in_catalog.alerts == "main.rulewatch.gold_alerts" and in_catalog.rule_history == "main.rulewatch.gold_rule_history"
    assert on_disk.alerts == "/tmp/lh/gold/alerts"
    assert in_catalog.checkpoint("gold") == on_disk.checkpoint("gold") == "/tmp/lh/_checkpoints/gold"
    assert len(in_catalog.tables()) == len(on_disk.tables()) and {in_catalog.alerts, in_catalog.rule_commands} <= set(in_catalog.tables())
    for catalog_name, path in zip(in_catalog.tables(), on_disk.tables()):  # metrics rows name a table the same way either way
        assert in_catalog.name_of(catalog_name) == on_disk.name_of(path)
    assert len(set(in_catalog.tables())) == len(in_catalog.tables())


@pytest.mark.parametrize("bad", ["rulewatch", "main.rulewatch.extra", "main.rule watch", "main.`x`", "main."])
def test_a_schema_that_is_not_catalog_dot_schema_is_refused(bad):
    with pytest.raises(ValueError, match=re.escape(repr(bad)) + " is not catalog.schema"):
        Lakehouse("/tmp/lh", schema=bad)


def _grants() -> list[tuple[str, str, str, str]]:
    """(privileges, object kind, object name, principals) of every GRANT in the SQL grant script."""
    text = (ROOT / "sql" / "unity_catalog_grants.sql").read_text()
    statements = re.findall(r"^GRANT (.+?) ON (CATALOG|SCHEMA|TABLE|VIEW|VOLUME) (\S+) TO (.+);$", text, re.M)
    assert statements, "no GRANT statement found"
    return statements


def test_the_grant_script_names_only_tables_and_views_the_code_creates():
    prod = Lakehouse("/Volumes/main/rulewatch/lakehouse", schema="main.rulewatch")
    tables = set(prod.tables())
    views = {f"main.rulewatch.{v}" for v in VIEW_NAMES}
    for _, kind, name, _ in _grants():
        if kind == "TABLE":
            assert name in tables, f"the grant script grants on {name}, which is no rulewatch table"
        if kind == "VIEW":
            assert name in views, f"the grant script grants on {name}, which is no rulewatch view"


def test_analysts_get_every_dashboard_view_and_nothing_else():
    analysts = [(privileges, kind, name) for privileges, kind, name, who in _grants() if "`fraud-analysts`" in who]
    # A SELECT on the schema would open every table, raw events included, now that the tables live there.
    assert {name for privileges, kind, name in analysts if kind == "VIEW" and privileges == "SELECT"} == {
        f"main.rulewatch.{v}" for v in VIEW_NAMES
    }
    assert {(p, k) for p, k, _ in analysts if k != "VIEW"} == {("USE CATALOG", "CATALOG"), ("USE SCHEMA", "SCHEMA")}


def test_rule_editors_may_change_the_rules_table_and_no_other_table():
    writes = [(kind, name) for privileges, kind, name, who in _grants() if "`fraud-rule-editors`" in who and "MODIFY" in privileges]
    assert writes == [("TABLE", "main.rulewatch.config_rules")]


@pytest.fixture
def catalog_lakehouse(spark, tmp_path):
    schema = f"spark_catalog.rulewatch_uc_{uuid.uuid4().hex[:8]}"
    spark.sql(f"CREATE SCHEMA {schema}")
    yield Lakehouse(str(tmp_path / "lakehouse"), schema=schema)
    spark.sql(f"DROP SCHEMA {schema} CASCADE")


@pytest.mark.jvm
def test_the_pipeline_on_catalog_tables_gives_the_fixture_alerts(spark, tmp_path, catalog_lakehouse, expected_alerts):
    import shutil

    from rulewatch.spark.present.explore import explain_alert
    from rulewatch.spark.layers.pipeline import run_all
    from rulewatch.spark.present.views import catalog_view_statements, register_views

    lakehouse = catalog_lakehouse
    landing = tmp_path / "landing"
    shutil.copytree(FIXTURES / "transactions", landing)
    _, summary = run_all(spark, lakehouse, str(landing), str(FIXTURES / "rules.json"), log=lambda _: None)
    assert (summary.bronze, summary.silver, summary.quarantined, summary.duplicates) == (50, 42, 6, 2)

    alerts = spark.read.table(lakehouse.alerts)
    got = sorted((r.rule_id, r.transaction_id, r.group_key, r.aggregate_value, r.event_count) for r in alerts.collect())
    want = sorted(
        (a["rule_id"], a["transaction_id"], a["group_key"], Decimal(str(a["aggregate_value"])), a["event_count"])
        for a in expected_alerts
    )
    assert got == want
    # Every table is a catalog table; the lakehouse folder holds checkpoints and no table.
    for name in lakehouse.tables():
        if name != lakehouse.rule_commands:  # created on the first clear command only
            assert spark.catalog.tableExists(name), f"{name} was not created in the catalog"
    assert not list(Path(lakehouse.root).glob("*/_delta_log")) and not list(Path(lakehouse.root).glob("*/*/_delta_log"))
    assert (Path(lakehouse.root) / "_checkpoints" / "gold").is_dir()
    metrics = spark.read.table(lakehouse.pipeline_metrics)
    written = {r.key for r in metrics.select(F.explode("rows_written")).collect()}
    assert {"bronze/transactions", "silver/transactions", "gold/alerts"} <= written

    # Views and explain read the catalog tables; the Unity Catalog views name them, no path.
    register_views(spark, lakehouse, viewer_in_pii_group=True)
    assert spark.sql("SELECT SUM(alerts) FROM alerts_per_rule_hour").first()[0] == len(expected_alerts)
    statements = catalog_view_statements("main", "rulewatch", lakehouse, "fraud-investigators")
    assert all("delta.`" not in s for s in statements)
    assert any(f"`{lakehouse.alerts.split('.')[1]}`.`gold_alerts`" in s for s in statements)
    first = alerts.first()
    explained = explain_alert(spark, lakehouse, first.alert_id)
    assert explained.alert["alert_id"] == first.alert_id and explained.rule is not None
    assert explained.recomputed == first.aggregate_value

    # A second run over the same landing folder continues from the checkpoints: nothing duplicated.
    run_all(spark, lakehouse, str(landing), log=lambda _: None)
    assert spark.read.table(lakehouse.alerts).count() == len(expected_alerts)
    assert spark.read.table(lakehouse.bronze_transactions).count() == 50

    # A lost checkpoint is refused, though the table's log is no file: the commits' metadata says
    # which batches the tables hold (DESCRIBE HISTORY), and starting over would skip them.
    shutil.rmtree(lakehouse.checkpoint("gold"))
    with pytest.raises(CheckpointError, match=rf"checkpoint {re.escape(lakehouse.checkpoint('gold'))} is missing or empty, but {re.escape(lakehouse.alerts)} already holds batch \d+ of rulewatch.gold.alerts"):
        check_queries(lakehouse, "gold", spark=spark)
    with pytest.raises(ValueError, match="needs a SparkSession"):
        check_queries(lakehouse, "gold")
