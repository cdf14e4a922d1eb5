"""The ``config/rules`` Delta table: one row per rule, change data feed on.

Rules reach the running evaluator only through this table's change feed, so a rules file is
applied by MERGE-ing it in; SQL edits by analysts take exactly the same path.
"""

from __future__ import annotations

import getpass
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, StructField, StructType

from rulewatch import schema
from rulewatch.lakehouse import Lakehouse
from rulewatch.rules import Rule, RuleState, format_duration, load_rules_file
from rulewatch.sinks import ensure_table, table_ref


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
    ensure_table(
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


def _diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    changed = [k for k in new if k != "ruleId" and _norm(old.get(k)) != _norm(new.get(k))]
    return ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in changed)


def _norm(value: Any) -> Any:
    if isinstance(value, Decimal):
        return value.normalize()
    if isinstance(value, dict):
        return sorted(value.items())
    return value


def apply_rules(spark: SparkSession, lakehouse: Lakehouse, rules: list[Rule], updated_by: str | None = None) -> list[RuleChange]:
    """MERGE ``rules`` into ``config/rules``: insert new, update changed, delete ``ruleState: DELETE``.

    Only rules that actually change are written, so re-applying the same file adds no commit and
    the evaluator sees no spurious change.
    """
    ensure_rules_table(spark, lakehouse)
    current = {
        row["ruleId"]: row.asDict(recursive=True)
        for row in spark.read.format("delta").load(lakehouse.rules).select(*schema.RULE_FIELDS).collect()
    }
    changes: list[RuleChange] = []
    upserts: list[dict[str, Any]] = []
    deletes: list[int] = []
    for rule in rules:
        row = rule_row(rule)
        old = current.get(rule.rule_id)
        if rule.state is RuleState.DELETE:
            if old is not None:
                deletes.append(rule.rule_id)
                changes.append(RuleChange(rule.rule_id, "deleted"))
            continue
        if old is None:
            changes.append(RuleChange(rule.rule_id, "added"))
            upserts.append(row)
        elif detail := _diff(old, row):
            changes.append(RuleChange(rule.rule_id, "updated", detail))
            upserts.append(row)
        else:
            changes.append(RuleChange(rule.rule_id, "unchanged"))
    if upserts or deletes:
        who = updated_by or getpass.getuser()
        source = spark.createDataFrame(
            [{**row, "_delete": False} for row in upserts] + [{"ruleId": rid, "_delete": True} for rid in deletes],
            StructType([*schema.RULES.fields, StructField("_delete", BooleanType())]),
        ).withColumns({"updated_at": F.current_timestamp(), "updated_by": F.lit(who)})
        view = "rulewatch_rules_source"
        source.createOrReplaceTempView(view)
        assignments = ", ".join(f"`{c}` = s.`{c}`" for c in schema.RULES.fieldNames())
        columns = ", ".join(f"`{c}`" for c in schema.RULES.fieldNames())
        values = ", ".join(f"s.`{c}`" for c in schema.RULES.fieldNames())
        spark.sql(
            f"MERGE INTO {table_ref(lakehouse.rules)} t USING {view} s ON t.ruleId = s.ruleId "
            f"WHEN MATCHED AND s._delete THEN DELETE "
            f"WHEN MATCHED THEN UPDATE SET {assignments} "
            f"WHEN NOT MATCHED AND NOT s._delete THEN INSERT ({columns}) VALUES ({values})"
        )
        spark.catalog.dropTempView(view)
    return changes


def apply_rules_file(spark: SparkSession, lakehouse: Lakehouse, path: str) -> list[RuleChange]:
    """Validate the whole file first (nothing is written if any rule is bad), then MERGE it in."""
    return apply_rules(spark, lakehouse, load_rules_file(path))
