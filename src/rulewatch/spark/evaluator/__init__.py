"""The stateful evaluator in Spark: routing by keyset, packing, the processor and its shard evaluator, state."""
