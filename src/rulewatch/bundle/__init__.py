"""The Databricks bundle: its configuration merged and resolved as the CLI does, and offline checks of it."""
