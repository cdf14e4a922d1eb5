"""Silver: typed, validated, de-duplicated transactions; everything else quarantined with a reason.

Nothing disappears: every bronze row ends in exactly one of ``silver/transactions``,
``silver/quarantine`` (with the reasons it failed) or ``silver/duplicates`` (a transaction id
already accepted, in this batch or an earlier one, with an event time within the dedup horizon;
the first occurrence wins; ``conflict`` marks a repeat whose content differs from the accepted one).
Ids and keys are compared by one rule (engine/identity.py): trimmed of white space, then NFC.
"""

from __future__ import annotations

import operator
import os
import time
from functools import cache, partial, reduce
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from rulewatch.engine.identity import EDGE_CHARACTERS, composed
from rulewatch.spark.storage import first_commit, schema, tables
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.storage.metrics import Recorder, Steps, ensure_metrics_table
from rulewatch.engine.rules import parse_duration
from rulewatch.spark.runtime.env import env_duration, future_tolerance
from rulewatch.spark.storage.sinks import append_once, batch_column, per_run, sink_name, together

MAX_AMOUNT = 10**12
# A transaction is a few hundred bytes; past this a line is refused before any field is read (the
# JSON reader's own limits would otherwise call a 50 MB line "malformed JSON", a false reason).
MAX_LINE_BYTES = 1_048_576
WHITESPACE = " \t\r\n"  # JSON's whitespace
# An event time before this is a unit mistake (epoch seconds read as milliseconds land in January
# 1970) or a placeholder, not a payment.
EVENT_TIME_FLOOR = "2000-01-01T00:00:00Z"
# An eventTime string must carry a date and a time of day (seconds, fraction and zone optional; no
# zone means UTC): Spark alone would read "12:30" as today and "2026-11-23" as midnight.
ISO_DATE_TIME = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[T ][0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]{1,9})?)?(Z|[+-][0-9]{2}(:?[0-9]{2})?)?$"
EPOCH_MS = r"^-?[0-9]{1,15}$"
PLAIN_DECIMAL = r"^-?[0-9]+(\.[0-9]+)?$"
CENTS = r"^-?[0-9]+(\.[0-9]{0,2}0*)?$"  # any length, but nothing other than zeros past the cents
# Strict JSON: Spark's reader would accept single quotes and NaN; no other lenient feature is on by default.
JSON_OPTIONS = {
    "mode": "PERMISSIVE",
    "columnNameOfCorruptRecord": "_corrupt_record",
    "allowSingleQuotes": "false",
    "allowNonNumericNumbers": "false",
}
# The payment types silver accepts (the brief's cash and card). Data, not code: the environment
# variable replaces the list ("CSH,CRD,WIRE") without a release; docs/reliability.md lists both.
PAYMENT_TYPES_ENV = "RULEWATCH_PAYMENT_TYPES"
DEFAULT_PAYMENT_TYPES = "CSH,CRD"
TEXT_FIELDS = [f for f in schema.FIELD_COLUMNS if f != "paymentAmount"]
# A transaction id accepted before counts as a duplicate when the two event times lie within this
# duration (a redelivery has the same event time). Bounding it keeps the check on recent silver
# files instead of the whole table; set e.g. "30d" to look further back, at that scan's cost.
DEDUP_HORIZON_ENV = "RULEWATCH_DEDUP_HORIZON"
DEFAULT_DEDUP_HORIZON = "1d"


def payment_types() -> list[str]:
    """The allowed ``paymentType`` values, sorted."""
    return sorted({t.strip() for t in os.environ.get(PAYMENT_TYPES_ENV, DEFAULT_PAYMENT_TYPES).split(",") if t.strip()})


def _text(name: str) -> Column:
    return F.col(f"j.{name}")


def _variant(name: str) -> Column:
    # variant_get, not the ``v:name`` path syntax, which Spark 4.0's parser (Databricks Runtime 17) lacks.
    return F.variant_get(F.col("v"), f"$.{name}", "variant")


