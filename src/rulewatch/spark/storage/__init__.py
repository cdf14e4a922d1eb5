"""Where data lives and how it is written exactly once: lakehouse names, Delta tables and logs, sinks, checkpoints, metrics."""
