"""``rulewatch report``: the HTML file from a real fixture pipeline run, its charts, and the command line."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections import Counter

import pytest

from rulewatch.cli import main
from rulewatch.report import _ticks, build_report, horizontal_bars, stacked_bars

SVG = "{http://www.w3.org/2000/svg}"


def _svgs(html: str) -> list[ET.Element]:
    return [ET.fromstring(s) for s in re.findall(r"<svg .*?</svg>", html, flags=re.DOTALL)]


def _bar_heights(svg: ET.Element) -> list[float]:
    return [float(r.get("height")) for r in svg.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]


@pytest.fixture(scope="module")
def report(spark, fixture_run) -> str:
    return build_report(spark, fixture_run.lakehouse)


@pytest.mark.spark
def test_report_answers_the_dashboard_questions_from_the_fixture_run(report, expected_alerts):
    for title in ("Alerts over time per rule", "Top alerting keys", "Ingest → alert latency", "Quarantine reasons",
                  "Rule effectiveness", "Rule change history", "Latest alerts"):  # fmt: skip
        assert f"<h2>{title}</h2>" in report
    assert re.search(r'<div class="value">10</div><div class="label">Alerts</div>', report)
    charts = {svg.get("aria-label"): svg for svg in _svgs(report)}
    # One stacked segment per (hour, rule) with alerts, heights proportional to the counts.
    per_hour = charts["Alerts per rule per hour"]
    titles = sorted(t.text for t in per_hour.iter(f"{SVG}title"))
    assert titles == ["rule 1 · 11-01 10:00: 2", "rule 1 · 11-01 11:00: 1", "rule 2 · 11-01 10:00: 2",
                      "rule 2 · 11-01 11:00: 2", "rule 3 · 11-01 12:00: 3"]  # fmt: skip
    heights = _bar_heights(per_hour)
    assert max(heights) / min(heights) == pytest.approx(3)
    top = Counter((a["rule_id"], a["group_key"]) for a in expected_alerts).most_common(1)[0]
    assert f"rule {top[0][0]} · {top[0][1]}" in ET.tostring(charts["Top alerting keys"], encoding="unicode")
    assert len(_bar_heights(charts["Quarantine reasons"])) == 0  # horizontal bars carry no hover titles
    assert "missing eventTime" in report and "More than 1000 paid from one payee" in report


@pytest.mark.spark
def test_report_is_self_contained(report):
    # Nothing is fetched when the file is opened: no scripts, stylesheets or images from anywhere.
    assert not re.search(r"<(script|link|img|iframe)\b", report)
    assert not re.search(r"""(src|href)=["']?https?:""", report)


@pytest.mark.spark
def test_masked_report_hides_account_identifiers(spark, fixture_run, expected_alerts):
    html = build_report(spark, fixture_run.lakehouse, mask=True)
    for key in {a["group_key"] for a in expected_alerts}:
        assert key not in html
    assert "account identifiers masked" in html and re.search(r"#[0-9a-f]{10}", html)


def test_ticks_are_round_and_cover_the_maximum():
    assert _ticks(4) == [0, 1, 2, 3, 4]
    assert _ticks(1100.5) == [0, 500, 1000, 1500]
    assert _ticks(0) == [0, 1]


def test_chart_geometry_is_proportional():
    svg = ET.fromstring(stacked_bars(["a", "b"], {"x": [1, 3], "y": [2, 0]}, "t"))
    one, two, three = _bar_heights(svg)  # drawn per category, then per series; a zero draws nothing
    assert two == pytest.approx(2 * one) and three == pytest.approx(3 * one)
    bars = ET.fromstring(horizontal_bars(["<a&b>", "c"], [4, 1], "t"))
    widths = [float(r.get("width")) for r in bars.iter(f"{SVG}rect")]
    assert widths[0] == pytest.approx(4 * widths[1], rel=1e-3)
    assert [t.text for t in bars.iter(f"{SVG}text")][0] == "<a&b>"  # escaped in the markup, intact when parsed


def _cli(argv: list[str]) -> int:
    return main(argv)


def test_cli_names_a_lakehouse_without_gold_tables(tmp_path, capsys):
    assert _cli(["report", "--lakehouse", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "no gold/alerts table under" in err and "rulewatch run --lakehouse" in err


@pytest.mark.spark
def test_cli_writes_the_report(spark, fixture_run, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert _cli(["report", "--lakehouse", fixture_run.lakehouse.root, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"rulewatch report: wrote {out.resolve()}\n"  # the result alone; progress on stderr
    assert captured.err == (
        f"rulewatch report: starting Spark ...\nrulewatch report: reading the gold, silver and rules tables of {fixture_run.lakehouse.root} ...\n"
    )
    assert out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