def _json_type(name: str) -> Column:
    # A field's text (``_fields``) holds an object or array as its JSON text; the variant's type tells them apart.
    return F.split(F.schema_of_variant(_variant(name)), "<")[0]


def _wrong_types(flat: Column) -> list[tuple[Column, Column]]:
    """Text fields given as an object, array or boolean (numbers are fine as ids: 123 is "123").

    ``flat``: the line has no nested object or array (``_flat_object``)."""
    # Only text that could be one (an object, array or boolean arrives as its JSON text), and then
    # only in a line that could hold one, pays for the variant's type. The field's own test comes
    # first: Spark's AND skips its right side when the left is false, and the line test scans the
    # whole line twice (docs/journal/benchmarks.md, "Silver's per-line tests in order").
    maybe = ~flat | F.col("value").contains("true") | F.col("value").contains("false")
    suspect = {
        f: F.coalesce(_text(f).startswith("{") | _text(f).startswith("[") | _text(f).isin("true", "false"), F.lit(False)) & maybe
        for f in TEXT_FIELDS
    }
    return [
        (suspect[f] & _json_type(f).isin("OBJECT", "ARRAY", "BOOLEAN"), F.concat(F.lit(f"{f} must be text, got "), F.lower(_json_type(f))))
        for f in TEXT_FIELDS
    ]


# Each reason's stable code, for charts and alerting on quarantine: the reason text names the bad
# value, so grouping by it explodes on real traffic. (regex on the reason, code); first match wins.
REASON_CODES: list[tuple[str, str]] = [
    (r"^not valid UTF-8", "not_utf8"),
    (r"^line too long", "line_too_long"),
    (r"^blank line", "blank_line"),
    (r"^malformed JSON", "malformed_json"),
    (r"^duplicate key", "duplicate_key"),
    (r"^trailing content", "trailing_content"),
    (r"^missing transactionId", "missing_transaction_id"),
    (r"^missing eventTime", "missing_event_time"),
    (r"^unparsable eventTime", "unparsable_event_time"),
    (r"^eventTime .* is before ", "event_time_too_early"),
    (r"^eventTime .* after its ingest time", "event_time_in_future"),
    (r"^paymentAmount (must be a plain|is not a number)", "amount_not_a_number"),
    (r"^negative paymentAmount", "amount_negative"),
    (r"^paymentAmount above ", "amount_too_large"),
    (r"^paymentAmount has more than 2 decimal", "amount_too_precise"),
    (r"^unknown paymentType", "unknown_payment_type"),
    (r"^blank [A-Za-z]+ \(", "blank_field"),
    (r" must be text, got ", "wrong_type"),
]
OTHER_REASON = "other"


def reason_codes(reasons: Column) -> Column:
    """The codes of ``reasons`` (an array of reason texts), in order, joined by ``; `` like the texts."""

    def code(reason: Column) -> Column:
        chosen = F.lit(OTHER_REASON)
        for pattern, name in reversed(REASON_CODES):
            chosen = F.when(reason.rlike(pattern), F.lit(name)).otherwise(chosen)
        return chosen

    return F.array_join(F.transform(reasons, code), "; ")


def _skeleton(json_text: Column) -> Column:
    """JSON text with every escape and string literal collapsed: only its structure is left."""
    unescaped = F.when(json_text.contains("\\"), F.regexp_replace(json_text, r"(?s)\\.", "x")).otherwise(json_text)
    return F.regexp_replace(unescaped, '"[^"]*"', '""')


def _brackets(text: Column) -> Column:
    return F.length(text) - F.length(F.translate(text, "{}[]", ""))


# One JSON object with no bracket inside it: ``{``, then no ``{}[]`` up to the last character, ``}``.
FLAT_OBJECT = r"^\{[^{}\[\]]*\}\z"


def _flat_object(value: Column) -> Column:
    """The line is ``{...}`` with no other bracket anywhere: then it is one object and nothing after
    it (its one ``}`` closes the object and ends the line), whatever its strings hold. This runs on
    every line: one regex, behind two byte comparisons (Spark's ``locate`` / ``instr`` / ``length``
    count characters; the same test built from them cost 1.8 s per million lines, this 0.6 s)."""
    return value.startswith("{") & value.endswith("}") & value.rlike(FLAT_OBJECT)


