"""Rule model and strict parser for rulewatch rule files.

Rules are data: this module validates and converts them, and never evaluates a string
as code or splices one into SQL, so a hostile rule file can at worst be rejected.
"""

from __future__ import annotations

import difflib
import json
import operator as _op
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from enum import Enum
from typing import Any, TypeGuard

from rulewatch.engine.identity import canonical


class Aggregator(str, Enum):
    """Aggregate computed over a rule's window."""

    SUM = "SUM"
    COUNT = "COUNT"
    AVG = "AVG"
    MIN = "MIN"
    MAX = "MAX"
    UNIQUE_COUNT = "UNIQUE_COUNT"


class Operator(str, Enum):
    """Comparison of a window's aggregate (left) with the rule's limit (right)."""

    GREATER = "GREATER"
    GREATER_EQUAL = "GREATER_EQUAL"
    LESS = "LESS"
    LESS_EQUAL = "LESS_EQUAL"
    EQUAL = "EQUAL"
    NOT_EQUAL = "NOT_EQUAL"

    @property
    def symbol(self) -> str:
        """The operator as written in formulas, e.g. ``">="``."""
        return _SYMBOLS[self]

    def holds(self, value: Decimal, limit: Decimal) -> bool:
        """Whether ``value <operator> limit`` is true."""
        return _COMPARISONS[self](value, limit)


_SYMBOLS: dict[Operator, str] = {
    Operator.GREATER: ">",
    Operator.GREATER_EQUAL: ">=",
    Operator.LESS: "<",
    Operator.LESS_EQUAL: "<=",
    Operator.EQUAL: "=",
    Operator.NOT_EQUAL: "!=",
}
_COMPARISONS: dict[Operator, Callable[[Decimal, Decimal], bool]] = {
    Operator.GREATER: _op.gt,
    Operator.GREATER_EQUAL: _op.ge,
    Operator.LESS: _op.lt,
    Operator.LESS_EQUAL: _op.le,
    Operator.EQUAL: _op.eq,
    Operator.NOT_EQUAL: _op.ne,
}


class RuleState(str, Enum):
    """Lifecycle: only ACTIVE rules are evaluated; PAUSE keeps the rule, DELETE removes it."""

    ACTIVE = "ACTIVE"
    PAUSE = "PAUSE"
    DELETE = "DELETE"


EVENT_FIELDS: dict[str, str] = {
    "transactionId": "string",
    "payeeId": "string",
    "beneficiaryId": "string",
    "paymentType": "string",
    "userId": "string",
    "ip": "string",
    "action": "string",
    "paymentAmount": "decimal",
}
NUMERIC_FIELDS: frozenset[str] = frozenset(f for f, kind in EVENT_FIELDS.items() if kind == "decimal")

# Accepted spellings -> value. COUNT_FLINK is the reference's magic name; accepting it keeps
# the reference's rule files loadable unchanged.
_STATES = {s.value: s for s in RuleState}
COUNT_FLINK = "COUNT_FLINK"
_AGGREGATORS = {a.value: a for a in Aggregator} | {COUNT_FLINK: Aggregator.COUNT}
_OPERATORS = {o.value: o for o in Operator} | {o.symbol: o for o in Operator} | {"==": Operator.EQUAL}
_NUMERIC_AGGREGATORS = frozenset({Aggregator.SUM, Aggregator.AVG, Aggregator.MIN, Aggregator.MAX})

_ALLOWED_STATES = ", ".join(_STATES)
_ALLOWED_AGGREGATORS = ", ".join(a.value for a in Aggregator) + " (alias COUNT_FLINK)"
_ALLOWED_OPERATORS = ", ".join(
    f"{o.value} ({o.symbol}{' or ==' if o is Operator.EQUAL else ''})" for o in Operator
)
_FIELD_NAMES = {f: f for f in EVENT_FIELDS}
_ALLOWED_FIELDS = ", ".join(EVENT_FIELDS)
_RULE_FIELDS = (
    "ruleId", "ruleState", "groupingKeyNames", "aggregateFieldName", "aggregatorFunctionType",
    "limitOperatorType", "limit", "windowMinutes", "window", "filter", "cooldown",
    "reportNewValuesOnly", "bucket", "description",
)

