"""The user-facing ``rulewatch`` command line and its subcommands."""
