"""Live ingest: bronze and silver in one micro-batch, so an event crosses one query less before gold.

The batch job keeps bronze and silver as separate tasks (each retried on its own); live mode
(``rulewatch stream`` / ``demo``) runs this one query instead: every landing micro-batch is
appended to ``bronze/transactions`` and, at the same time, classified into silver / quarantine /
duplicates in the same ``foreachBatch``, each write idempotent per batch (sinks ``rulewatch.ingest.*``), with
both layers' ``pipeline_metrics`` rows kept for a commit that gathers several batches' (metrics.Recorder).
Both ways read every landed file, so a lakehouse is ingested one way only (checkpoints.check_queries
refuses the other).
"""

from __future__ import annotations

import time
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

from rulewatch.spark.layers import bronze, silver
from rulewatch.spark.storage.lakehouse import Lakehouse
from rulewatch.spark.storage.metrics import Recorder, Steps, metrics_row
from rulewatch.spark.storage.sinks import per_run, together

QUERY = "ingest"


def write_batch(batch: DataFrame, batch_id: int, lakehouse: Lakehouse, recorder: Recorder, source: bronze.Source) -> None:
    started = time.time()
    steps = Steps()  # bronze's; silver times its own
    with steps("landing"):
        lines = bronze.numbered(bronze.landed(batch, source, lakehouse.checkpoint(QUERY))).persist()
    try:
        done: dict[str, Any] = {}

        def to_bronze() -> None:
            with steps("append"):
                bronze.append(lines, lakehouse, batch_id, layer=QUERY)
            done["bronze"] = time.time()

        def to_silver() -> None:
            done["counts"] = silver.write_classified(lines, batch_id, lakehouse, layer=QUERY)
            done["silver"] = time.time()

        # Silver classifies the batch's lines, not bronze's table: the two layers are written at once.
        together([to_bronze, to_silver])
        counts = done["counts"]
        landed = counts["rows_in"]  # silver classifies every line: no separate count job
        rows = [
            metrics_row("bronze", batch_id, started, done["bronze"], step_ms=steps.ms, **bronze.landed_counts(lakehouse, landed)),
            metrics_row("silver", batch_id, started, done["silver"], **counts),
        ]
        recorder.record_rows(batch.sparkSession, batch_id, rows)
    finally:
        lines.unpersist()


def start_ingest(spark: SparkSession, source: bronze.Source, lakehouse: Lakehouse, processing_time: str, recorder: Recorder) -> StreamingQuery:
    """Landing folder or Kafka topic -> bronze + silver continuously (the tables must exist: ``ensure_all_tables``)."""
    silver.ensure_silver_tables(spark, lakehouse)
    return (
        bronze.read_source(spark, source)
        .writeStream.queryName("rulewatch_ingest")
        .option("checkpointLocation", lakehouse.checkpoint(QUERY))
        .foreachBatch(per_run(lambda df, batch_id: write_batch(df, batch_id, lakehouse, recorder, source)))
        .trigger(processingTime=processing_time)
        .start()
    )
