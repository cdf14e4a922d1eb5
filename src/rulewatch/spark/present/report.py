"""``rulewatch report``: the dashboard's questions answered in one self-contained HTML file.

The numbers come from the same views the Lakeview dashboard reads (:mod:`rulewatch.spark.present.views`); the
charts are inline SVG drawn here, so the file opens offline, in any browser, with nothing to install
and no script to run (docs/dashboards.md says why not a charting library). Times are UTC throughout.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from html import escape
from typing import Any, Sequence

from pyspark.sql import Row, SparkSession

from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.present.views import register_views

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


def _label_every(labels: Sequence[str], room: float) -> int:
    """Label every n-th slot so that labels of this length (about 6.5 px a character at 11 px) never overlap."""
    widest = 6.5 * max((len(x) for x in labels), default=0) + 12
    needed = math.ceil(widest / max(room, 1e-9))
    # Steps that divide a day of hours (and read well for days), so labels fall on round hours.
    return next((n for n in (1, 2, 3, 4, 6, 12, 24, 48, 72, 168) if n >= needed), needed)


def _x_title(text: str, left: int, plot_w: int, y: int) -> str:
    return f'<text x="{left + plot_w / 2:.1f}" y="{y}" font-size="12" text-anchor="middle" fill="#374151">{escape(text)}</text>' if text else ""


def _y_title(text: str, plot_top: int, plot_h: int) -> str:
    if not text:
        return ""
    y = plot_top + plot_h / 2
    return f'<text x="12" y="{y:.1f}" font-size="12" text-anchor="middle" fill="#374151" transform="rotate(-90 12 {y:.1f})">{escape(text)}</text>'


def stacked_bars(categories: Sequence[str], series: dict[str, Sequence[float]], label: str, width: int = 980, x_title: str = "") -> str:
    """Vertical bars per category, one stacked segment per series (e.g. alerts per hour per rule).

    Every category gets its slot, zeros included: callers pass a continuous time range so that quiet
    periods show as gaps instead of vanishing."""
    height, left, top_pad, bottom = 280, 48, 28, 62
    plot_w, plot_h = width - left - 10, height - top_pad - bottom
    totals = [sum(values[i] or 0 for values in series.values()) for i in range(len(categories))]
    ticks = _ticks(max(totals, default=0))
    top = ticks[-1]
    slot = plot_w / max(len(categories), 1)
    bar_w = min(48.0, slot * 0.7)
    parts = [_y_axis(ticks, left, top_pad, plot_h, plot_w), _legend(list(series), width), _x_title(x_title, left, plot_w, height - 8)]
    every = _label_every(categories, slot)
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
        if totals[i] and slot >= 14:  # a count above each bar, while bars are wide enough to carry one
            parts.append(f'<text x="{x + bar_w / 2:.1f}" y="{base - 4:.1f}" font-size="11" text-anchor="middle">{_number(totals[i])}</text>')
        if i % every == 0:
            parts.append(
                f'<line x1="{x + bar_w / 2:.1f}" x2="{x + bar_w / 2:.1f}" y1="{top_pad + plot_h}" y2="{top_pad + plot_h + 4}" stroke="#9ca3af"/>'
                f'<text x="{x + bar_w / 2:.1f}" y="{top_pad + plot_h + 17}" font-size="11" text-anchor="middle" fill="#374151">'
                f"{escape(category)}</text>"
            )
    parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{top_pad + plot_h}" y2="{top_pad + plot_h}" stroke="#9ca3af"/>')
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
        # Labels longer than the label column are cut with an ellipsis (the whole text on hover) rather than
        # running off the chart's left edge.
        fits = max(4, int((label_w - 12) / 7))
        shown = text if len(text) <= fits else text[: fits - 1] + "…"
        parts.append(
            f'<text x="{label_w - 8}" y="{y + 15}" font-size="12" text-anchor="end">{escape(shown)}<title>{escape(text)}</title></text>'
            f'<rect x="{label_w}" y="{y + 3}" width="{w:.1f}" height="{row - 8}" rx="2" fill="{PALETTE[0]}"/>'
            f'<text x="{label_w + w + 6:.1f}" y="{y + 15}" font-size="12">{_number(value)}</text>'
        )
    return _frame(width, height, "".join(parts), label)


def _line_chart(
    positions: Sequence[float], x_labels: Sequence[tuple[float, str]], series: dict[str, Sequence[float | None]],
    label: str, width: int, x_title: str, y_title: str,
) -> str:
    """Lines over x positions given as shares (0-1) of the plot width; gaps where a value is missing."""
    height, left, top_pad, bottom = 280, 80, 28, 62
    plot_w, plot_h = width - left - 24, height - top_pad - bottom
    ticks = _ticks(max((v for values in series.values() for v in values if v is not None), default=0))
    top = ticks[-1]
    parts = [_y_axis(ticks, left, top_pad, plot_h, plot_w), _legend(list(series), width),
             _x_title(x_title, left, plot_w, height - 8), _y_title(y_title, top_pad, plot_h)]  # fmt: skip
    for share, text in x_labels:
        x = left + plot_w * share
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top_pad + plot_h}" y2="{top_pad + plot_h + 4}" stroke="#9ca3af"/>'
            f'<text x="{x:.1f}" y="{top_pad + plot_h + 17}" font-size="11" text-anchor="middle" fill="#374151">{escape(text)}</text>'
        )
    parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{top_pad + plot_h}" y2="{top_pad + plot_h}" stroke="#9ca3af"/>')
    for s, (name, values) in enumerate(series.items()):
        colour = PALETTE[s % len(PALETTE)]
        points = [(left + plot_w * p, top_pad + plot_h - plot_h * v / top) for p, v in zip(positions, values) if v is not None]
        if len(points) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        parts.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"><title>{escape(name)}: {_number(v)}</title></circle>'
                     for (x, y), v in zip(points, [v for v in values if v is not None]))  # fmt: skip
    return _frame(width, height, "".join(parts), label)


def lines(xs: Sequence[str], series: dict[str, Sequence[float | None]], label: str, width: int = 980, x_title: str = "", y_title: str = "") -> str:
    """One line per series over evenly spaced x positions, in the order given (e.g. a key's aggregate per event)."""
    step = 1 / max(len(xs), 1)
    positions = [step * (i + 0.5) for i in range(len(xs))]  # each x mid-slot, so a lone point is not drawn on the axis
    every = _label_every(xs, (width - 104) * step)  # the plot width of _line_chart
    return _line_chart(positions, [(positions[i], xs[i]) for i in range(0, len(xs), every)], series, label, width, x_title, y_title)


# Time-axis steps in seconds: the first that leaves at most about six gridlines is used.
_TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 2 * 3600, 3 * 3600, 6 * 3600, 12 * 3600,
               86400, 2 * 86400, 7 * 86400, 14 * 86400, 28 * 86400, 91 * 86400, 365 * 86400)  # fmt: skip


