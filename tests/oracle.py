"""Brute-force reference oracle for rulewatch alert semantics.

Independent of the ``rulewatch`` package on purpose (stdlib only): it is the
executable form of the brief (/work/shared/brief.md §1, §3, §4) and is used to
check the real engine. Clarity over speed: everything is O(n²).

``oracle(events, rules) -> list[dict]``

Inputs
------
events
    dicts with ``transactionId`` (str), ``eventTime`` (int, epoch ms) and
    optional ``payeeId``, ``beneficiaryId``, ``paymentType``, ``userId``,
    ``ip``, ``action`` (str or None) and ``paymentAmount`` (Decimal or None).
    The order of the list does not matter (the oracle is a batch evaluation:
    every event, late or not, is evaluated over its own window).
rules
    reference-JSON dicts: ``ruleId``, ``ruleState`` (only ``ACTIVE`` — or no
    ``ruleState`` at all — is evaluated), ``groupingKeyNames``,
    ``aggregateFieldName``, ``aggregatorFunctionType`` (SUM, COUNT, AVG, MIN,
    MAX, UNIQUE_COUNT; ``COUNT_FLINK`` is an alias of COUNT),
    ``limitOperatorType`` (GREATER, GREATER_EQUAL, LESS, LESS_EQUAL, EQUAL,
    NOT_EQUAL or >, >=, <, <=, =, ==, !=), ``limit`` (number or numeric
    string), ``windowMinutes`` or ``window`` (duration string
    ``"<int><ms|s|m|h|d>"``), optional ``filter`` ({field: value}),
    optional ``cooldown`` (duration string or int ms), optional
    ``reportNewValuesOnly`` (bool), optional ``bucket`` (duration string or
    int ms).
    Reference compatibility: ``aggregateFieldName == "COUNT_FLINK"`` (the
    reference's magic field, where every event contributes 1) with SUM is
    also treated as COUNT; with other aggregators each event's value is 1.

Semantics
---------
* An event is *seen* by rule r iff it passes r's filter (for every filter
  entry, ``str(event value) == filter value as str``, bool filter values as
  ``"true"``/``"false"``; a missing/None event value fails) and every
  grouping key field is present and not None. Key = tuple of those values;
  ``group_key`` = ``"|".join(values)``.
* Events are ordered by ``(eventTime, transactionId)``.
  ``window(e)`` = events e' seen by r with the same key,
  ``e.eventTime - W <= e'.eventTime`` and ``(t', id') <= (t, id)``, where
  W = ``windowMinutes * 60000`` or the parsed ``window``. Both ends
  inclusive; e is in its own window.
  Bucket mode (rule has ``bucket`` B ms): the window start is
  ``floor((t - W) / B) * B`` (inclusive) instead of ``t - W``; end unchanged.
* Aggregates over window(e):
  COUNT = number of events in the window (int).
  SUM = Decimal sum of the non-null values (0 if none).
  AVG = sum / count over non-null values, None if none; the comparison with
  the limit is exact (``sum <op> limit * n``), the reported value is the
  exact mean quantized to 6 decimal places, ROUND_HALF_EVEN.
  MIN / MAX over non-null values, None if none.
  UNIQUE_COUNT = number of distinct non-null values (compared as str) (int).
  A None aggregate never alerts.
* The operator compares the aggregate with ``Decimal(limit)``. If it holds,
  (r, e) is a *candidate* alert.
* Cooldown C ms (default 0): per (rule, key) remember the eventTime of the
  last *emitted* alert; a candidate at time t is suppressed if a previous
  alert exists and ``t < last + C``. Suppressed candidates do not update
  ``last``.
* reportNewValuesOnly (UNIQUE_COUNT only): per (rule, key) a dict
  ``reported[value] = eventTime of the alert that reported it``. A value is
  already reported if ``reported[value] >= t - W``. The candidate emits only
  if window(e) holds at least one distinct value not already reported; the
  alert's ``values`` are only those new values, and each gets
  ``reported[value] = t``. The cooldown check comes first; a suppressed
  candidate reports nothing.
* One output dict per alert: ``rule_id`` (int), ``transaction_id``,
  ``group_key``, ``event_time`` (ms), ``aggregate_value`` (Decimal for
  SUM/AVG/MIN/MAX, int for COUNT/UNIQUE_COUNT), ``event_count`` (events in
  the window), ``window_start`` (ms), ``window_end`` (= t), ``values``
  (UNIQUE_COUNT: sorted list of str of the distinct values in the window, or
  only the new ones in reportNewValuesOnly mode; None otherwise).
  Sorted by ``(rule_id, event_time, transaction_id)``.
"""

from __future__ import annotations

import operator
import re
from decimal import Decimal
from fractions import Fraction

__all__ = ["oracle", "parse_duration_ms"]

_UNITS_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}

_OPS = {
    "GREATER": operator.gt,
    ">": operator.gt,
    "GREATER_EQUAL": operator.ge,
    ">=": operator.ge,
    "LESS": operator.lt,
    "<": operator.lt,
    "LESS_EQUAL": operator.le,
    "<=": operator.le,
    "EQUAL": operator.eq,
    "=": operator.eq,
    "==": operator.eq,
    "NOT_EQUAL": operator.ne,
    "!=": operator.ne,
}

_AGG_ALIASES = {"COUNT_FLINK": "COUNT"}