def _one_object(skeleton: Column, parsed: Column) -> Column:
    """The line (``skeleton``: its trimmed ``_skeleton``) is one JSON object and nothing after it.

    Spark's JSON parsers stop after the first value and ignore the rest (``{...}{...}``,
    ``{...} junk``). The line's structure outside strings must start with ``{``, end with ``}`` and
    hold exactly the brackets of the value the parser read: anything after that value adds a bracket
    or ends in something other than ``}``.
    """
    brackets = _brackets(skeleton)
    # Almost every line is a flat object (two brackets): then its value's brackets need no re-serialising.
    same_brackets = F.when(brackets == 2, F.lit(True)).otherwise(brackets == _brackets(_skeleton(F.to_json(parsed))))
    return skeleton.startswith("{") & skeleton.endswith("}") & same_brackets


def _event_time_checks(text: Column, event_time: Column, epoch: Column, tolerance: str) -> list[tuple[Column, Column]]:
    quoted = F.concat(F.lit("eventTime '"), text, F.lit("'"))
    return [
        (text.isNull(), F.lit("missing eventTime")),
        (
            text.isNotNull() & event_time.isNull(),
            F.concat(F.lit("unparsable "), quoted, F.lit(" (expected epoch milliseconds or an ISO-8601 date and time)")),
        ),
        (
            event_time < F.lit(EVENT_TIME_FLOOR).cast("timestamp"),
            F.concat(quoted, F.lit(f" is before {EVENT_TIME_FLOOR}"), F.when(epoch, F.lit(" (epoch seconds? send milliseconds)")).otherwise(F.lit(""))),
        ),
        (
            event_time > F.col("ingest_time") + F.expr(f"INTERVAL {parse_duration(tolerance)} MILLISECONDS"),
            F.concat(quoted, F.lit(f" is more than {tolerance} after its ingest time")),
        ),
    ]


def _amount_good(text: Column, kind: Column, exact: Column) -> Column:
    """The common case in one regex: a plain decimal in cents, within range (see ``_amount_checks``)."""
    return text.rlike(CENTS) & (kind != "DOUBLE") & exact.between(0, MAX_AMOUNT)


def _amount_checks(value: Column, text: Column, kind: Column, exact: Column, good: Column) -> tuple[Column, list[tuple[Column, Column]]]:
    """The typed amount and its checks, from the variant's text of it so the digits are exactly as sent.

    (Spark's JSON reader would hand a number over as a double's text: 10.000000000000000000001
    becomes "10.0" and would pass the cents check.) ``kind`` is the variant's type of the amount,
    ``exact`` its text as decimal(38, 10) and ``good`` ``_amount_good`` of them, a column of its own:
    the checks and the typed amount both read it, and inlined it was evaluated for each.
    """
    # A number the variant holds as a double was written with an exponent or too many digits:
    # show it as sent, not as the double.
    sent = F.when(kind == "DOUBLE", F.regexp_extract(value, r'"paymentAmount"\s*:\s*([-+0-9.eE]+)', 1)).otherwise(text)
    plain = text.rlike(PLAIN_DECIMAL) & (kind != "DOUBLE")
    numeric = text.try_cast("double").isNotNull()
    # Each reason's own test runs only for an amount that is not good.
    bad = text.isNotNull() & ~good
    checks = [
        (
            bad & ~plain,
            F.when(numeric, F.concat(F.lit("paymentAmount must be a plain decimal number (no exponent, at most 38 digits): '"), sent, F.lit("'")))
            .otherwise(F.concat(F.lit("paymentAmount is not a number: '"), sent, F.lit("'"))),
        ),
        (bad & plain & (exact < 0), F.concat(F.lit("negative paymentAmount "), text)),
        (bad & plain & (exact.isNull() | (exact > MAX_AMOUNT)), F.concat(F.lit(f"paymentAmount above {MAX_AMOUNT:,}: "), text)),
        (bad & plain & ~text.rlike(CENTS), F.concat(F.lit("paymentAmount has more than 2 decimal places: "), text)),
    ]
    amount = F.when(good, exact.cast(schema.MONEY))
    return amount, checks


