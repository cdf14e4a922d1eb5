"""Every notebook executed for real, in job order, against a local lakehouse; same results as the CLI."""

from __future__ import annotations

import os
from decimal import Decimal
from pathlib import Path

import nbformat
import pytest
from chispa import assert_df_equality
from nbclient import NotebookClient

from conftest import FIXTURES, ROOT
from rulewatch.widgets import widget_env

NOTEBOOKS = ["00_setup", "01_bronze", "02_silver", "03_gold"]


def execute(name: str, params: dict[str, str], monkeypatch) -> nbformat.NotebookNode:
    for key, value in widget_env(params).items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    return nb


def test_notebooks_run_the_job_and_match_the_cli(spark, fixture_run, tmp_path, monkeypatch):
    lakehouse = tmp_path / "lakehouse"
    params = {
        "lakehouse": str(lakehouse),
        "landing": str(FIXTURES / "transactions"),
        "rules_file": str(FIXTURES / "rules.json"),
    }
    outputs = {name: execute(name, params, monkeypatch) for name in NOTEBOOKS}
    gold_text = "".join(
        out.get("text", "") for cell in outputs["03_gold"].cells if cell.cell_type == "code" for out in cell.outputs
    )
    assert "bronze = silver + quarantined + duplicates: ok" in gold_text

    def table(root: str, layer: str, name: str):
        return spark.read.format("delta").load(f"{root}/{layer}/{name}")

    columns = ["rule_id", "rule_version", "group_key", "transaction_id", "event_time", "aggregate_value", "event_count"]
    assert_df_equality(
        table(str(lakehouse), "gold", "alerts").select(*columns),
        table(fixture_run.lakehouse.root, "gold", "alerts").select(*columns),
        ignore_row_order=True,
    )
    for layer, name in [("silver", "transactions"), ("silver", "quarantine"), ("silver", "duplicates")]:
        assert table(str(lakehouse), layer, name).count() == table(fixture_run.lakehouse.root, layer, name).count()