def parse_duration_ms(value) -> int:
    """'10s' / '3m' / '24h' / '90d' / '250ms' → ms; an int is taken as ms."""
    if isinstance(value, bool):
        raise ValueError(f"bad duration {value!r}")
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+)\s*(ms|s|m|h|d)\s*", str(value))
    if not m:
        raise ValueError(f"bad duration {value!r}")
    return int(m.group(1)) * _UNITS_MS[m.group(2)]


def _window_ms(rule: dict) -> int:
    if rule.get("window") is not None:
        return parse_duration_ms(rule["window"])
    return int(rule["windowMinutes"]) * 60_000


def _as_str(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _passes_filter(event: dict, flt: dict | None) -> bool:
    for field, wanted in (flt or {}).items():
        v = event.get(field)
        if v is None or _as_str(v) != _as_str(wanted):
            return False
    return True


def _key(event: dict, names: list[str]):
    vals = [event.get(n) for n in names]
    if any(v is None for v in vals):
        return None
    return tuple(_as_str(v) for v in vals)


def _num(v) -> Decimal:
    return v if isinstance(v, Decimal) else Decimal(str(v))


def _avg6(total: Decimal, n: int) -> Decimal:
    # exact mean, rounded half-even to 6 places (round(Fraction) is half-even)
    scaled = round(Fraction(total) / n * 1_000_000)
    return Decimal(scaled).scaleb(-6)


def _evaluate_one(rule: dict, events: list[dict]) -> list[dict]:
    rule_id = int(rule["ruleId"])
    agg = str(rule["aggregatorFunctionType"]).upper()
    agg = _AGG_ALIASES.get(agg, agg)
    field = rule.get("aggregateFieldName")
    count_field = field == "COUNT_FLINK"
    if count_field and agg == "SUM":
        agg = "COUNT"
    op = _OPS[str(rule["limitOperatorType"]).strip().upper()]
    limit = Decimal(str(rule["limit"]))
    W = _window_ms(rule)
    B = parse_duration_ms(rule["bucket"]) if rule.get("bucket") else None
    C = parse_duration_ms(rule["cooldown"]) if rule.get("cooldown") else 0
    new_only = bool(rule.get("reportNewValuesOnly")) and agg == "UNIQUE_COUNT"
    names = list(rule.get("groupingKeyNames") or [])

    seen = []  # (t, id, key, event) for events seen by this rule
    for e in events:
        if not _passes_filter(e, rule.get("filter")):
            continue
        k = _key(e, names)
        if k is None:
            continue
        seen.append((int(e["eventTime"]), str(e["transactionId"]), k, e))
    seen.sort(key=lambda x: (x[0], x[1]))

    last_alert: dict = {}  # key -> eventTime of last emitted alert
    reported: dict = {}  # key -> {value: eventTime of alert that reported it}
    out = []
    for t, tid, k, e in seen:
        start = t - W
        if B:
            start = ((t - W) // B) * B  # floor division == floor for negatives too
        window = [
            x for x in seen if x[2] == k and x[0] >= start and (x[0], x[1]) <= (t, tid)
        ]
        n_events = len(window)
        if count_field:
            raw = [Decimal(1) for _ in window]
        else:
            raw = [x[3].get(field) for x in window if x[3].get(field) is not None]

        values = None
        holds = False
        if agg == "COUNT":
            value = n_events
            holds = op(Decimal(value), limit)
        elif agg == "SUM":
            value = sum((_num(v) for v in raw), Decimal(0))
            holds = op(value, limit)
        elif agg == "AVG":
            if raw:
                total = sum((_num(v) for v in raw), Decimal(0))
                holds = op(total, limit * len(raw))  # exact: n > 0
                value = _avg6(total, len(raw))
            else:
                value = None
        elif agg == "MIN":
            value = min(_num(v) for v in raw) if raw else None
            holds = value is not None and op(value, limit)
        elif agg == "MAX":
            value = max(_num(v) for v in raw) if raw else None
            holds = value is not None and op(value, limit)
        elif agg == "UNIQUE_COUNT":
            distinct = sorted({_as_str(v) for v in raw})
            value = len(distinct)
            holds = op(Decimal(value), limit)
            values = distinct
        else:
            raise ValueError(f"unknown aggregator {agg!r}")

        if not holds:
            continue
        if C and k in last_alert and t < last_alert[k] + C:
            continue  # suppressed by cooldown: reports nothing, keeps `last`
        if new_only:
            rep = reported.setdefault(k, {})
            new = [v for v in values if not (v in rep and rep[v] >= t - W)]
            if not new:
                continue
            for v in new:
                rep[v] = t
            values = new
        last_alert[k] = t
        out.append(
            {
                "rule_id": rule_id,
                "transaction_id": tid,
                "group_key": "|".join(k),
                "event_time": t,
                "aggregate_value": value,
                "event_count": n_events,
                "window_start": start,
                "window_end": t,
                "values": values,
            }
        )
    return out


def oracle(events: list[dict], rules: list[dict]) -> list[dict]:
    """Evaluate every ACTIVE rule over every event; see the module docstring."""
    alerts: list[dict] = []
    for rule in rules:
        state = rule.get("ruleState")
        if state is not None and str(state).upper() != "ACTIVE":
            continue
        alerts.extend(_evaluate_one(rule, events))
    alerts.sort(key=lambda a: (a["rule_id"], a["event_time"], a["transaction_id"]))
    return alerts


oracle.__doc__ = (oracle.__doc__ or "") + "\n" + (__doc__ or "")