# The fields as text, read from the line's variant in one pass (a cast to this struct). A number
# becomes its value's text: 123 is "123", 1000.0 is "1000" (the variant keeps no trailing zeros).
FIELDS_STRUCT = "struct<" + ", ".join(f"{name}: string" for name in schema.RAW_FIELDS) + ">"


def _fields(variant: Column, flat: Column, cast: Column) -> Column:
    """The line's fields as ``schema.RAW_SCHEMA``'s struct, each as text, with ``_corrupt_record``
    set when the line is not one JSON object.

    ``cast``: the variant cast to ``FIELDS_STRUCT``, a column of its own (Spark moves a field's
    read into each branch of this conditional, where an inlined cast ran once per field: 1M lines
    20 s against 7 s). A line the variant parser read as an object takes its fields from it,
    which costs less than the second parse by Spark's JSON reader every line paid before
    (docs/journal/benchmarks.md). Only another line (refused by the variant parser, or not an object) is
    read by that reader, whose corrupt-record column tells malformed JSON from a duplicate key,
    which only the variant parser refuses.
    """
    # The variant's type is read only for a line that is not flat (``{...}`` with no other bracket).
    is_object = variant.isNotNull() & (flat | F.schema_of_variant(variant).startswith("OBJECT"))
    from_variant = F.struct(*[cast[name].alias(name) for name in schema.RAW_FIELDS], F.lit(None).cast("string").alias("_corrupt_record"))
    return F.when(is_object, from_variant).otherwise(F.from_json(F.col("value"), schema.RAW_SCHEMA, JSON_OPTIONS))


def parse(bronze: DataFrame) -> DataFrame:
    """Bronze rows -> typed columns plus ``reasons``: an array of every check the row failed.

    A line that is not one strict JSON object (or not UTF-8) gets only that cause as its reason.
    """
    stages, output = _parse_plan(bronze.sparkSession)
    parsed = bronze
    for stage in stages:
        parsed = parsed.withColumns(stage)
    return parsed.select(*output)


# parse's columns: the stages added one after another (each may read the ones before), then its output.
ParsePlan = tuple[list[dict[str, Column]], list[Column | str]]


def _parse_plan(spark: SparkSession) -> ParsePlan:
    """``parse``'s columns, stage by stage, and its output, for the settings in the environment now.

    Building them is ~4,400 calls into the JVM (0.4-0.6 s of a live ingest batch's ~3 s alone,
    docs/journal/benchmarks.md); they are unresolved expressions, so every batch can reuse them.
    """
    return _built_parse_plan(type(spark).__module__, tuple(payment_types()), future_tolerance())


