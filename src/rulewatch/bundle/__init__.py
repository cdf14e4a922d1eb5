"""The Databricks bundle: its configuration merged and resolved as the CLI does, and offline checks of it."""

# The job `rulewatch job run` and `rulewatch remote run` start when none is named (resources/rulewatch.job.yml).
# Here, not in config.py, so that the command line names it without importing PyYAML.
DEFAULT_JOB = "rulewatch_pipeline"
