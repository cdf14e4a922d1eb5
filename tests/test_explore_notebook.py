"""The explore notebook executed for real in the suite's kernel against the fixture pipeline run."""

from __future__ import annotations

import nbformat
import pytest

from conftest import ROOT, cell_text

NOTEBOOK = ROOT / "notebooks" / "04_explore.ipynb"


@pytest.mark.jvm
@pytest.mark.notebook
def test_explore_picks_the_top_key_and_shows_its_alerts_window_and_history(fixture_run, notebook_kernel):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    widgets = {"lakehouse": fixture_run.lakehouse.root, "rule_id": "2", "key": "", "show_identifiers": "true"}
    notebook_kernel.run(nb, widgets, timeout=600, cwd=ROOT)

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    overview, alerts, window, history = (cell_text(c) for c in code[2:])  # after the import and parameter cells
    assert "Burst: 5 or more payments" in overview and "share_near_limit" in overview
    # Rule 2's only alerting key is payee-C, with four alerts on these transactions.
    assert "rule 2, key payee-C" in alerts
    assert all(txn in alerts for txn in ("pay-c4b", "pay-c5", "pay-c6", "pay-c7"))
    assert "<svg" in window and "Rule 2, key payee-C: window aggregate in event-time order" in window
    assert window.count('r="3"') == 4 * 2 + 1 * 2  # (aggregate, limit) at four alerts and one batch end
    assert "inserted" in history and '"ruleId": 2' in history
