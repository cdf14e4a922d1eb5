"""The ``config/rules`` Delta table: one row per rule, change data feed on.

Rules reach the running evaluator only through this table's change feed, so a rules file is
applied by MERGE-ing it in; SQL edits by analysts take exactly the same path. The table has no
constraint beyond a non-null ``ruleId``: a row that is valid SQL but not a valid rule can be
written, and the evaluator quarantines it into ``config/rule_errors`` instead of running it.

Also here: exporting the table back to a rules file, and ``gold/rule_history``, an audit trail
of every change built from the change data feed.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal, localcontext
from typing import Any

import delta.exceptions as delta_errors
from pyspark.errors import SparkRuntimeException
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.types import BooleanType, StringType, StructField, StructType

from rulewatch.spark.storage import schema, tables
from rulewatch.spark.storage.lakehouse import Lakehouse, holding
from rulewatch.engine.rules import Rule, RuleError, RuleSetError, RuleState, format_duration, load_rules_file, parse_rule
from rulewatch.spark.storage.sinks import HISTORY_SINK, append_once, per_run

# Delta records this session setting in each commit's ``userMetadata``; apply_rules tags its MERGE
# with it so the history can name who deleted a rule (a delete leaves no post-image to stamp).
USER_METADATA_CONF = "spark.databricks.delta.commitInfo.userMetadata"
HISTORY_QUERY = "rulewatch_rule_history"
_LIMIT_TYPE = schema.RULES["limit"].dataType  # decimal(38, 10)


def rule_row(rule: Rule) -> dict[str, Any]:
    """A rule as a ``config/rules`` row (reference JSON names, window as a duration string)."""
    return {
        "ruleId": rule.rule_id,
        "ruleState": rule.state.value,
        "groupingKeyNames": list(rule.grouping_keys),
        "aggregateFieldName": rule.aggregate_field,
        "aggregatorFunctionType": rule.aggregator.value,
        "limitOperatorType": rule.operator.value,
        "limit": Decimal(rule.limit),
        "window": format_duration(rule.window_ms),
        "filter": dict(rule.filter) or None,
        "cooldown": format_duration(rule.cooldown_ms) if rule.cooldown_ms else None,
        "reportNewValuesOnly": rule.report_new_values_only or None,
        "bucket": format_duration(rule.bucket_ms) if rule.bucket_ms else None,
        "description": rule.description or None,
    }


def ensure_rules_table(spark: SparkSession, lakehouse: Lakehouse) -> None:
    tables.ensure_table(
        spark,
        lakehouse.rules,
        schema.RULES,
        "Fraud rules as data: one row per rule; the running evaluator follows its change feed",
        {"delta.enableChangeDataFeed": "true"},
    )


@dataclass(frozen=True)
class RuleChange:
    rule_id: int
    action: str  # added | updated | deleted | unchanged
    detail: str = ""

    def __str__(self) -> str:
        return f"rule {self.rule_id}: {self.action}{' (' + self.detail + ')' if self.detail else ''}"


# ------------------------------------------------------------------------------- rows as rule JSON


def _number_json(value: Decimal) -> int | float | str:
    """A stored limit as a JSON number that parses back to an equal Decimal (``1000``, not ``1000.0000000000``)."""
    with localcontext() as ctx:
        ctx.prec = 100  # decimal(38, 10) has up to 38 digits; the default 28 would round
        value = value.normalize()
        if value == value.to_integral_value():
            return int(value)
    as_float = float(value)
    if Decimal(repr(as_float)) == value:
        return as_float
    return format(value, "f")  # more digits than a float carries: a numeric string stays exact


def row_to_rule_json(row: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config/rules`` row as a reference JSON rule (null columns left out, limit as a number).

    The row is converted, not validated: a row an analyst made invalid with SQL comes out as stored.
    """
    out: dict[str, Any] = {}
    for name in schema.RULE_FIELDS:
        value = row.get(name)
        if value is None:
            continue
        if isinstance(value, Decimal):
            value = _number_json(value)
        elif isinstance(value, Mapping):
            value = dict(sorted(value.items()))
        elif isinstance(value, (list, tuple)):
            value = list(value)
        out[name] = value
    return out


def _stored_rule(stored: Mapping[str, Any]) -> Rule | None:
    try:
        return parse_rule(stored)
    except RuleError:
        return None


_PLAIN = re.compile(r"[A-Za-z0-9_.:+-]{1,60}")