# config/rules.ruleId (and every rule_id column after it) is a Spark IntegerType: 32-bit signed.
MAX_RULE_ID = 2**31 - 1
_ALLOWED_RULE_IDS = f"a positive integer between 1 and {MAX_RULE_ID} (config/rules stores ruleId as int)"

# Far beyond any real rule set (a rule is a few hundred bytes), and small enough that a wrong path,
# a log or an image, is refused at once instead of being read into memory.
MAX_RULES_FILE_BYTES = 10 * 2**20
_NOT_FILES = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)

DURATION_FORMS = "a positive integer followed by ms, s, m, h or d (e.g. '250ms', '10s', '3m', '24h', '90d')"
_UNIT_MS = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1_000, "ms": 1}  # largest first
_DURATION = re.compile(r"([1-9][0-9]{0,17})(ms|s|m|h|d)")
_MAX_MS = 2**63 - 1  # durations must fit a 64-bit millisecond count (Spark LongType)
# ASCII-only and no inf/nan/underscores, unlike Decimal()'s own parser.
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def parse_duration(text: str) -> int:
    """Milliseconds in a duration string such as ``"10s"``, ``"3m"``, ``"24h"``, ``"90d"``."""
    match = _DURATION.fullmatch(text) if isinstance(text, str) else None
    ms = int(match[1]) * _UNIT_MS[match[2]] if match else 0
    if not 0 < ms <= _MAX_MS:
        raise ValueError(f"bad duration {text!r}; expected {DURATION_FORMS}")
    return ms


def format_duration(ms: int) -> str:
    """The shortest duration string that parse_duration maps back to exactly ``ms``."""
    if ms <= 0:
        raise ValueError(f"duration must be positive, got {ms} ms")
    unit = next(u for u, size in _UNIT_MS.items() if ms % size == 0)
    return f"{ms // _UNIT_MS[unit]}{unit}"


@dataclass(frozen=True)
class Rule:
    """One validated rule. Build it with parse_rule; times are in milliseconds."""

    rule_id: int
    state: RuleState
    grouping_keys: tuple[str, ...]
    aggregate_field: str
    aggregator: Aggregator
    operator: Operator
    limit: Decimal
    window_ms: int
    filter: tuple[tuple[str, str], ...]  # (field, value), sorted by field
    cooldown_ms: int = 0
    report_new_values_only: bool = False
    bucket_ms: int = 0  # 0 = exact window
    description: str = ""

    @property
    def keyset(self) -> str:
        """Identifies the per-key history this rule shares with rules grouped the same way."""
        return ",".join(self.grouping_keys)

    def passes_filter(self, event: Mapping[str, object]) -> bool:
        """Whether the event meets every equality condition of the rule's filter."""
        return all(event.get(f) is not None and str(event[f]) == v for f, v in self.filter)

    def to_json(self) -> dict[str, Any]:
        """The rule in reference JSON names; parse_rule(rule.to_json()) == rule."""
        if self == deletion(self.rule_id):
            return {"ruleId": self.rule_id, "ruleState": RuleState.DELETE.value}
        out: dict[str, Any] = {
            "ruleId": self.rule_id,
            "ruleState": self.state.value,
            "groupingKeyNames": list(self.grouping_keys),
            "aggregateFieldName": self.aggregate_field,
            "aggregatorFunctionType": self.aggregator.value,
            "limitOperatorType": self.operator.value,
            "limit": _json_number(self.limit),
            "window": format_duration(self.window_ms),
        }
        if self.filter:
            out["filter"] = dict(self.filter)
        if self.cooldown_ms:
            out["cooldown"] = format_duration(self.cooldown_ms)
        if self.report_new_values_only:
            out["reportNewValuesOnly"] = True
        if self.bucket_ms:
            out["bucket"] = format_duration(self.bucket_ms)
        if self.description:
            out["description"] = self.description
        return out