@cache
def _built_parse_plan(session_kind: str, allowed_types: tuple[str, ...], tolerance: str) -> ParsePlan:
    """Built once per session kind (a classic session's columns are JVM objects that a Spark Connect
    plan cannot carry) and per setting they read."""
    # In stages, each value a later check reads more than once computed once: inlined, Spark
    # evaluates an expression again at each use inside a conditional (the line's skeleton six times).
    stages: list[dict[str, Column]] = [
        {"v": F.expr("try_parse_json(value)"), "_flat": _flat_object(F.col("value"))},
        {"_cast": F.try_variant_get(F.col("v"), "$", FIELDS_STRUCT)},
        {"j": _fields(F.col("v"), F.col("_flat"), F.col("_cast"))},
    ]
    event_time_text = _text("eventTime")
    stages.append({
        "_epoch": event_time_text.rlike(EPOCH_MS),
        "_amount_text": _text("paymentAmount"),
        "_amount_kind": F.schema_of_variant(_variant("paymentAmount")),
        # Trimmed here; composed to NFC in write_classified, for the few rows with non-ASCII text.
        **{_trimmed(f): F.trim(_text(f), F.lit(EDGE_CHARACTERS)) for f in TEXT_FIELDS},
    })  # fmt: skip
    epoch = F.col("_epoch")
    stages.append({
        "_event_time": F.when(epoch, F.timestamp_millis(event_time_text.cast("long"))).when(
            event_time_text.rlike(ISO_DATE_TIME), F.expr("try_cast(j.eventTime AS timestamp)")
        ),
        "_amount_exact": F.col("_amount_text").try_cast("decimal(38, 10)"),
        "_skeleton": F.when(~F.col("_flat"), F.trim(_skeleton(F.col("value")), F.lit(WHITESPACE))),
    })  # fmt: skip
    amount_text, kind, exact = F.col("_amount_text"), F.col("_amount_kind"), F.col("_amount_exact")
    stages.append({"_amount_good": _amount_good(amount_text, kind, exact)})
    event_time = F.col("_event_time")
    amount, amount_checks = _amount_checks(F.col("value"), amount_text, kind, exact, F.col("_amount_good"))
    not_utf8 = F.col("value_bytes").isNotNull()
    malformed = F.col("j").isNull() | _text("_corrupt_record").isNotNull()
    # A blank line is never parsed into an object, so only a malformed line is trimmed to check.
    blank = malformed & (F.trim(F.col("value")) == "")
    # Spark's reader keeps the last of two equal keys; the variant parser refuses them.
    duplicate_key = F.col("v").isNull()
    trailing = ~F.col("_flat") & ~_one_object(F.col("_skeleton"), F.col("v"))
    causes: list[tuple[Column, Column]] = [
        (not_utf8, F.lit("not valid UTF-8 (bronze keeps the line's bytes in value_bytes)")),
        (
            F.octet_length("value") > MAX_LINE_BYTES,
            F.format_string(f"line too long: %,d bytes (at most {MAX_LINE_BYTES:,}; one transaction per line)", F.octet_length("value")),
        ),
        (blank, F.lit("blank line")),
        (malformed, F.lit("malformed JSON (not a JSON object on one line)")),
        (duplicate_key, F.lit("duplicate key in the JSON object (each field may appear once)")),
        (trailing, F.lit("trailing content after the JSON object (one object per line)")),
    ]
    checks: list[tuple[Column, Column]] = [
        (F.coalesce(F.col(_trimmed("transactionId")), F.lit("")) == "", F.lit("missing transactionId")),
        *_event_time_checks(event_time_text, event_time, epoch, tolerance),
        *amount_checks,
        (
            F.col(_trimmed("paymentType")).isNotNull() & ~F.col(_trimmed("paymentType")).isin(*allowed_types, ""),
            F.concat(F.lit("unknown paymentType '"), _text("paymentType"), F.lit(f"' (allowed: {', '.join(allowed_types)})")),
        ),
        # A key that is there but blank would group every such event under one empty key.
        *[(F.col(_trimmed(f)) == "", F.lit(f"blank {f} (send a value, or leave the field out)")) for f in TEXT_FIELDS if f != "transactionId"],
        *_wrong_types(F.col("_flat")),
    ]
    # A line that is not one JSON object fails every check that reads a field; report only the cause.
    cause = F.coalesce(*[F.when(cond, msg) for cond, msg in causes])
    # array_except drops the nulls and keeps codegen (F.filter is interpreted, and would drag every check with it).
    failed = F.array_except(F.array(*[F.when(cond, msg) for cond, msg in checks]), F.array(F.lit(None).cast("string")))
    # Both as columns of their own: the cause is then computed once, and the checks outside a
    # conditional, where Spark shares their common parts (1M lines: 18-19 s -> 13 s, docs/journal/benchmarks.md).
    stages.append({"_cause": cause, "_failed": failed})
    reasons = F.when(F.col("_cause").isNotNull(), F.array(F.col("_cause"))).otherwise(F.col("_failed"))
    typed = [
        event_time.alias("event_time"),
        amount.alias("payment_amount"),
        *[F.col(_trimmed(f)).alias(schema.FIELD_COLUMNS[f]) for f in TEXT_FIELDS],
    ]
    return stages, ["value", "source_file", "ingest_time", "ingest_seq", *typed, reasons.alias("reasons")]