def _show(value: Any) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, str) and _PLAIN.fullmatch(value):
        return value
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def field_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """``"limit 1000 -> 1200, window 1h -> 2h"``: every rule field whose value differs."""
    return ", ".join(
        f"{name} {_show(old.get(name))} -> {_show(new.get(name))}"
        for name in schema.RULE_FIELDS
        if name != "ruleId" and old.get(name) != new.get(name)
    )


# ------------------------------------------------------------------------------------------ apply


def _fits_limit_column(limit: Decimal) -> bool:
    scale, whole_digits = _LIMIT_TYPE.scale, _LIMIT_TYPE.precision - _LIMIT_TYPE.scale
    with localcontext() as ctx:
        ctx.prec = 100
        return abs(limit) < Decimal(10) ** whole_digits and limit == limit.quantize(Decimal(1).scaleb(-scale))


def _check_storable(rules: list[Rule]) -> None:
    """What the parser accepts but the table cannot hold exactly; raised before anything is written."""
    errors: list[RuleError] = []
    seen: set[int] = set()
    for rule in rules:
        if rule.rule_id in seen:
            errors.append(RuleError(rule.rule_id, "ruleId", "is given more than once"))
        seen.add(rule.rule_id)
        if not _fits_limit_column(rule.limit):
            errors.append(RuleError(
                rule.rule_id, "limit",
                f"has {rule.limit}; allowed: at most {_LIMIT_TYPE.precision - _LIMIT_TYPE.scale} digits before "
                f"the decimal point and {_LIMIT_TYPE.scale} after (config/rules stores {_LIMIT_TYPE.simpleString()})",
            ))  # fmt: skip
    if errors:
        raise RuleSetError(errors, [""] * len(errors))


class RulesConflict(RuntimeError):
    """Another writer changed ``config/rules`` while an apply ran; the apply wrote nothing."""

    def __init__(self, path: str) -> None:
        super().__init__(
            f"config/rules ({path}) was changed by another writer while this apply ran; "
            "nothing of this apply was written; run it again"
        )


# Delta's optimistic concurrency failures; in Python they share no base class of their own.
_DELTA_CONFLICTS = (
    delta_errors.DeltaConcurrentModificationException,
    delta_errors.ConcurrentWriteException,
    delta_errors.MetadataChangedException,
    delta_errors.ProtocolChangedException,
    delta_errors.ConcurrentAppendException,
    delta_errors.ConcurrentDeleteReadException,
    delta_errors.ConcurrentDeleteDeleteException,
    delta_errors.ConcurrentTransactionException,
)
# Raised by the MERGE itself when a rule it touches is no longer the row apply read (see _merge).
_STALE_READ = "rulewatch: config/rules changed since apply read it"


def _row_json(alias: str) -> str:
    """SQL for a whole config/rules row as JSON text: the same text means the row was not rewritten."""
    return "to_json(struct(" + ", ".join(f"{alias}.`{c}`" for c in schema.RULES.fieldNames()) + "))"


def _current_rules(spark: SparkSession, lakehouse: Lakehouse) -> dict[int, tuple[dict[str, Any], str]]:
    """ruleId -> (the stored row as rule JSON, the row as _merge's guard sees it)."""
    columns = ", ".join(f"t.`{c}`" for c in schema.RULE_FIELDS)
    rows = spark.sql(f"SELECT {columns}, {_row_json('t')} AS seen FROM {tables.table_ref(lakehouse.rules)} t").collect()
    return {row["ruleId"]: (row_to_rule_json(row.asDict(recursive=True)), row["seen"]) for row in rows}


def _change(rule: Rule, old: dict[str, Any] | None) -> RuleChange:
    if rule.state is RuleState.DELETE:
        return RuleChange(rule.rule_id, "deleted") if old is not None else RuleChange(rule.rule_id, "unchanged", "not in the table")
    if old is None:
        return RuleChange(rule.rule_id, "added")
    if _stored_rule(old) == rule:
        return RuleChange(rule.rule_id, "unchanged")
    return RuleChange(rule.rule_id, "updated", field_diff(old, row_to_rule_json(rule_row(rule))) or "stored row was not a valid rule")


def _source_row(rule: Rule, change: RuleChange, seen: str | None) -> dict[str, Any]:
    upsert = change.action in ("added", "updated")
    body = rule_row(rule) if upsert else {"ruleId": rule.rule_id}
    return {**body, "_delete": change.action == "deleted", "_upsert": upsert, "_seen": seen}