def time_lines(times: Sequence[datetime], series: dict[str, Sequence[float | None]], label: str, width: int = 980, y_title: str = "", what: str = "") -> str:
    """Lines against a real time axis (UTC): a point's x is proportional to its time, so a pause between
    points shows as a long segment, and tick labels say the date (with year) where it is not in the title."""
    epochs = [t.replace(tzinfo=timezone.utc).timestamp() for t in times]
    first, last = min(epochs), max(epochs)
    span = last - first
    if not span:  # one instant: in the middle, labelled in full
        moment = _utc(times[0])
        return _line_chart([0.5] * len(times), [(0.5, f"{moment:%Y-%m-%d %H:%M:%S}")], series, label, width, f"{what} (UTC)", y_title)
    step = next((s for s in _TIME_STEPS if span / s <= 6), _TIME_STEPS[-1])
    tick = math.ceil(first / step) * step
    same_day = _utc(first).date() == _utc(last).date()
    fmt = ("%H:%M:%S" if step < 60 else "%H:%M") if same_day else ("%Y-%m-%d" if step >= 86400 else "%Y-%m-%d %H:%M")
    x_labels = []
    while tick <= last:
        x_labels.append(((tick - first) / span, _utc(tick).strftime(fmt)))
        tick += step
    title = f"{what}, {_utc(first):%Y-%m-%d} (UTC)" if same_day else f"{what} (UTC)"
    return _line_chart([(e - first) / span for e in epochs], x_labels, series, label, width, title, y_title)


def _utc(moment: datetime | float) -> datetime:
    """A naive Spark timestamp (the session's time zone is UTC) or an epoch as an aware UTC datetime."""
    if isinstance(moment, datetime):
        return moment.replace(tzinfo=timezone.utc)
    return datetime.fromtimestamp(moment, timezone.utc)