def _trimmed(field: str) -> str:
    return f"_trimmed_{field}"


# Silver's id and key columns: compared by engine/identity.py's rule.
ID_COLUMNS = [schema.FIELD_COLUMNS[f] for f in TEXT_FIELDS]
# What a payment says (everything silver types but its id): a redelivery repeats it exactly.
CONTENT_COLUMNS = ["event_time", *[c for c in schema.FIELD_COLUMNS.values() if c != "transaction_id"]]


def _non_ascii(columns: list[str]) -> Column:
    """Some column holds a character outside ASCII (its UTF-8 is longer than its character count)."""
    return reduce(operator.or_, [F.coalesce(F.octet_length(c) != F.length(c), F.lit(False)) for c in columns])


def _composed(rows: DataFrame, needed: Column) -> DataFrame:
    """``rows`` with the ids and keys of the ``needed`` rows composed to NFC, in Python: Spark SQL has no
    Unicode normalisation, and ASCII text (nearly every row) is NFC already, so only those rows pay."""
    nfc = F.udf(composed, "string")
    return rows.where(~needed).unionByName(rows.where(needed).withColumns({c: nfc(c) for c in ID_COLUMNS}))


def content_hash() -> Column:
    """A row's content as silver keeps it, but for its id: two lines of one id whose hashes differ conflict."""
    return F.xxhash64(*CONTENT_COLUMNS)


def dedup_horizon_ms() -> int:
    """How far apart two event times of one transaction id may be and still count as a duplicate."""
    return parse_duration(env_duration(DEDUP_HORIZON_ENV, DEFAULT_DEDUP_HORIZON))


def _earlier_times(
    spark: SparkSession, lakehouse: Lakehouse, batch_id: int, ids: DataFrame, event_range: tuple[Any, Any], horizon_ms: int
) -> DataFrame | None:
    """Per transaction id of ``ids``, the event times (ms) and content hashes silver accepted it with in
    earlier batches near this batch's (``_seen``: an array of ``ms``, ``hash``); None: no file of silver
    can hold one.

    ``event_range``: the batch's valid event times, as timestamps and as epoch milliseconds.
    Earlier batches only: a replay of this batch must classify its rows exactly as before. The
    event-time bound skips files by their min/max statistics (``tables.read_near``); the semi-join on the
    batch's ids (broadcast while they are few) keeps the grouping to the ids that can repeat,
    so a batch scans two columns of the horizon instead of shuffling all of it by id, which
    cost ~1 s per batch per million rows in the horizon (docs/journal/benchmarks.md).
    """
    low, high, low_ms, high_ms = event_range
    table = tables.read_near(spark, lakehouse.silver_transactions, schema.SILVER, "event_time", low_ms - horizon_ms, high_ms + horizon_ms)
    if table is None:
        return None
    horizon = F.expr(f"INTERVAL {horizon_ms} MILLISECONDS")
    return (
        table.where(F.col("silver_batch_id") < batch_id)
        .where(F.col("event_time").between(F.lit(low) - horizon, F.lit(high) + horizon))
        .join(ids, "transaction_id", "left_semi")
        .select("transaction_id", F.struct(F.unix_millis("event_time").alias("ms"), content_hash().alias("hash")).alias("_seen"))
        .groupBy("transaction_id")
        .agg(F.collect_list("_seen").alias("_seen"))
    )


# A line's place in the order "first occurrence wins" follows; unique per bronze line.
LINE_ORDER = ["ingest_time", "source_file", "ingest_seq"]
# Repeats are broadcast to the lines when there are at most this many (as a rule there are next to none).
BROADCAST_REPEATS = 200_000


