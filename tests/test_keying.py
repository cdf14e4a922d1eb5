"""Dynamic keying: one row per (event, keyset), unambiguous keys."""

from __future__ import annotations

import random

from pyspark.sql import functions as F


def test_group_keys_of_different_values_never_collide(spark):
    """("a|b", "c") and ("a", "b|c") joined naively would both be "a|b|c"."""
    from rulewatch.spark.evaluator.keying import fan_out

    events = spark.createDataFrame(
        [("t1", "a|b", "c"), ("t2", "a", "b|c"), ("t3", "a\\", "|c")], "transaction_id string, payee_id string, beneficiary_id string"
    )
    for column in ("payment_amount", "payment_type", "user_id", "ip", "action"):
        events = events.withColumn(column, F.lit(None).cast("string"))
    keysets = spark.createDataFrame([(["payeeId", "beneficiaryId"],)], "groupingKeyNames array<string>")
    keys = {r.transaction_id: r.group_key for r in fan_out(events, keysets, [0, 1, 2, 3]).collect()}
    assert len(set(keys.values())) == 3
    assert keys["t1"] == "a\\|b|c"


def test_every_event_is_routed_once_per_keyset_it_has_all_fields_of(spark):
    """Against keys built in Python from the collected rows: nulls drop the event from that keyset
    only, an unknown field name routes nothing, money is keyed by its text, parts keep their order, and a
    keyset longer than the fields there are (an invalid rule's: a field named twice) routes nothing."""
    from decimal import Decimal

    from rulewatch.spark.evaluator.keying import fan_out
    from rulewatch.spark.storage.schema import FIELD_COLUMNS

    rng = random.Random(7)
    values = ["a", "b|c", "d\\", "", None]
    rows = [
        (f"t{i}", rng.choice(values), rng.choice(values), rng.choice([Decimal("1.50"), Decimal("-0.05"), None]), rng.choice(values), "u1", None, "pay")
        for i in range(300)
    ]
    events = spark.createDataFrame(
        rows,
        "transaction_id string, payee_id string, beneficiary_id string, payment_amount decimal(12,2), "
        "payment_type string, user_id string, ip string, action string",
    )
    names = [["payeeId"], ["beneficiaryId", "payeeId"], ["paymentAmount", "paymentType"], ["userId", "action"], ["ip"], ["payeeId", "nope"],
             ["payeeId"] * (len(FIELD_COLUMNS) + 1)]
    keysets = spark.createDataFrame([(n,) for n in names], "groupingKeyNames array<string>")

    def text(value):
        return None if value is None else str(value).replace("\\", "\\\\").replace("|", "\\|")

    expected = set()
    for row in rows:
        by_field = dict(zip(FIELD_COLUMNS, row))
        for keyset in names:
            parts = [text(by_field.get(name)) for name in keyset]
            if None not in parts and len(keyset) <= len(FIELD_COLUMNS):
                expected.add((row[0], ",".join(keyset), "|".join(parts)))
    got = fan_out(events, keysets, [0, 1, 2, 3]).select("transaction_id", "keyset", "group_key").collect()
    assert len(got) == len(expected)
    assert set(map(tuple, got)) == expected
    assert any(keyset == "beneficiaryId,payeeId" for _, keyset, _ in expected)