def hourly_buckets(counts: dict[tuple[datetime, str], int]) -> tuple[list[datetime], dict[str, list[int]]]:
    """Every hour from the first to the last with alerts, zero where there were none, per series.

    Beyond a week of hours the buckets become days (bars would be thinner than a pixel)."""
    if not counts:
        return [], {}
    hours = [h for h, _ in counts]
    step, start = timedelta(hours=1), min(hours)
    if max(hours) - start > timedelta(days=7):
        step, start = timedelta(days=1), start.replace(hour=0)
        counts_by = Counter()
        for (h, name), n in counts.items():
            counts_by[(h.replace(hour=0), name)] += n
        counts, hours = dict(counts_by), [h.replace(hour=0) for h in hours]
    buckets = [start + step * i for i in range(int((max(hours) - start) / step) + 1)]
    names = list(dict.fromkeys(name for _, name in counts))
    return buckets, {name: [counts.get((b, name), 0) for b in buckets] for name in names}


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
    buckets, series = hourly_buckets({(r.hour, r.rule): r.alerts for r in rows})
    daily = len(buckets) > 1 and buckets[1] - buckets[0] == timedelta(days=1)
    unit, fmt = ("Day", "%Y-%m-%d") if daily else ("Hour", "%Y-%m-%d %H:00")
    body = (
        stacked_bars([b.strftime(fmt) for b in buckets], series, f"Alerts per rule per {unit.lower()}", x_title=f"{unit} of event time (UTC)")
        if rows else '<p class="empty">No alerts.</p>'
    )  # fmt: skip
    caption = (f"Alerts per {unit.lower()} of event time (UTC), stacked by rule. Every {unit.lower()} from the first alert to the "
               f"last has its slot, so quiet {unit.lower()}s show as gaps.")  # fmt: skip
    return Section("Alerts over time per rule", caption, body)


def _top_keys(spark: SparkSession) -> Section:
    rows = _query(spark, "SELECT * FROM top_alerting_keys WHERE key_rank <= 15 ORDER BY key_rank, rule_id, group_key")
    chart = horizontal_bars([f"rule {r.rule_id} · {r.group_key}" for r in rows], [r.alerts for r in rows], "Top alerting keys") if rows else ""
    columns = {"key_rank": "#", "rule_id": "Rule", "group_key": "Key", "alerts": "Alerts", "first_alert": "First alert",
               "last_alert": "Last alert", "max_aggregate": "Peak aggregate", "limit": "Limit"}  # fmt: skip
    return Section("Top alerting keys", "Keys with the most alerts, per rule.", chart + table(rows, columns, "No alerts."))


def _latency(spark: SparkSession) -> Section:
    rows = _query(spark, "SELECT * FROM latency_trend WHERE alerts > 0 ORDER BY batch_end, batch_id")
    if not rows:
        return Section("Ingest → alert latency (ms)", "", '<p class="empty">No gold batch with alerts has pipeline metrics yet.</p>')
    series = {p: [getattr(r, f"latency_{p}_ms") for r in rows] for p in ("p50", "p95", "p99")}
    chart = time_lines([r.batch_end for r in rows], series, "Latency percentiles per gold batch (ms)", y_title="ms", what="Gold batch end")
    columns = {"batch_id": "Batch", "batch_end": "Batch end (UTC)", "alerts": "Alerts", "latency_p50_ms": "p50 ms",
               "latency_p95_ms": "p95 ms", "latency_p99_ms": "p99 ms", "latency_max_ms": "max ms", "processing_ms": "Batch ms"}  # fmt: skip
    caption = (
        "Ingest → alert latency is, for each alert, the time in milliseconds from its transaction's bronze ingest "
        "(the line landing in the lakehouse) to the commit of the alert. Per gold micro-batch with alerts, plotted at the "
        "batch's end: p50 is the median (half of the batch's alerts took at most that long), p95 and p99 the times "
        "that 95% and 99% of them stayed within; max is the slowest."
    )
    return Section("Ingest → alert latency (ms)", caption, chart + table(rows, columns, ""))


def _quarantine(spark: SparkSession) -> Section:
    rows = _query(spark, "SELECT reason_code, lines, example FROM quarantine_reasons ORDER BY lines DESC, reason_code")
    labels = [f"{r.reason_code} (e.g. {r.example})" for r in rows]
    body = horizontal_bars(labels, [r.lines for r in rows], "Quarantine reasons") if rows else '<p class="empty">Nothing quarantined.</p>'
    return Section("Quarantine reasons", "Lines that failed validation, by reason code with one example; a line failing several checks counts under each.", body)


def _id_conflicts(spark: SparkSession) -> Section:
    total = _query(spark, "SELECT count(*) AS lines FROM id_conflicts")[0].lines
    rows = _query(spark, "SELECT * FROM id_conflicts ORDER BY ingest_time DESC, transaction_id LIMIT 50")
    columns = {"transaction_id": "Transaction", "ingest_time": "Ingested", "source_file": "File", "silver_batch_id": "Silver batch"}
    caption = (
        f"{total:,} line(s) reused a transaction id silver had accepted with other content: the first line counts, "
        "this one is kept in silver/duplicates and never evaluated. A producer reusing ids, or someone hiding a "
        "payment behind a known id. The 50 newest."
    )
    return Section("Reused transaction ids", caption, table(rows, columns, "No transaction id was reused with other content."))


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