def _repeats(valid: DataFrame, earlier: DataFrame | None, horizon_ms: int) -> DataFrame:
    """The valid lines that repeat an accepted transaction id, by their ``LINE_ORDER`` (a tiny frame as a rule),
    each with ``_repeat_conflict``: its content differs from the accepted line's.

    Worked out on the ids, line positions and content hashes alone: the whole lines (JSON text,
    typed fields) are never shuffled, only joined back against this frame. The accepted line is
    an earlier batch's within the horizon if there is one (a conflict then differs from every such
    line), else this batch's first.
    """
    keys = valid.select("transaction_id", "event_time", *LINE_ORDER, content_hash().alias("_hash"))
    first = Window.partitionBy("transaction_id").orderBy(*LINE_ORDER)
    ranked = keys.withColumns({"_rank": F.row_number().over(first), "_first_hash": F.first("_hash").over(first)})
    repeated, conflict = F.col("_rank") > 1, F.col("_hash") != F.col("_first_hash")
    if earlier is not None:
        ranked = ranked.join(earlier, "transaction_id", "left")
        event_ms = F.unix_millis("event_time")
        near = F.filter("_seen", lambda seen: F.abs(seen["ms"] - event_ms) <= horizon_ms)
        ranked = ranked.withColumn("_near", F.coalesce(near, F.array()))
        repeated = repeated | (F.size("_near") > 0)
        same = F.exists("_near", lambda seen: seen["hash"] == F.col("_hash"))
        conflict = F.when(F.size("_near") > 0, ~same).otherwise(conflict)
    return ranked.where(repeated).select(
        *[F.col(c).alias(f"_repeat_{c}") for c in LINE_ORDER], F.lit(True).alias("_repeat"), conflict.alias("_repeat_conflict")
    )


@cache
def _classify_columns(session_kind: str) -> tuple[Column, Column]:
    """``write_classified``'s columns that read no setting, built once per session kind as parse's are
    (~100 ms of calls into the JVM a batch otherwise): whether a row's ids hold non-ASCII text, and the
    codes of its reasons."""
    return _non_ascii(ID_COLUMNS), reason_codes(F.col("reasons"))


def write_classified(lines: DataFrame, batch_id: int, lakehouse: Lakehouse, layer: str = "silver") -> dict[str, Any]:
    """Numbered bronze lines -> silver / quarantine / duplicates as batch ``batch_id`` of query ``layer``.

    Returns the batch's values for ``pipeline_metrics``: counts, and each step's time (``step_ms``).
    A table this batch adds nothing to gets no commit (each costs a Delta state reconstruction); a
    replay classifies identically, so it skips the same ones.
    """
    spark = lines.sparkSession
    steps = Steps()
    horizon_ms = dedup_horizon_ms()
    parsed = rows = parse(lines).withColumn("_valid", F.size("reasons") == 0).persist()
    repeats = None
    try:
        non_ascii_ids, codes = _classify_columns(type(spark).__module__)
        valid_time = F.when(F.col("_valid"), F.col("event_time"))
        needs_nfc = F.col("_valid") & non_ascii_ids
        with steps("parse"):
            low, high, low_ms, high_ms, valid_n, total, non_ascii = rows.agg(
                F.min(valid_time), F.max(valid_time), F.unix_millis(F.min(valid_time)), F.unix_millis(F.max(valid_time)),
                F.count(F.when(F.col("_valid"), 1)), F.count(F.lit(1)), F.count(F.when(needs_nfc, 1)),
            ).first()  # fmt: skip
        if non_ascii:
            rows = _composed(parsed, needs_nfc).persist()  # built from the cached parse, kept until the end
        valid = rows.where("_valid")
        ids = valid.select("transaction_id")
        with steps("dedup"):
            earlier = _earlier_times(spark, lakehouse, batch_id, ids, (low, high, low_ms, high_ms), horizon_ms) if low is not None else None
            repeats = _repeats(valid, earlier, horizon_ms).persist()
            repeated_n = repeats.count()
        # Null-safe: lines built by hand (tests, notebooks) may lack an ingest time.
        same_line = [F.col(c).eqNullSafe(F.col(f"_repeat_{c}")) for c in LINE_ORDER]
        joined = rows.join(F.broadcast(repeats) if repeated_n <= BROADCAST_REPEATS else repeats, same_line, "left")
        classified = joined.withColumn(
            "_class",
            F.when(~F.col("_valid"), "quarantined")
            .when(F.col("_repeat").isNotNull(), "duplicates")
            .otherwise("accepted"),
        )
        counts = {"accepted": valid_n - repeated_n, "quarantined": total - valid_n, "duplicates": repeated_n}
        batch = batch_column("silver_batch_id", batch_id)
        outputs = [
            ("accepted", lakehouse.silver_transactions, "transactions",
             [*[c for c in schema.SILVER.fieldNames() if c != "silver_batch_id"], batch]),
            ("quarantined", lakehouse.silver_quarantine, "quarantine",
             ["value", F.concat_ws("; ", "reasons").alias("reason"), codes.alias("reason_code"),
              "source_file", "ingest_time", batch]),
            ("duplicates", lakehouse.silver_duplicates, "duplicates",
             ["transaction_id", "value", "source_file", "ingest_time", batch, F.col("_repeat_conflict").alias("conflict")]),
        ]  # fmt: skip
        together([
            steps.timed(sink, partial(append_once, classified.where(F.col("_class") == name).select(*columns), path,
                                      sink_name(layer, sink), batch_id, rows=counts[name]))
            for name, path, sink, columns in outputs
        ])  # fmt: skip
    finally:
        if repeats is not None:
            repeats.unpersist()
        rows.unpersist()
        parsed.unpersist()
    accepted, quarantined, duplicates = (counts[k] for k in ("accepted", "quarantined", "duplicates"))
    return {
        "rows_in": accepted + quarantined + duplicates,
        "rows_out": accepted,
        "quarantined": quarantined,
        "duplicates": duplicates,
        "rows_written": {lakehouse.name_of(path): counts[name] for name, path, _, _ in outputs},
        "step_ms": steps.ms,
    }


