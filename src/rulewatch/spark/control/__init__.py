"""Rules and commands as data: the rules table and its change feed, control commands for the running evaluator."""
