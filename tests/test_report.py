"""``rulewatch report``: the HTML file from a real fixture pipeline run, its charts, and the command line."""

from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET
from collections import Counter
from datetime import datetime, timedelta

import pytest

from rulewatch.cli.main import main
from rulewatch.spark.present.report import _ticks, build_report, horizontal_bars, hourly_buckets, lines, stacked_bars, time_lines
from rulewatch.spark.storage.lakehouse import Lakehouse

SVG = "{http://www.w3.org/2000/svg}"


def _svgs(html: str) -> list[ET.Element]:
    return [ET.fromstring(s) for s in re.findall(r"<svg .*?</svg>", html, flags=re.DOTALL)]


def _bar_heights(svg: ET.Element) -> list[float]:
    return [float(r.get("height")) for r in svg.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]


@pytest.fixture(scope="module")
def report(spark, fixture_run) -> str:
    return build_report(spark, fixture_run.lakehouse)


@pytest.mark.jvm
def test_report_answers_the_dashboard_questions_from_the_fixture_run(report, expected_alerts):
    for title in ("Alerts over time per rule", "Top alerting keys", "Ingest → alert latency (ms)", "Quarantine reasons",
                  "Reused transaction ids", "Rule effectiveness", "Rule change history", "Latest alerts"):  # fmt: skip
        assert f"<h2>{title}</h2>" in report
    assert "No transaction id was reused with other content." in report  # the fixtures' two repeats are redeliveries
    assert re.search(r'<div class="value">10</div><div class="label">Alerts</div>', report)
    charts = {svg.get("aria-label"): svg for svg in _svgs(report)}
    # One stacked segment per (hour, rule) with alerts, heights proportional to the counts.
    per_hour = charts["Alerts per rule per hour"]
    titles = sorted(t.text for t in per_hour.iter(f"{SVG}title"))
    assert titles == ["rule 1 · 2026-11-01 10:00: 2", "rule 1 · 2026-11-01 11:00: 1", "rule 2 · 2026-11-01 10:00: 2",
                      "rule 2 · 2026-11-01 11:00: 2", "rule 3 · 2026-11-01 12:00: 3"]  # fmt: skip
    assert "Hour of event time (UTC)" in ET.tostring(per_hour, encoding="unicode")
    heights = _bar_heights(per_hour)
    assert max(heights) / min(heights) == pytest.approx(3)
    top = Counter((a["rule_id"], a["group_key"]) for a in expected_alerts).most_common(1)[0]
    assert f"rule {top[0][0]} · {top[0][1]}" in ET.tostring(charts["Top alerting keys"], encoding="unicode")
    assert len(_bar_heights(charts["Quarantine reasons"])) == 0  # horizontal bars carry no hover titles
    assert "missing eventTime" in report and "More than 1000 paid from one payee" in report


@pytest.mark.jvm
def test_report_is_self_contained(report):
    # Nothing is fetched when the file is opened: no scripts, stylesheets or images from anywhere.
    assert not re.search(r"<(script|link|img|iframe)\b", report)
    assert not re.search(r"""(src|href)=["']?https?:""", report)


@pytest.mark.jvm
def test_tiles_count_quarantine_duplicates_late_events_and_show_freshness(spark, fixture_run, report):
    lakehouse = fixture_run.lakehouse

    def rows(path: str) -> int:
        return spark.read.format("delta").load(path).count()

    def tile(label: str) -> str:
        return re.search(rf'<div class="value">([^<]*)</div><div class="label">{re.escape(label)}</div>', report).group(1)

    assert tile("Lines ingested (bronze)") == f"{rows(lakehouse.bronze_transactions):,}"
    assert tile("Quarantined") == str(rows(lakehouse.silver_quarantine)) == "6"
    assert tile("Duplicates dropped") == str(rows(lakehouse.silver_duplicates))
    assert tile("Late events (not evaluated)") == str(rows(lakehouse.table("gold", "late_events")))
    newest = spark.read.format("delta").load(lakehouse.silver_transactions).agg({"event_time": "max"}).first()[0]
    assert tile("Newest event in silver") == f"{newest:%Y-%m-%d %H:%M:%S} UTC"
    last_gold = spark.read.format("delta").load(lakehouse.pipeline_metrics).where("layer = 'gold'").agg({"batch_end": "max"}).first()[0]
    assert tile("Last gold batch ended") == f"{last_gold:%Y-%m-%d %H:%M:%S} UTC"
    assert re.search(r'Newest event in silver</div><div class="note">[\d.,]+ (min|h|days) ago</div>', report)


@pytest.mark.jvm
def test_latency_is_in_ms_against_batch_end_time_with_percentiles_explained(report):
    latency = {svg.get("aria-label"): svg for svg in _svgs(report)}["Latency percentiles per gold batch (ms)"]
    texts = [t.text for t in latency.iter(f"{SVG}text")]
    assert "ms" in texts and any(re.fullmatch(r"Gold batch end(, \d{4}-\d\d-\d\d)? \(UTC\)", t or "") for t in texts)
    assert not any((t or "").startswith("batch ") for t in texts)
    for words in ("in milliseconds", "p50 is the median", "95% and 99%", "bronze ingest"):
        assert words in report


def test_hourly_buckets_keep_quiet_hours_and_turn_to_days_beyond_a_week():
    ten = datetime(2026, 11, 1, 10)
    hours, series = hourly_buckets({(ten, "rule 1"): 2, (ten + timedelta(hours=3), "rule 2"): 1})
    assert hours == [ten + timedelta(hours=i) for i in range(4)]
    assert series == {"rule 1": [2, 0, 0, 0], "rule 2": [0, 0, 0, 1]}
    days, series = hourly_buckets({(ten, "r"): 2, (ten + timedelta(hours=2), "r"): 1, (ten + timedelta(days=9), "r"): 4})
    assert days == [datetime(2026, 11, 1) + timedelta(days=i) for i in range(10)] and series == {"r": [3] + [0] * 8 + [4]}
    assert hourly_buckets({}) == ([], {})