def apply_rules(spark: SparkSession, lakehouse: Lakehouse, rules: list[Rule], updated_by: str | None = None) -> list[RuleChange]:
    """MERGE ``rules`` into ``config/rules``: insert new, update changed, delete ``ruleState: DELETE``.

    A stored row counts as unchanged when it parses to the same rule (``windowMinutes: 60`` and
    ``window: "1h"`` are the same rule), so re-applying a file, or applying an export, adds no
    commit and the evaluator sees no spurious change. A stored row that is not a valid rule (an
    analyst's SQL edit) is always overwritten. Nothing is written if any rule cannot be stored.

    The changes are worked out from one read of the table and written by one MERGE; if another
    writer changed any rule of ``rules`` in between, or commits while the MERGE runs, the MERGE
    writes nothing and RulesConflict is raised. The first apply on a lakehouse also creates the
    (empty) table, in a commit of its own that stays even then.
    """
    _check_storable(rules)
    try:
        ensure_rules_table(spark, lakehouse)
        current = _current_rules(spark, lakehouse)
        changes: list[RuleChange] = []
        source: list[dict[str, Any]] = []
        for rule in rules:
            old, seen = current.get(rule.rule_id, (None, None))
            changes.append(_change(rule, old))
            source.append(_source_row(rule, changes[-1], seen))
        if any(change.action != "unchanged" for change in changes):
            _merge(spark, lakehouse, source, updated_by or getpass.getuser())
    except _DELTA_CONFLICTS as err:
        raise RulesConflict(lakehouse.rules) from err
    except SparkRuntimeException as err:  # raise_error's USER_RAISED_EXCEPTION: ours only if it carries our text
        if _STALE_READ not in str(err):
            raise
        raise RulesConflict(lakehouse.rules) from err
    return changes


def _merge_source(spark: SparkSession, source_rows: list[dict[str, Any]], who: str) -> DataFrame:
    """Every rule of the file as a config/rules row plus what apply decided (``_delete``, ``_upsert``) and saw (``_seen``)."""
    flags = [StructField("_delete", BooleanType()), StructField("_upsert", BooleanType()), StructField("_seen", StringType())]
    return spark.createDataFrame(source_rows, StructType([*schema.RULES.fields, *flags])).withColumns(
        {"updated_at": F.current_timestamp(), "updated_by": F.lit(who)}
    )


def _merge(spark: SparkSession, lakehouse: Lakehouse, source_rows: list[dict[str, Any]], who: str) -> None:
    """One MERGE of every rule of the file, guarded against what changed since the table was read.

    Every rule's source row carries ``_seen``, its stored row as read (null: absent). A rule whose
    row differs now, or has appeared or disappeared, aborts the MERGE through ``raise_error``
    before anything is committed: Delta's own conflict check only covers commits made after the
    MERGE started, not those between the read and the MERGE.
    """
    # A name of its own per call: temp views are per session, and two applies may share one.
    view = f"rulewatch_rules_source_{uuid.uuid4().hex}"
    _merge_source(spark, source_rows, who).createOrReplaceTempView(view)
    assignments = ", ".join(f"`{c}` = s.`{c}`" for c in schema.RULES.fieldNames())
    columns = ", ".join(f"`{c}`" for c in schema.RULES.fieldNames())
    values = ", ".join(f"s.`{c}`" for c in schema.RULES.fieldNames())
    stale = f"raise_error('{_STALE_READ}')"
    # A running stream has a clone of the session, so the tag cannot leak into it; one started meanwhile
    # clones the tag too, but every append of ours names its batch in its own userMetadata, which wins.
    previous = spark.conf.get(USER_METADATA_CONF, None)
    try:
        spark.conf.set(USER_METADATA_CONF, json.dumps({"rulewatch": "rules apply", "updated_by": who}))
        tagged = True
    except Exception:  # a platform that forbids setting it: the history then names no deleter
        tagged = False
    try:
        spark.sql(
            f"MERGE INTO {tables.table_ref(lakehouse.rules)} t USING {view} s ON t.ruleId = s.ruleId "
            f"WHEN MATCHED AND NOT (s._seen <=> {_row_json('t')}) THEN UPDATE SET `updated_by` = {stale} "
            f"WHEN MATCHED AND s._delete THEN DELETE "
            f"WHEN MATCHED AND s._upsert THEN UPDATE SET {assignments} "
            f"WHEN NOT MATCHED AND s._seen IS NOT NULL THEN INSERT (`ruleId`) VALUES (CAST({stale} AS INT)) "
            f"WHEN NOT MATCHED AND s._upsert THEN INSERT ({columns}) VALUES ({values})"
        )
    finally:
        if tagged and previous is None:
            spark.conf.unset(USER_METADATA_CONF)
        elif tagged:
            spark.conf.set(USER_METADATA_CONF, previous)
        spark.catalog.dropTempView(view)