def _json_number(value: Decimal) -> int | float | str:
    """A json.dumps-able form of ``value`` that parses back to an equal Decimal."""
    if value == value.to_integral_value() and value.adjusted() < 18:
        return int(value)
    as_float = float(value)
    if Decimal(repr(as_float)) == value:
        return as_float
    # More digits than a float carries: a numeric string keeps the exact value.
    return str(value)


class RuleError(ValueError):
    """One invalid rule: which rule (if known), which field, and what was wrong."""

    def __init__(self, rule_id: int | None, field: str, reason: str) -> None:
        super().__init__(rule_id, field, reason)  # all three in args so the error pickles
        self.rule_id = rule_id
        self.field = field
        self.reason = reason

    def __str__(self) -> str:
        parts = [] if self.rule_id is None else [f"rule {self.rule_id}"]
        parts.append(f"field {self.field!r} {self.reason}" if self.field else self.reason)
        return ": ".join(parts)


class RuleSetError(ValueError):
    """Every problem found in one rule source; ``locations[i]`` says where ``errors[i]`` is."""

    def __init__(self, errors: list[RuleError], locations: list[str], source: str = "") -> None:
        super().__init__(errors, locations, source)
        self.errors = errors
        self.locations = locations
        self.source = source

    def __str__(self) -> str:
        rules = len(dict.fromkeys(self.locations))  # several problems of one rule share its location
        head = f"{rules} invalid rule(s)" + (f" in {self.source}" if self.source else "")
        if len(self.errors) > rules:
            head += f", {len(self.errors)} problems"
        lines = [f"  {where}: {error}" if where else f"  {error}" for where, error in zip(self.locations, self.errors)]
        return "\n".join([head + ":", *lines])


def _show(value: object) -> str:
    # JSON text decodes non-integers to Decimal; show them as the user wrote them.
    text = str(value) if isinstance(value, Decimal) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _to_decimal(value: object) -> Decimal | None:
    """A finite Decimal from a JSON number or numeric string, else None."""
    if isinstance(value, float):
        value = repr(value)  # shortest text, so 0.1 becomes Decimal("0.1")
    if isinstance(value, str):
        return Decimal(value) if _NUMBER.fullmatch(value) else None
    if isinstance(value, Decimal):
        return value if value.is_finite() else None
    return Decimal(value) if _is_int(value) else None


