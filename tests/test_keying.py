"""Dynamic keying: one row per (event, keyset), unambiguous keys."""

from __future__ import annotations

from pyspark.sql import functions as F


def test_group_keys_of_different_values_never_collide(spark):
    """("a|b", "c") and ("a", "b|c") joined naively would both be "a|b|c"."""
    from rulewatch.spark.keying import fan_out

    events = spark.createDataFrame(
        [("t1", "a|b", "c"), ("t2", "a", "b|c"), ("t3", "a\\", "|c")], "transaction_id string, payee_id string, beneficiary_id string"
    )
    for column in ("payment_amount", "payment_type", "user_id", "ip", "action"):
        events = events.withColumn(column, F.lit(None).cast("string"))
    keysets = spark.createDataFrame([(["payeeId", "beneficiaryId"],)], "groupingKeyNames array<string>")
    keys = {r.transaction_id: r.group_key for r in fan_out(events, keysets, 4).collect()}
    assert len(set(keys.values())) == 3
    assert keys["t1"] == "a\\|b|c"
