"""argparse ``type=`` checks for the evaluator settings the commands take, so a bad value is reported
by the parser (usage line, exit code 2) before anything starts, with GoldSettings' own limits."""

from __future__ import annotations

import argparse
from typing import Any

from rulewatch.gold import GoldSettings


def _gold_setting(name: str, value: Any) -> None:
    try:
        GoldSettings(**{name: value})
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def shards(text: str) -> int:
    """``--shards``: a whole number GoldSettings accepts."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"shards must be a whole number such as 16, got {text!r}") from None
    _gold_setting("shards", value)
    return value


def allowed_lateness(text: str) -> str:
    """``--allowed-lateness``: a duration GoldSettings accepts (``rules.parse_duration``'s forms)."""
    _gold_setting("allowed_lateness", text)
    return text