def _scalar_text(value: object) -> str | None:
    """Filter values are compared as text; None if ``value`` is not a JSON scalar."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int)):
        return str(value)
    if isinstance(value, (float, Decimal)) and _to_decimal(value) is not None:
        return str(value)
    return None


def deletion(rule_id: int) -> Rule:
    """``{"ruleId": N, "ruleState": "DELETE"}``: a deletion only has to name the rule; the other
    fields are placeholders that nothing evaluates."""
    return Rule(rule_id, RuleState.DELETE, (), "transactionId", Aggregator.COUNT, Operator.GREATER, Decimal(0), 1, ())


def _suggestion(value: object, allowed: Iterable[str]) -> str:
    """``; did you mean 'payeeId'?`` for a near miss (a typo, another case), else nothing."""
    if not isinstance(value, str):
        return ""
    by_fold = {name.casefold(): name for name in allowed}
    close = by_fold.get(value.casefold()) or next(iter(difflib.get_close_matches(value, list(allowed), n=1, cutoff=0.75)), None)
    return f"; did you mean {close!r}?" if close and close != value else ""


class RuleErrors(RuleError):
    """Several problems in one rule: every field that is wrong, not just the first."""

    def __init__(self, errors: list[RuleError]) -> None:
        # As one RuleError (config/rule_errors keeps field and reason): every field, every reason.
        fields = ", ".join(dict.fromkeys(e.field for e in errors))
        super().__init__(errors[0].rule_id, fields, "; ".join(f"{e.field!r} {e.reason}" for e in errors))
        self.errors = errors

    def __str__(self) -> str:
        return "; ".join(str(e) for e in self.errors)


def parse_rule(obj: Mapping[str, Any]) -> Rule:
    """Validate one decoded JSON rule object; raises RuleError naming every field that is wrong
    (``RuleErrors`` when more than one is)."""
    if not isinstance(obj, Mapping):
        raise RuleError(None, "", f"expected a JSON object, got {_show(obj)}")
    if "ruleId" not in obj:
        raise RuleError(None, "ruleId", f"is missing; allowed: {_ALLOWED_RULE_IDS}")
    rule_id = obj["ruleId"]
    if not _is_int(rule_id) or not 0 < rule_id <= MAX_RULE_ID:
        raise RuleError(None, "ruleId", f"has {_show(rule_id)}; allowed: {_ALLOWED_RULE_IDS}")
    errors: list[RuleError] = []

    def fail(field: str, reason: str) -> RuleError:
        return RuleError(rule_id, field, reason)

    def bad(field: str, allowed: str, names: Iterable[str] = ()) -> RuleError:
        return fail(field, f"has {_show(obj[field])}; allowed: {allowed}{_suggestion(obj[field], names)}")

    def required(field: str, allowed: str) -> Any:
        if field not in obj:
            raise fail(field, f"is missing; allowed: {allowed}")
        return obj[field]

    def pick(field: str, table: Mapping[str, Any], allowed: str) -> Any:
        value = required(field, allowed)
        if isinstance(value, str) and value in table:
            return table[value]
        raise bad(field, allowed, table)

    def duration(field: str) -> int:
        try:
            return parse_duration(obj[field])
        except ValueError:
            raise bad(field, DURATION_FORMS) from None

    def checked(parse: Callable[[], Any]) -> Any:
        """``parse()``, or None with its error noted, so the next field is checked too."""
        try:
            return parse()
        except RuleError as error:
            errors.append(error)
            return None

    for key in obj:
        if key not in _RULE_FIELDS:
            errors.append(fail(str(key), f"is not a rule field; allowed: {', '.join(_RULE_FIELDS)}{_suggestion(key, _RULE_FIELDS)}"))

    state = checked(lambda: pick("ruleState", _STATES, _ALLOWED_STATES)) if "ruleState" in obj else RuleState.ACTIVE
    if state is RuleState.DELETE and set(obj) <= {"ruleId", "ruleState", "description"}:
        return deletion(rule_id)

    def grouping_keys() -> tuple[str, ...]:
        keys_allowed = f"a non-empty list of distinct names from {_ALLOWED_FIELDS}"
        keys = required("groupingKeyNames", keys_allowed)
        if not isinstance(keys, (list, tuple)) or not keys:
            raise bad("groupingKeyNames", keys_allowed)
        for key in keys:
            if not (isinstance(key, str) and key in EVENT_FIELDS):
                raise fail("groupingKeyNames", f"has {_show(key)}; allowed: {_ALLOWED_FIELDS}{_suggestion(key, EVENT_FIELDS)}")
        repeated = [key for i, key in enumerate(keys) if key in keys[:i]]
        if repeated:
            raise fail("groupingKeyNames", f"lists {repeated[0]!r} more than once")
        return tuple(keys)

    keys = checked(grouping_keys)

    if obj.get("aggregateFieldName") == COUNT_FLINK:
        # The reference counted events by aggregating this magic field (usually with SUM): any
        # counting aggregator over it means "count the events", so its rule files load unchanged.
        aggregate_field, aggregator = "transactionId", Aggregator.COUNT
        if obj.get("aggregatorFunctionType") not in ("SUM", "COUNT", COUNT_FLINK):
            errors.append(fail("aggregatorFunctionType", f"has {_show(obj.get('aggregatorFunctionType'))} with "
                               f"aggregateFieldName {COUNT_FLINK!r}; allowed: SUM, COUNT, {COUNT_FLINK}"))  # fmt: skip
    else:
        aggregate_field = checked(lambda: pick("aggregateFieldName", _FIELD_NAMES, _ALLOWED_FIELDS))
        aggregator = checked(lambda: pick("aggregatorFunctionType", _AGGREGATORS, _ALLOWED_AGGREGATORS))
    if aggregator in _NUMERIC_AGGREGATORS and aggregate_field is not None and aggregate_field not in NUMERIC_FIELDS:
        errors.append(fail(
            "aggregateFieldName",
            f"has {aggregate_field!r}, but {aggregator.value} needs a numeric field; "
            f"allowed: {', '.join(sorted(NUMERIC_FIELDS))}",
        ))  # fmt: skip
    operator = checked(lambda: pick("limitOperatorType", _OPERATORS, _ALLOWED_OPERATORS))

    def limit_value() -> Decimal:
        limit_allowed = "a finite number or numeric string"
        limit = _to_decimal(required("limit", limit_allowed))
        if limit is None:
            raise bad("limit", limit_allowed)
        return limit

    limit = checked(limit_value)

    def window() -> int:
        if ("windowMinutes" in obj) == ("window" in obj):
            raise fail(
                "window",
                "and 'windowMinutes' are both given; give exactly one"
                if "window" in obj
                else "is missing; give exactly one of 'window' (a duration) or 'windowMinutes' (a positive integer)",
            )
        if "window" in obj:
            return duration("window")
        minutes = obj["windowMinutes"]
        if not _is_int(minutes) or not 0 < minutes * 60_000 <= _MAX_MS:
            raise bad("windowMinutes", "a positive integer")
        return minutes * 60_000

    window_ms = checked(window)

    def conditions() -> tuple[tuple[str, str], ...]:
        raw_filter = obj.get("filter", {})
        if not isinstance(raw_filter, Mapping):
            raise bad("filter", "an object mapping event fields to values")
        found = []
        for field, value in raw_filter.items():
            if not (isinstance(field, str) and field in EVENT_FIELDS):
                raise fail("filter", f"has key {_show(field)}; allowed: {_ALLOWED_FIELDS}{_suggestion(field, EVENT_FIELDS)}")
            text = _scalar_text(value)
            if text is None:
                raise fail("filter", f"has {_show(value)} for {field!r}; allowed: a string, number or boolean")
            if not canonical(text):  # silver quarantines a blank field: such a filter could never match
                raise fail("filter", f"has a blank value for {field!r}; allowed: a value with something other than white space")
            found.append((field, canonical(text)))  # compared with events' values, which silver makes canonical
        return tuple(sorted(found))

    filter_ = checked(conditions)
    cooldown_ms = checked(lambda: duration("cooldown")) if "cooldown" in obj else 0

    new_values_only = obj.get("reportNewValuesOnly", False)
    if not isinstance(new_values_only, bool):
        errors.append(bad("reportNewValuesOnly", "true, false"))
    elif new_values_only and aggregator is not None and aggregator is not Aggregator.UNIQUE_COUNT:
        errors.append(fail(
            "reportNewValuesOnly",
            f"is true but aggregatorFunctionType is {aggregator.value}; allowed only with UNIQUE_COUNT",
        ))  # fmt: skip

    bucket_ms = checked(lambda: duration("bucket")) if "bucket" in obj else 0
    if bucket_ms and window_ms and (bucket_ms >= window_ms or window_ms % bucket_ms):
        errors.append(fail(
            "bucket",
            f"has {_show(obj['bucket'])}; allowed: a duration shorter than the window "
            f"({format_duration(window_ms)}) that divides it exactly",
        ))  # fmt: skip

    description = obj.get("description", "")
    if not isinstance(description, str):
        errors.append(bad("description", "a string"))

    if errors:
        raise errors[0] if len(errors) == 1 else RuleErrors(errors)
    return Rule(
        rule_id=rule_id,
        state=state,
        grouping_keys=keys,
        aggregate_field=aggregate_field,
        aggregator=aggregator,
        operator=operator,
        limit=limit,
        window_ms=window_ms,
        filter=filter_,
        cooldown_ms=cooldown_ms,
        report_new_values_only=new_values_only,
        bucket_ms=bucket_ms,
        description=description,
    )


def _decode(source: str | bytes | list[Any]) -> list[tuple[str, Any]]:
    """(location, decoded item) pairs; a part that does not decode is given as a RuleError."""
    if isinstance(source, list):
        return [(f"item {i}", item) for i, item in enumerate(source, 1)]
    if isinstance(source, bytes):
        try:
            source = source.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            return [("", RuleError(None, "", f"not UTF-8 text: {exc}"))]
    if not isinstance(source, str):
        raise TypeError(f"rules must be given as str, bytes or list, not {type(source).__name__}")
    # parse_float=Decimal keeps limits exact instead of rounding them through float.
    if source.lstrip().startswith("["):
        try:
            items = json.loads(source, parse_float=Decimal)
        except ValueError as exc:
            return [("", RuleError(None, "", f"not valid JSON: {exc}"))]
        return [(f"item {i}", item) for i, item in enumerate(items, 1)]
    decoded: list[tuple[str, Any]] = []
    # split("\n"), not splitlines(): the latter also splits at U+2028 etc. inside JSON strings.
    for number, line in enumerate(source.split("\n"), 1):
        if line.strip():
            try:
                decoded.append((f"line {number}", json.loads(line, parse_float=Decimal)))
            except ValueError as exc:
                decoded.append((f"line {number}", RuleError(None, "", f"not valid JSON: {exc}")))
    return decoded


def parse_rules(source: str | bytes | list[Any]) -> list[Rule]:
    """Parse a JSON array, JSON lines, or a decoded list; raises RuleSetError listing every problem."""
    rules: list[Rule] = []
    errors: list[RuleError] = []
    locations: list[str] = []
    first_seen: dict[int, str] = {}
    for where, item in _decode(source):
        try:
            if isinstance(item, RuleError):
                raise item
            rule = parse_rule(item)
            if rule.rule_id in first_seen:
                raise RuleError(rule.rule_id, "ruleId", f"repeats the ruleId of {first_seen[rule.rule_id]}")
        except RuleError as error:
            found = error.errors if isinstance(error, RuleErrors) else [error]
            errors += found
            locations += [where] * len(found)
            continue
        first_seen[rule.rule_id] = where
        rules.append(rule)
    if errors:
        raise RuleSetError(errors, locations)
    return rules


def _read_rules_bytes(name: str) -> bytes:
    """The file's bytes; raises RuleError for anything but a regular file of at most MAX_RULES_FILE_BYTES."""
    # Checked before opening: reading a FIFO waits for a writer and /dev/zero never ends.
    info = os.stat(name)
    if not stat.S_ISREG(info.st_mode):
        kind = next((kind for is_kind, kind in _NOT_FILES if is_kind(info.st_mode)), "a special file")
        raise RuleError(None, "", f"is {kind}, not a regular file; give the path of a rules file")
    too_big = f"is larger than {MAX_RULES_FILE_BYTES // 2**20} MiB, the most a rules file may hold"
    if info.st_size > MAX_RULES_FILE_BYTES:
        raise RuleError(None, "", f"{too_big} ({info.st_size} bytes)")
    with open(name, "rb") as handle:
        data = handle.read(MAX_RULES_FILE_BYTES + 1)  # bounded: the file may have grown since the check
    if len(data) > MAX_RULES_FILE_BYTES:
        raise RuleError(None, "", too_big)
    return data


def load_rules_file(path: str | os.PathLike[str]) -> list[Rule]:
    """Parse a rules file; any problem is raised as a RuleSetError naming the file."""
    name = os.fspath(path)
    try:
        data = _read_rules_bytes(name)
    except OSError as exc:
        raise RuleSetError([RuleError(None, "", f"cannot be read: {exc.strerror}")], [""], name) from exc
    except RuleError as exc:
        raise RuleSetError([exc], [""], name) from None
    try:
        return parse_rules(data)
    except RuleSetError as exc:
        raise RuleSetError(exc.errors, exc.locations, name) from None