def apply_rules_file(spark: SparkSession, lakehouse: Lakehouse, path: str | os.PathLike[str], updated_by: str | None = None) -> list[RuleChange]:
    """Validate the whole file first (nothing is written if any rule is bad), then MERGE it in."""
    return apply_rules(spark, lakehouse, checked_rules_file(path), updated_by)


def checked_rules_file(path: str | os.PathLike[str]) -> list[Rule]:
    """The file's rules, each valid and storable in config/rules exactly; else RuleSetError naming the file.
    Needs no Spark: a run checks its file before anything starts."""
    rules = load_rules_file(path)
    try:
        _check_storable(rules)
    except RuleSetError as exc:
        raise RuleSetError(exc.errors, exc.locations, exc.source or os.fspath(path)) from None
    return rules


# ----------------------------------------------------------------------------------------- export


def rules_table_exists(spark: SparkSession, lakehouse: Lakehouse) -> bool:
    return tables.exists(spark, lakehouse.rules)


def export_rules(spark: SparkSession, lakehouse: Lakehouse) -> list[dict[str, Any]]:
    """Every row of ``config/rules`` as a reference JSON rule, ordered by ruleId ([] if no table).

    Applying the export changes nothing. Rows are exported as stored, so a row made invalid by SQL
    comes out invalid (and applying the export then fails validation until it is fixed).
    """
    if not rules_table_exists(spark, lakehouse):
        return []
    rows = tables.read(spark, lakehouse.rules).select(*schema.RULE_FIELDS).collect()
    return sorted((row_to_rule_json(row.asDict(recursive=True)) for row in rows), key=lambda r: r["ruleId"])


def rules_to_json_text(rules: Iterable[Mapping[str, Any] | Rule]) -> str:
    """A rules file: a JSON array ordered by ruleId, one field per line (lists and filters inline)."""
    items = sorted((r.to_json() if isinstance(r, Rule) else dict(r) for r in rules), key=lambda r: r["ruleId"])
    if not items:
        return "[]\n"
    blocks = [
        "  {\n" + ",\n".join(f"    {json.dumps(k)}: {json.dumps(v, ensure_ascii=False, default=str)}" for k, v in item.items()) + "\n  }"
        for item in items
    ]
    return "[\n" + ",\n".join(blocks) + "\n]\n"


# ------------------------------------------------------------------------------------ rule history


def ensure_rule_history_table(spark: SparkSession, lakehouse: Lakehouse) -> None:
    tables.ensure_table(
        spark,
        lakehouse.rule_history,
        schema.RULE_HISTORY,
        "Every change of config/rules (from its change data feed): who, when, the rule before and after",
    )


def _image_json(image: Mapping[str, Any] | None) -> str | None:
    return None if image is None else json.dumps(row_to_rule_json(image), ensure_ascii=False)


def _stamp(image: Mapping[str, Any]) -> tuple[Any, Any]:
    return image.get("updated_by"), image.get("updated_at")


