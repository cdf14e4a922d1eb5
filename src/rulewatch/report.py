"""``rulewatch report``: the dashboard's questions answered in one self-contained HTML file.

The numbers come from the same views the Lakeview dashboard reads (:mod:`rulewatch.views`); the
charts are inline SVG drawn here, so the file opens offline, in any browser, with nothing to install.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from html import escape
from pathlib import Path
from typing import Any, Sequence

from pyspark.sql import Row, SparkSession

from rulewatch.lakehouse import Lakehouse
from rulewatch.views import register_views

PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563")
_FONT = "font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif"


# ---- charts ----------------------------------------------------------------------------------------


def _ticks(value: float) -> list[float]:
    """Gridline values from 0 to at least ``value`` in steps of 1, 2 or 5 x 10^n (about four of them)."""
    target = max(value, 1e-9) / 4
    magnitude = 10.0 ** math.floor(math.log10(target))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= target)
    if value >= 1 and step < 1:  # counts: never a gridline between whole numbers
        step = 1.0
    return [step * i for i in range(math.ceil(value / step - 1e-9) + 1)] if value > 0 else [0.0, 1.0]


def _number(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() or abs(value) >= 100 else f"{value:,.2f}"


def _legend(names: Sequence[str], width: int) -> str:
    items, x = [], 0
    for i, name in enumerate(names):
        items.append(
            f'<rect x="{x}" y="0" width="12" height="12" rx="2" fill="{PALETTE[i % len(PALETTE)]}"/>'
            f'<text x="{x + 17}" y="10.5" font-size="12">{escape(name)}</text>'
        )
        x += 30 + 7 * len(name)
    return f'<g transform="translate({max(0, width - x)},4)">{"".join(items)}</g>'


def _frame(width: int, height: int, body: str, label: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{escape(label)}" viewBox="0 0 {width} {height}" '
        f'width="100%" style="max-width:{width}px;{_FONT};fill:#1f2937">{body}</svg>'
    )


def _y_axis(ticks: list[float], left: int, plot_top: int, plot_h: int, plot_w: int) -> str:
    lines = []
    for value in ticks:
        y = plot_top + plot_h - plot_h * value / ticks[-1]
        lines.append(
            f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e7eb"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end" fill="#6b7280">{_number(value)}</text>'
        )
    return "".join(lines)


def stacked_bars(categories: Sequence[str], series: dict[str, Sequence[float]], label: str, width: int = 980) -> str:
    """Vertical bars per category, one stacked segment per series (e.g. alerts per hour per rule)."""
    height, left, top_pad, bottom = 260, 48, 28, 46
    plot_w, plot_h = width - left - 10, height - top_pad - bottom
    totals = [sum(values[i] or 0 for values in series.values()) for i in range(len(categories))]
    ticks = _ticks(max(totals, default=0))
    top = ticks[-1]
    slot = plot_w / max(len(categories), 1)
    bar_w = min(48.0, slot * 0.7)
    parts = [_y_axis(ticks, left, top_pad, plot_h, plot_w), _legend(list(series), width)]
    every = max(1, len(categories) // 12)  # keep category labels from overlapping
    for i, category in enumerate(categories):
        x = left + slot * i + (slot - bar_w) / 2
        base = top_pad + plot_h
        for s, (name, values) in enumerate(series.items()):
            value = values[i] or 0
            h = plot_h * value / top
            if h:
                parts.append(
                    f'<rect x="{x:.1f}" y="{base - h:.1f}" width="{bar_w:.1f}" height="{h:.1f}" fill="{PALETTE[s % len(PALETTE)]}">'
                    f"<title>{escape(name)} · {escape(category)}: {_number(value)}</title></rect>"
                )
            base -= h
        if totals[i]:
            parts.append(f'<text x="{x + bar_w / 2:.1f}" y="{base - 4:.1f}" font-size="11" text-anchor="middle">{_number(totals[i])}</text>')
        if i % every == 0:
            parts.append(
                f'<text x="{x + bar_w / 2:.1f}" y="{top_pad + plot_h + 16}" font-size="11" text-anchor="middle" fill="#374151">'
                f"{escape(category)}</text>"
            )
    return _frame(width, height, "".join(parts), label)


def horizontal_bars(labels: Sequence[str], values: Sequence[float], label: str, width: int = 980) -> str:
    """One bar per label, longest first as given (top keys, quarantine reasons)."""
    row, label_w = 26, min(420, 12 + 7 * max((len(x) for x in labels), default=0))
    height = 10 + row * len(labels)
    plot_w = width - label_w - 60
    top = max(values, default=0) or 1
    parts = []
    for i, (text, value) in enumerate(zip(labels, values)):
        y = 6 + row * i
        w = plot_w * value / top
        parts.append(
            f'<text x="{label_w - 8}" y="{y + 15}" font-size="12" text-anchor="end">{escape(text)}</text>'
            f'<rect x="{label_w}" y="{y + 3}" width="{w:.1f}" height="{row - 8}" rx="2" fill="{PALETTE[0]}"/>'
            f'<text x="{label_w + w + 6:.1f}" y="{y + 15}" font-size="12">{_number(value)}</text>'
        )
    return _frame(width, height, "".join(parts), label)


def lines(xs: Sequence[str], series: dict[str, Sequence[float | None]], label: str, width: int = 980) -> str:
    """One line per series over the same x positions (latency percentiles per batch); gaps where a value is missing."""
    height, left, top_pad, bottom = 260, 56, 28, 46
    plot_w, plot_h = width - left - 16, height - top_pad - bottom
    ticks = _ticks(max((v for values in series.values() for v in values if v is not None), default=0))
    top = ticks[-1]
    step = plot_w / max(len(xs), 1)
    x0 = left + step / 2  # each x in the middle of its slot, so a lone batch is not drawn on the axis
    parts = [_y_axis(ticks, left, top_pad, plot_h, plot_w), _legend(list(series), width)]
    every = max(1, len(xs) // 10)
    for i, x in enumerate(xs):
        if i % every == 0:
            parts.append(
                f'<text x="{x0 + step * i:.1f}" y="{top_pad + plot_h + 16}" font-size="11" text-anchor="middle" fill="#374151">{escape(x)}</text>'
            )
    for s, (name, values) in enumerate(series.items()):
        colour = PALETTE[s % len(PALETTE)]
        points = [(x0 + step * i, top_pad + plot_h - plot_h * v / top) for i, v in enumerate(values) if v is not None]
        if len(points) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        parts.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>' for x, y in points)
    return _frame(width, height, "".join(parts), label)


# ---- data and page ---------------------------------------------------------------------------------


def _query(spark: SparkSession, sql: str) -> list[Row]:
    return spark.sql(sql).collect()


def _cell(value: Any) -> str:
    if value is None:
        return '<span class="none">–</span>'
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, float):
        return f"{value:.2%}" if 0 <= value <= 1 else _number(value)
    if hasattr(value, "normalize"):  # Decimal: drop the trailing zeros of decimal(38, 10)
        return f"{value.normalize():f}"
    if isinstance(value, (list, dict)):
        return escape(", ".join(value) if isinstance(value, list) else ", ".join(f"{k}={v}" for k, v in value.items()))
    return escape(str(value))


def table(rows: Sequence[Row], columns: dict[str, str], empty: str) -> str:
    """An HTML table of ``rows``; ``columns`` maps column name -> heading."""
    if not rows:
        return f'<p class="empty">{escape(empty)}</p>'
    head = "".join(f"<th>{escape(title)}</th>" for title in columns.values())
    body = "".join("<tr>" + "".join(f"<td>{_cell(row[c])}</td>" for c in columns) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


@dataclass
class Section:
    title: str
    caption: str
    body: str


def _alerts_over_time(spark: SparkSession) -> Section:
    rows = _query(spark, "SELECT hour, rule, alerts FROM alerts_per_rule_hour ORDER BY hour, rule_id")
    hours = sorted({r.hour for r in rows})
    rules = list(dict.fromkeys(r.rule for r in rows))
    counts = {(r.hour, r.rule): r.alerts for r in rows}
    series = {rule: [counts.get((h, rule), 0) for h in hours] for rule in rules}
    body = (
        stacked_bars([h.strftime("%m-%d %H:00") for h in hours], series, "Alerts per rule per hour")
        if rows else '<p class="empty">No alerts.</p>'
    )  # fmt: skip
    return Section("Alerts over time per rule", "Alerts per hour of event time, stacked by rule.", body)


def _top_keys(spark: SparkSession) -> Section:
    rows = _query(spark, "SELECT * FROM top_alerting_keys WHERE key_rank <= 15 ORDER BY key_rank, rule_id, group_key")
    chart = horizontal_bars([f"rule {r.rule_id} · {r.group_key}" for r in rows], [r.alerts for r in rows], "Top alerting keys") if rows else ""
    columns = {"key_rank": "#", "rule_id": "Rule", "group_key": "Key", "alerts": "Alerts", "first_alert": "First alert",
               "last_alert": "Last alert", "max_aggregate": "Peak aggregate", "limit": "Limit"}  # fmt: skip
    return Section("Top alerting keys", "Keys with the most alerts, per rule.", chart + table(rows, columns, "No alerts."))


def _latency(spark: SparkSession) -> Section:
    rows = _query(spark, "SELECT * FROM latency_trend WHERE alerts > 0 ORDER BY batch_id")
    if not rows:
        return Section("Ingest → alert latency", "", '<p class="empty">No gold batch with alerts has pipeline metrics yet.</p>')
    series = {p: [getattr(r, f"latency_{p}_ms") for r in rows] for p in ("p50", "p95", "p99")}
    chart = lines([f"batch {r.batch_id}" for r in rows], series, "Latency percentiles per gold batch (ms)")
    columns = {"batch_id": "Batch", "batch_end": "Batch end", "alerts": "Alerts", "latency_p50_ms": "p50 ms",
               "latency_p95_ms": "p95 ms", "latency_p99_ms": "p99 ms", "latency_max_ms": "max ms", "processing_ms": "Batch ms"}  # fmt: skip
    caption = "From a transaction's bronze ingest time to the commit of its alert, per gold micro-batch with alerts."
    return Section("Ingest → alert latency", caption, chart + table(rows, columns, ""))


def _quarantine(spark: SparkSession) -> Section:
    rows = _query(spark, "SELECT reason_code, lines, example FROM quarantine_reasons ORDER BY lines DESC, reason_code")
    labels = [f"{r.reason_code} (e.g. {r.example})" for r in rows]
    body = horizontal_bars(labels, [r.lines for r in rows], "Quarantine reasons") if rows else '<p class="empty">Nothing quarantined.</p>'
    return Section("Quarantine reasons", "Lines that failed validation, by reason code with one example; a line failing several checks counts under each.", body)


def _effectiveness(spark: SparkSession) -> Section:
    rows = _query(spark, "SELECT * FROM rule_effectiveness ORDER BY rule_id")
    columns = {"rule_id": "Rule", "rule_state": "State", "rule_description": "Description", "alerts": "Alerts",
               "alerts_per_1k_events": "Alerts / 1k events", "keys_evaluated": "Keys evaluated", "keys_alerted": "Keys alerted",
               "keys_near_limit": "Near limit", "share_near_limit": "Share near limit"}  # fmt: skip
    caption = "Near limit: a key whose peak reached 80% of the limit without alerting (rules with an upper limit)."
    return Section("Rule effectiveness", caption, table(rows, columns, "No rules."))


def _rule_changes(spark: SparkSession) -> Section:
    rows = _query(spark, "SELECT * FROM rule_changes ORDER BY commit_version DESC, rule_id LIMIT 50")
    columns = {"commit_timestamp": "When", "rule_id": "Rule", "change": "Change", "commit_version": "Version",
               "updated_by": "By", "rule_description": "Description"}  # fmt: skip
    return Section("Rule change history", "The 50 newest changes of config/rules.", table(rows, columns, "No rule history yet."))


def _latest_alerts(spark: SparkSession) -> Section:
    rows = _query(spark, "SELECT * FROM alerts_masked ORDER BY event_time DESC, alert_id LIMIT 50")
    columns = {"event_time": "Event time", "rule_id": "Rule", "group_key": "Key", "transaction_id": "Transaction",
               "aggregator": "Aggregator", "aggregate_value": "Aggregate", "operator": "Operator", "limit": "Limit",
               "window_start": "Window start", "event_count": "Events", "latency_ms": "Latency ms"}  # fmt: skip
    return Section("Latest alerts", "The 50 newest alerts by event time.", table(rows, columns, "No alerts."))


def _tiles(spark: SparkSession) -> str:
    (totals,) = _query(
        spark,
        "SELECT (SELECT count(*) FROM alerts_masked) AS alerts, (SELECT count(DISTINCT rule_id) FROM alerts_masked) AS rules,"
        " (SELECT count(*) FROM top_alerting_keys) AS keys, (SELECT count_if(rule_state = 'ACTIVE') FROM rule_effectiveness) AS active,"
        " (SELECT max(silver_events) FROM rule_effectiveness) AS events",
    )
    tiles = [("Alerts", totals.alerts), ("Rules alerting", totals.rules), ("Active rules", totals.active),
             ("Keys alerted", totals.keys), ("Silver events", totals.events or 0)]  # fmt: skip
    return "".join(f'<div class="tile"><div class="value">{_number(v)}</div><div class="label">{escape(t)}</div></div>' for t, v in tiles)


CSS = """
body{margin:0;background:#f3f4f6;color:#111827;%s}
header{background:#111827;color:#f9fafb;padding:20px 32px}
header h1{margin:0;font-size:22px} header p{margin:4px 0 0;color:#9ca3af;font-size:13px}
main{max-width:1100px;margin:0 auto;padding:20px 32px 40px}
.tiles{display:flex;gap:12px;margin-bottom:20px} .tile{flex:1;background:#fff;border-radius:8px;padding:14px 16px;box-shadow:0 1px 2px #0001}
.tile .value{font-size:26px;font-weight:600} .tile .label{font-size:12px;color:#6b7280;margin-top:2px}
section{background:#fff;border-radius:8px;padding:16px 20px;margin-bottom:18px;box-shadow:0 1px 2px #0001}
section h2{margin:0 0 2px;font-size:17px} section p.caption{margin:0 0 12px;color:#6b7280;font-size:13px}
table{border-collapse:collapse;width:100%%;font-size:12.5px;margin-top:10px}
th{text-align:left;color:#374151;border-bottom:2px solid #e5e7eb;padding:6px 8px;white-space:nowrap}
td{border-bottom:1px solid #f3f4f6;padding:5px 8px;vertical-align:top} tr:hover td{background:#f9fafb}
.none,.empty{color:#9ca3af} p.empty{font-size:13px}
""" % _FONT


def build_report(spark: SparkSession, lakehouse: Lakehouse, mask: bool = False) -> str:
    """The report as one HTML document; ``mask`` pseudonymises account identifiers as the dashboard does for non-members."""
    register_views(spark, lakehouse, viewer_in_pii_group=not mask)
    sections = [_alerts_over_time(spark), _top_keys(spark), _latency(spark), _quarantine(spark),
                _effectiveness(spark), _rule_changes(spark), _latest_alerts(spark)]  # fmt: skip
    rendered = "".join(
        f"<section><h2>{escape(s.title)}</h2><p class=\"caption\">{escape(s.caption)}</p>{s.body}</section>" for s in sections
    )
    made = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    masking = "account identifiers masked" if mask else "account identifiers shown"
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>rulewatch report</title><style>{CSS}</style></head>'
        f"<body><header><h1>rulewatch report</h1><p>{escape(lakehouse.root)} · {made} · {masking}</p></header>"
        f'<main><div class="tiles">{_tiles(spark)}</div>{rendered}</main></body></html>'
    )


def _cmd_report(args: argparse.Namespace) -> int:
    from rulewatch.arguments import progress
    from rulewatch.session import get_spark

    lakehouse = Lakehouse(args.lakehouse)
    if not Path(lakehouse.alerts, "_delta_log").is_dir():
        print(
            f"rulewatch report: no gold/alerts table under {lakehouse.root}; "
            f"run `rulewatch run --lakehouse {args.lakehouse} --landing ...` first",
            file=sys.stderr,
        )
        return 2
    progress("rulewatch report", "starting Spark")
    spark = get_spark("rulewatch-report")
    progress("rulewatch report", f"reading the gold, silver and rules tables of {lakehouse.root}")
    html = build_report(spark, lakehouse, mask=args.mask)
    out = Path(args.out)
    out.write_text(html, encoding="utf-8")
    print(f"rulewatch report: wrote {out.resolve()}")
    return 0
