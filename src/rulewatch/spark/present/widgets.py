"""Notebook plumbing: parameters (``dbutils.widgets`` on Databricks, the environment locally), paths, display.

Locally a job runner (or a test) sets ``RULEWATCH_WIDGET_<NAME>`` for the notebook's kernel; a
notebook opened by hand gets each widget's default. Paths given to a notebook, defaults included,
resolve against the repository root (the folder holding ``databricks.yml``), so a notebook opened
from ``notebooks/`` and one run by the job in the bundle root use the same lakehouse and fixtures.

Nothing here imports pyspark at module level: the job runner uses :func:`widget_env` without a
Spark installation in sight.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from rulewatch.spark.runtime.env import is_databricks, repository_root

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

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


def resolve_path(value: str, root: Path | None = None) -> str:
    """``value`` as a notebook should use it: relative paths against the repository root, the rest untouched.

    Empty stays empty (a widget's "none"); absolute paths (``/Volumes/...``, as the bundle passes
    them on Databricks) and URIs (``s3://...``) are returned as given. Without a repository root the
    working directory stands in, as it did before roots were looked for.
    """
    if not value or "://" in value or Path(value).expanduser().is_absolute():
        return value
    base = root or repository_root() or Path.cwd()
    return str((base / value).resolve())


def int_widget(name: str, default: int) -> int:
    """A text widget holding a whole number; anything else fails naming the widget and the value."""
    value = widget(name, str(default)).strip()
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"widget {name} must be a whole number, got {value!r}") from None


def path_widget(name: str, default: str = "") -> str:
    """A widget naming a file or folder (:func:`widget`), resolved by :func:`resolve_path`."""
    return resolve_path(widget(name, default))


def show(frame: DataFrame, rows: int = 20) -> None:
    """Show the first ``rows`` rows of a Spark DataFrame the richest way the platform offers.

    Databricks: the notebook's own ``display`` (sortable table, charts). A Jupyter or VS Code kernel:
    an HTML table through pandas, because IPython's ``display`` only prints a Spark DataFrame's
    repr. Anything else (a plain Python shell): ``DataFrame.show``.
    """
    sample = frame.limit(rows)
    try:
        from IPython import get_ipython
    except ImportError:
        shell = None
    else:
        shell = get_ipython()
    native = shell.user_ns.get("display") if shell is not None and is_databricks() else None
    if native is not None:
        native(sample)
    elif shell is not None and getattr(shell, "kernel", None) is not None:
        import pandas as pd
        from IPython.display import display

        # pandas cuts cells at 50 characters; a raw line or a reason is what the reader came to see.
        with pd.option_context("display.max_colwidth", None):
            display(sample.toPandas())
    else:
        sample.show(rows, truncate=False)
