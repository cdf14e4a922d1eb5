"""Notebook parameters: ``dbutils.widgets`` on Databricks, the same names from the environment locally.

Locally a job runner (or a test) sets ``RULEWATCH_WIDGET_<NAME>`` for the notebook's kernel; a
notebook opened by hand gets each widget's default.
"""

from __future__ import annotations

import os

from rulewatch.session import is_databricks


def widget(name: str, default: str = "") -> str:
    """Declare a text widget and return its value."""
    if is_databricks():
        from databricks.sdk.runtime import dbutils

        dbutils.widgets.text(name, default)
        return dbutils.widgets.get(name)
    return os.environ.get(f"RULEWATCH_WIDGET_{name.upper()}", default)


def widget_env(values: dict[str, str]) -> dict[str, str]:
    """The environment entries that hand ``values`` to a locally executed notebook."""
    return {f"RULEWATCH_WIDGET_{name.upper()}": str(value) for name, value in values.items()}
