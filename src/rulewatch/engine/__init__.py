"""The pure engine: rules, window math and per-shard evaluation, in plain Python with no Spark."""