def history_rows(changes: Iterable[Mapping[str, Any]], commit_authors: Mapping[int, str | None] | None = None) -> list[dict[str, Any]]:
    """``gold/rule_history`` rows from change-data-feed rows (rule columns + ``_change_type``,
    ``_commit_version``, ``_commit_timestamp``).

    Update pre- and post-images pair up by (ruleId, commit version). An image left unpaired (an
    UPDATE that changed a ruleId) is what it amounts to: the old id deleted, the new id inserted.
    ``updated_by`` is the row's own stamp when this commit set it, else the commit's author from
    ``commit_authors`` (Delta's userName, or apply_rules' tag), else null: a SQL edit that leaves
    ``updated_by`` alone is not attributed to the previous editor.
    """
    authors = commit_authors or {}
    groups: dict[tuple[int, int], dict[str, list[Mapping[str, Any]]]] = {}
    for change in changes:
        key = (int(change["_commit_version"]), int(change["ruleId"]))
        groups.setdefault(key, {}).setdefault(str(change["_change_type"]), []).append(change)

    def row(kind: str, version: int, before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> dict[str, Any]:
        image = after if after is not None else before
        assert image is not None
        stamped = after is not None and after.get("updated_by") is not None and (before is None or _stamp(before) != _stamp(after))
        return {
            "rule_id": int(image["ruleId"]),
            "change": kind,
            "commit_version": version,
            "commit_timestamp": image.get("_commit_timestamp"),
            "updated_by": after["updated_by"] if stamped else authors.get(version),
            "before": _image_json(before),
            "after": _image_json(after),
        }

    out: list[dict[str, Any]] = []
    for (version, _), kinds in sorted(groups.items()):
        # Several images of one ruleId in one commit only happen with duplicate ids; order them
        # deterministically so a replayed batch pairs them the same way.
        pre = sorted(kinds.get("update_preimage", []), key=lambda r: _image_json(r) or "")
        post = sorted(kinds.get("update_postimage", []), key=lambda r: _image_json(r) or "")
        out += [row("updated", version, old, new) for old, new in zip(pre, post)]
        out += [row("deleted", version, old, None) for old in [*pre[len(post):], *kinds.get("delete", [])]]
        out += [row("inserted", version, None, new) for new in [*post[len(pre):], *kinds.get("insert", [])]]
    order = {"deleted": 0, "updated": 1, "inserted": 2}
    return sorted(out, key=lambda r: (r["commit_version"], r["rule_id"], order[r["change"]]))


def _metadata_author(user_metadata: str | None) -> str | None:
    try:
        tag = json.loads(user_metadata) if user_metadata else None
    except ValueError:
        return None
    return tag.get("updated_by") if isinstance(tag, dict) and tag.get("rulewatch") else None


def _commit_authors(spark: SparkSession, lakehouse: Lakehouse, versions: set[int]) -> dict[int, str | None]:
    """Who made each commit: Delta's userName where the platform records one (Databricks), else
    the updated_by that apply_rules tagged the commit with."""
    history = (
        spark.sql(f"DESCRIBE HISTORY {tables.table_ref(lakehouse.rules)}")
        .where(F.col("version").isin(sorted(versions)))
        .select("version", "userName", "userMetadata")
        .collect()
    )
    return {int(r["version"]): r["userName"] or _metadata_author(r["userMetadata"]) for r in history}


def write_rule_history_batch(changes: DataFrame, batch_id: int, lakehouse: Lakehouse) -> None:
    """One micro-batch of the rules change feed into ``gold/rule_history`` (idempotent per batch id).

    The rules table is small and so is its feed: the batch is paired on the driver.
    """
    records = [r.asDict(recursive=True) for r in changes.collect()]
    if not records:
        return
    spark = changes.sparkSession
    rows = history_rows(records)
    unattributed = {r["commit_version"] for r in rows if r["updated_by"] is None}
    if unattributed:
        rows = history_rows(records, _commit_authors(spark, lakehouse, unattributed))
    append_once(spark.createDataFrame(rows, schema.RULE_HISTORY), lakehouse.rule_history, HISTORY_SINK, batch_id)


def rule_change_feed(spark: SparkSession, lakehouse: Lakehouse, starting_version: int = 0) -> DataFrame:
    """The rules table's change data feed as a stream, from ``starting_version``: by default every change ever made."""
    return tables.read_stream(
        spark.readStream.format("delta").option("readChangeFeed", "true"), lakehouse.rules, starting_version=starting_version
    )


def start_rule_history(
    spark: SparkSession, lakehouse: Lakehouse, available_now: bool = True, processing_time: str | None = None
) -> StreamingQuery:
    """Stream the rules table's change data feed (from version 0) into ``gold/rule_history``."""
    ensure_rules_table(spark, lakehouse)
    ensure_rule_history_table(spark, lakehouse)
    changes = rule_change_feed(spark, lakehouse).select(
        *schema.RULES.fieldNames(), "_change_type", "_commit_version", "_commit_timestamp"
    )
    writer = (
        changes.writeStream.queryName(HISTORY_QUERY)
        .option("checkpointLocation", lakehouse.checkpoint("rule_history"))
        .foreachBatch(per_run(lambda df, batch_id: write_rule_history_batch(df, batch_id, lakehouse)))
    )
    writer = writer.trigger(availableNow=True) if available_now else writer.trigger(processingTime=processing_time or "10 seconds")
    return writer.start()


def run_rule_history(spark: SparkSession, lakehouse: Lakehouse) -> None:
    """Bring ``gold/rule_history`` up to date with every commit so far, then return."""
    with holding(lakehouse, "rule history run"):
        finish_rule_history(start_rule_history(spark, lakehouse, available_now=True))


def finish_rule_history(query: StreamingQuery) -> None:
    """Wait for a rule history query started with ``available_now`` to end; raise if it failed."""
    query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"rule history query failed: {query.exception()}")


def latest_rule_history(spark: SparkSession, lakehouse: Lakehouse, limit: int = 20) -> list[Row]:
    """The last ``limit`` changes, oldest first."""
    newest_first = (
        tables.read(spark, lakehouse.rule_history)
        .orderBy(F.desc("commit_version"), F.desc("rule_id"), F.desc("change"))
        .limit(limit)
        .collect()
    )
    return newest_first[::-1]