def _ago(minutes: Any) -> str:
    if minutes is None:
        return "never"
    minutes = float(minutes)
    if minutes < 0:
        return "in the future"  # event times ahead of the clock: worth seeing, not hiding
    if minutes < 120:
        return f"{minutes:,.1f} min ago"
    hours = minutes / 60
    return f"{hours:,.1f} h ago" if hours < 48 else f"{hours / 24:,.1f} days ago"


def _tile(label: str, value: str, note: str = "", kind: str = "") -> str:
    note_html = f'<div class="note">{escape(note)}</div>' if note else ""
    return f'<div class="tile {kind}"><div class="value">{escape(value)}</div><div class="label">{escape(label)}</div>{note_html}</div>'


def _tiles(spark: SparkSession) -> str:
    (totals,) = _query(
        spark,
        "SELECT (SELECT count(*) FROM alerts_masked) AS alerts, (SELECT count(DISTINCT rule_id) FROM alerts_masked) AS rules,"
        " (SELECT count(*) FROM top_alerting_keys) AS keys, (SELECT count_if(rule_state = 'ACTIVE') FROM rule_effectiveness) AS active,"
        " (SELECT max(silver_events) FROM rule_effectiveness) AS events",
    )
    (flow,) = _query(
        spark,
        "SELECT sum(rows_ingested) AS ingested, sum(quarantined) AS quarantined, sum(duplicates) AS duplicates,"
        " sum(late_events) AS late FROM pipeline_batches",
    )
    (fresh,) = _query(spark, "SELECT * FROM freshness")
    alerting = [("Alerts", totals.alerts), ("Rules alerting", totals.rules), ("Active rules", totals.active),
                ("Keys alerted", totals.keys), ("Silver events", totals.events or 0)]  # fmt: skip
    quality = [("Lines ingested (bronze)", flow.ingested), ("Quarantined", flow.quarantined),
               ("Duplicates dropped", flow.duplicates), ("Late events (not evaluated)", flow.late)]  # fmt: skip
    stamp = "{:%Y-%m-%d %H:%M:%S} UTC".format
    freshness = [
        _tile("Newest event in silver", stamp(fresh.newest_event_time) if fresh.newest_event_time else "none",
              _ago(fresh.event_lag_minutes), "time"),
        _tile("Last gold batch ended", stamp(fresh.last_gold_batch_end) if fresh.last_gold_batch_end else "none",
              _ago(fresh.gold_lag_minutes), "time"),
    ]  # fmt: skip
    return "".join(
        f'<div class="tiles" id="{name}">{body}</div>'
        for name, body in (
            ("alerting", "".join(_tile(t, _number(v)) for t, v in alerting)),
            ("quality", "".join(_tile(t, _number(v or 0)) for t, v in quality)),
            ("freshness", "".join(freshness)),
        )
    )


CSS = """
body{margin:0;background:#f3f4f6;color:#111827;%s}
header{background:#111827;color:#f9fafb;padding:20px 32px}
header h1{margin:0;font-size:22px} header p{margin:4px 0 0;color:#9ca3af;font-size:13px}
main{max-width:1100px;margin:0 auto;padding:20px 32px 40px}
.tiles{display:flex;gap:12px;margin-bottom:12px} .tile{flex:1;background:#fff;border-radius:8px;padding:14px 16px;box-shadow:0 1px 2px #0001}
.tile .value{font-size:26px;font-weight:600} .tile .label{font-size:12px;color:#6b7280;margin-top:2px}
.tile.time .value{font-size:17px;padding-top:6px} .tile .note{font-size:12px;color:#374151;margin-top:4px}
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
    sections = [_alerts_over_time(spark), _top_keys(spark), _latency(spark), _quarantine(spark), _id_conflicts(spark),
                _effectiveness(spark), _rule_changes(spark), _latest_alerts(spark)]  # fmt: skip
    rendered = "".join(
        f"<section><h2>{escape(s.title)}</h2><p class=\"caption\">{escape(s.caption)}</p>{s.body}</section>" for s in sections
    )
    made = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    masking = "account identifiers masked" if mask else "account identifiers shown"
    # The session's time zone is UTC (runtime/session.py), so every time shown is UTC.
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>rulewatch report</title><style>{CSS}</style></head>'
        f"<body><header><h1>rulewatch report</h1><p>{escape(lakehouse.root)} · {made} · {masking} · all times UTC</p></header>"
        f"<main>{_tiles(spark)}{rendered}</main></body></html>"
    )
