"""The notebooks as a user opens them: cwd = notebooks/, no widget values, the repository root found upwards."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import nbformat
import pytest

from conftest import ROOT, cell_text
from rulewatch.cli.jobs import notebook_warnings
from rulewatch.spark.layers.pipeline import NO_RULES_WARNING
from rulewatch.spark.runtime.env import repository_root
from rulewatch.spark.present.widgets import int_widget, resolve_path

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _code(path: Path) -> list:
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def _checkout(tmp_path: Path) -> Path:
    """A copy of what a user has after cloning: the bundle file, the notebooks, the fixtures and src/."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(ROOT / "databricks.yml", root)
    for folder in ("notebooks", "fixtures", "src"):
        shutil.copytree(ROOT / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.fixture
def kernel(notebook_kernel):
    """The suite's kernel (conftest): each notebook run starts with an empty namespace, its own widget
    values and working directory, as a user's Jupyter sets them."""
    return notebook_kernel


def _run(kernel, notebook: Path, widgets: dict[str, str] | None = None) -> list:
    """Execute like Jupyter opened from the notebook's folder; returns its code cells with outputs."""
    nb = nbformat.read(notebook, as_version=4)
    try:
        kernel.run(nb, widgets or {}, timeout=600, cwd=notebook.parent)
    finally:  # kept beside the checkout, so a failing assertion can be read against what the notebook showed
        nbformat.write(nb, notebook.parent.parent / f"executed-{notebook.name}")
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{notebook.name}: {errors[0].ename}: {errors[0].evalue}"
    return code


def test_paths_resolve_against_the_repository_root_and_absolute_ones_stay(tmp_path, monkeypatch):
    root = _checkout(tmp_path)
    monkeypatch.chdir(root / "notebooks")
    assert repository_root() == root.resolve()
    assert resolve_path("lakehouse") == str(root.resolve() / "lakehouse")
    assert resolve_path("fixtures/rules.json") == str(root.resolve() / "fixtures" / "rules.json")
    for given in ("/Volumes/main/fraud/lakehouse", "s3://bucket/landing", ""):
        assert resolve_path(given) == given


def test_a_number_widget_names_itself_when_its_value_is_not_a_number(monkeypatch):
    monkeypatch.delenv("RULEWATCH_WIDGET_SHARDS", raising=False)
    assert int_widget("shards", 16) == 16  # unset: the default
    monkeypatch.setenv("RULEWATCH_WIDGET_SHARDS", " 4 ")
    assert int_widget("shards", 16) == 4
    monkeypatch.setenv("RULEWATCH_WIDGET_SHARDS", "four")
    with pytest.raises(ValueError, match="^widget shards must be a whole number, got 'four'$"):
        int_widget("shards", 16)


def test_every_notebook_opens_with_the_same_cell_that_finds_the_package_upwards(tmp_path):
    first = {path.name: _code(path)[0].source for path in NOTEBOOKS}
    assert len(NOTEBOOKS) == 7 and len(set(first.values())) == 1, first
    root = _checkout(tmp_path)
    # An interpreter that cannot import rulewatch at all: no site-packages (-S), no PYTHONPATH (-I).
    probe = next(iter(first.values())) + "\nimport rulewatch.spark.storage.lakehouse\nprint(rulewatch.spark.storage.lakehouse.__file__)"
    done = subprocess.run([sys.executable, "-I", "-S", "-c", probe], cwd=root / "notebooks", capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(root.resolve() / "src" / "rulewatch" / "spark" / "storage" / "lakehouse.py")


@pytest.mark.slow
@pytest.mark.jvm
@pytest.mark.notebook
def test_notebooks_00_to_04_run_from_the_notebooks_folder_and_show_each_layer_and_06_rescales_gold(kernel, tmp_path):
    root = _checkout(tmp_path)
    setup, bronze, silver, gold, explore = (_run(kernel, root / "notebooks" / f"{name}.ipynb") for name in
                                            ("00_setup", "01_bronze", "02_silver", "03_gold", "04_explore"))  # fmt: skip

    # Defaults resolved against the root: the lakehouse sits beside databricks.yml, nothing new beside the notebooks.
    assert sorted(p.name for p in (root / "notebooks").iterdir()) == sorted(p.name for p in NOTEBOOKS)
    assert (root / "lakehouse" / "gold" / "alerts" / "_delta_log").is_dir()
    assert f"lakehouse  {root.resolve() / 'lakehouse'}" in cell_text(setup[1])

    setup_text = "".join(map(cell_text, setup))
    assert "rule 1: added" in setup_text
    assert "ruleId: integer" in setup_text and "Burst: 5 or more payments" in setup_text
    bronze_text = "".join(map(cell_text, bronze))
    assert "value: string" in bronze_text and "pay-a1" in bronze_text and "day1-a.jsonl" in bronze_text
    silver_text = "".join(map(cell_text, silver))
    assert "payment_amount: decimal(18,2)" in silver_text
    by_code, samples = cell_text(silver[4]), cell_text(silver[5])
    assert "malformed_json" in by_code and "amount_negative" in by_code
    assert "malformed_json" in samples and "negative paymentAmount" in samples
    assert "pay-a2" in cell_text(silver[6])  # the repeated transaction, kept out of silver

    summary, alerts, explained = cell_text(gold[3]), cell_text(gold[4]), cell_text(gold[5])
    assert "bronze = silver + quarantined + duplicates: ok" in summary and NO_RULES_WARNING not in summary
    assert "alert_id: string" in alerts and "rule_version: long" in alerts
    assert "window " in explained and "triggered by" in explained and '"ruleId":' in explained
    aggregate = re.search(r"\) = (\S+) \w+ limit", explained)
    recomputed = re.search(r"recomputed from the events below: (\S+)", explained)
    assert aggregate and recomputed and Decimal(aggregate[1]) == Decimal(recomputed[1]), explained
    assert "transaction_id" in explained and "<table" in explained  # the contributing events, as a table

    assert "Burst: 5 or more payments" in cell_text(explore[2]) and "rule 1, key payee-A|ben-1" in cell_text(explore[3])

    # 06 moves what 03 built to 8 shards; gold then runs with 8 (refused with 4) and the lakehouse is as it was.
    rescale = _run(kernel, root / "notebooks" / "06_rescale.ipynb", {"shards": "8"})
    assert "gold rescaled from 4 to 8 shards" in cell_text(rescale[2]) and '"shards": 8' in cell_text(rescale[3])
    again = _run(kernel, root / "notebooks" / "03_gold.ipynb", {"shards": "8"})
    assert cell_text(again[3]) == summary


@pytest.mark.jvm
@pytest.mark.notebook
def test_the_gold_notebook_warns_when_no_rule_is_active(spark, kernel, tmp_path):
    from rulewatch.spark.storage.lakehouse import Lakehouse
    from rulewatch.spark.layers.pipeline import ensure_all_tables

    root = _checkout(tmp_path)
    ensure_all_tables(spark, Lakehouse(str(root / "empty")))
    gold = _run(kernel, root / "notebooks" / "03_gold.ipynb", {"lakehouse": "empty"})  # relative: the root's empty/
    assert cell_text(gold[3]).startswith(NO_RULES_WARNING)
    # What a local job run repeats as its last lines (test_job_local: a job run whose task warns).
    assert notebook_warnings(nbformat.v4.new_notebook(cells=gold)) == (NO_RULES_WARNING,)
    assert "no alert to explain" in cell_text(gold[5])
    assert sorted(p.name for p in (root / "notebooks").iterdir()) == sorted(p.name for p in NOTEBOOKS)


@pytest.mark.slow
@pytest.mark.jvm
@pytest.mark.notebook
def test_the_live_notebook_runs_from_the_notebooks_folder_for_a_given_duration(kernel, tmp_path):
    root = _checkout(tmp_path)
    # The one value a user must give: without a duration the streams run until cancelled. No rules file (the default).
    live = _run(kernel, root / "notebooks" / "05_live.ipynb", {"duration": "15"})
    assert sorted(p.name for p in (root / "notebooks").iterdir()) == sorted(p.name for p in NOTEBOOKS)
    assert "ingest " in cell_text(live[3]) and "rows/s" in cell_text(live[3])  # a progress line a second
    # How far 15 s get depends on the machine; that no rule was evaluated does not.
    assert cell_text(live[-1]).startswith(NO_RULES_WARNING)
    assert (root / "lakehouse" / "bronze" / "transactions" / "_delta_log").is_dir()