def test_time_axis_places_points_by_time_and_names_the_date_with_year():
    start = datetime(2026, 11, 1, 23, 58)
    svg = ET.fromstring(time_lines([start, start + timedelta(minutes=1), start + timedelta(minutes=10)], {"p50": [1, 2, 3]}, "t", what="Batch end"))
    xs = [float(c.get("cx")) for c in svg.iter(f"{SVG}circle")]
    assert (xs[2] - xs[1]) == pytest.approx(9 * (xs[1] - xs[0]))  # a pause is as long as it lasted
    texts = [t.text for t in svg.iter(f"{SVG}text")]
    assert "Batch end (UTC)" in texts and "2026-11-02 00:00" in texts  # crosses midnight: dates on the ticks
    one_day = ET.fromstring(time_lines([start, start + timedelta(seconds=30)], {"p50": [1, 2]}, "t", what="Batch end"))
    assert "Batch end, 2026-11-01 (UTC)" in [t.text for t in one_day.iter(f"{SVG}text")]


def test_evenly_spaced_lines_keep_gaps_and_label_their_slots():
    svg = ET.fromstring(lines(["a", "b", "c"], {"x": [1, None, 3], "y": [2, 2, 2]}, "t"))
    assert [t.text for t in svg.iter(f"{SVG}text") if t.text in ("a", "b", "c")] == ["a", "b", "c"]
    xs = {c.get("cx") for c in svg.iter(f"{SVG}circle")}
    assert len(xs) == 3 and len(list(svg.iter(f"{SVG}circle"))) == 5  # series x has no point at "b"


def test_ticks_are_round_and_cover_the_maximum():
    assert _ticks(4) == [0, 1, 2, 3, 4]
    assert _ticks(1100.5) == [0, 500, 1000, 1500]
    assert _ticks(0) == [0, 1]


def test_chart_geometry_is_proportional():
    svg = ET.fromstring(stacked_bars(["a", "b"], {"x": [1, 3], "y": [2, 0]}, "t"))
    one, two, three = _bar_heights(svg)  # drawn per category, then per series; a zero draws nothing
    assert two == pytest.approx(2 * one, abs=0.2) and three == pytest.approx(3 * one, abs=0.2)  # drawn to 0.1 px
    bars = ET.fromstring(horizontal_bars(["<a&b>", "c"], [4, 1], "t"))
    widths = [float(r.get("width")) for r in bars.iter(f"{SVG}rect")]
    assert widths[0] == pytest.approx(4 * widths[1], rel=1e-3)
    assert [t.text for t in bars.iter(f"{SVG}text")][0] == "<a&b>"  # escaped in the markup, intact when parsed
    long = ET.fromstring(horizontal_bars(["x" * 200], [1], "t"))
    label = next(long.iter(f"{SVG}text"))
    assert label.text.endswith("…") and len(label.text) < 70 and label.find(f"{SVG}title").text == "x" * 200


def _cli(argv: list[str]) -> int:
    return main(argv)


def test_cli_names_a_lakehouse_without_gold_tables(tmp_path, capsys):
    assert _cli(["report", "--lakehouse", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "no gold/alerts table under" in err and "rulewatch run --lakehouse" in err


@pytest.mark.jvm
def test_cli_writes_the_report_masked_as_asked(spark, fixture_run, expected_alerts, tmp_path, capsys):
    # Masked here: the unmasked page is the `report` fixture's, so one build checks the command and --mask.
    out = tmp_path / "r.html"
    assert _cli(["report", "--lakehouse", fixture_run.lakehouse.root, "--mask", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"rulewatch report: wrote {out.resolve()}\n"  # the result alone; progress on stderr
    assert captured.err == (
        f"rulewatch report: starting Spark ...\nrulewatch report: reading the gold, silver and rules tables of {fixture_run.lakehouse.root} ...\n"
    )
    html = out.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>")
    for key in {a["group_key"] for a in expected_alerts}:
        assert key not in html
    assert "account identifiers masked" in html and re.search(r"#[0-9a-f]{10}", html)


@pytest.mark.jvm
def test_a_reused_transaction_id_is_listed_with_its_file(spark, fixture_run, tmp_path):
    root = tmp_path / "lakehouse"
    shutil.copytree(fixture_run.lakehouse.root, root)  # the shared run stays as it is
    lakehouse = Lakehouse(str(root))
    spark.sql(
        f"INSERT INTO delta.`{lakehouse.silver_duplicates}` VALUES "
        "('pay-a1', '{\"transactionId\": \"pay-a1\", \"paymentAmount\": 1}', 'file:/landing/reused.jsonl', "
        "TIMESTAMP'2026-11-02 09:00:00', 7, true), ('pay-a2', '{}', 'file:/landing/again.jsonl', TIMESTAMP'2026-11-02 09:00:00', 7, false)"
    )
    section = build_report(spark, lakehouse).split("<h2>Reused transaction ids</h2>")[1].split("</section>")[0]
    assert section.startswith('<p class="caption">1 line(s) reused a transaction id')  # the redelivery is not counted
    assert re.findall(r"<td>(.*?)</td>", section) == ["pay-a1", "2026-11-02 09:00:00", "file:/landing/reused.jsonl", "7"]