def process_batch(batch: DataFrame, batch_id: int, lakehouse: Lakehouse, recorder: Recorder) -> None:
    """One bronze micro-batch -> silver / quarantine / duplicates, each write idempotent."""
    started = time.time()
    counts = write_classified(batch, batch_id, lakehouse)
    recorder.record(batch.sparkSession, batch_id, started, **counts)


def ensure_silver_tables(spark: SparkSession, lakehouse: Lakehouse) -> None:
    """Silver's tables and the pipeline metrics (created together, as gold's are)."""
    with first_commit.settings_read_once(spark):
        together([
            partial(ensure_metrics_table, spark, lakehouse),
            # Statistics for the duplicate lookup (batch, event time), explaining an alert (time, id, key, ingest time).
            partial(
                tables.ensure_table, spark, lakehouse.silver_transactions, schema.SILVER, "Typed, validated, de-duplicated transactions",
                stats_columns=["event_time", "silver_batch_id", "transaction_id", "payee_id", "ingest_time"],
            ),
            partial(tables.ensure_table, spark, lakehouse.silver_quarantine, schema.QUARANTINE, "Bronze lines that failed validation, with reasons"),
            partial(tables.ensure_table, spark, lakehouse.silver_duplicates, schema.DUPLICATES, "Repeated transaction ids (first occurrence wins)"),
        ])  # fmt: skip


def start_silver(
    spark: SparkSession,
    lakehouse: Lakehouse,
    available_now: bool = True,
    processing_time: str | None = None,
    recorder: Recorder | None = None,
) -> StreamingQuery:
    """Bronze's new lines classified into silver's tables; each batch's metrics row is committed at
    once unless ``recorder`` gathers them."""
    ensure_silver_tables(spark, lakehouse)
    recorder = recorder or Recorder(lakehouse, "silver")
    writer = (
        tables.read_stream(spark.readStream.format("delta"), lakehouse.bronze_transactions)
        .writeStream.queryName("rulewatch_silver")
        .option("checkpointLocation", lakehouse.checkpoint("silver"))
        .foreachBatch(per_run(lambda df, batch_id: process_batch(df, batch_id, lakehouse, recorder)))
    )
    writer = writer.trigger(availableNow=True) if available_now else writer.trigger(processingTime=processing_time or "1 second")
    return writer.start()
