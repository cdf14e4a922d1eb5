"""What the command line shares: argparse ``type=`` checks and the lazy command handlers.

A bad value is reported by the parser (one line, exit code 2) before anything starts, with the limits
of the settings object that would refuse it anyway (GoldSettings, GeneratorConfig). Nothing here
imports Spark, Delta, pyarrow or the Databricks SDK: the parser is built for every command, and
``rulewatch remote`` or ``--version`` must work where none of them is installed.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
from typing import Any, Callable

from rulewatch.spark.live.generate import GeneratorConfig
from rulewatch.engine.rules import MAX_RULE_ID
from rulewatch.spark.runtime.env import MASTER_ENV, master_problem
from rulewatch.spark.evaluator.settings import NEAR_LIMIT_SHARE, WINDOW_METRICS_KEYS, GoldSettings

Handler = Callable[[argparse.Namespace], int]

# The optional dependencies by import name, per extra of pyproject.toml: a command that needs one that is
# missing says which extra to install instead of ending in an ImportError.
EXTRAS: dict[str, frozenset[str]] = {
    "local": frozenset({"pyspark", "delta", "yaml", "confluent_kafka"}),
    "remote": frozenset({"databricks", "yaml"}),
}


class MissingExtra(Exception):
    """A command needs an optional dependency that is not installed; the message names the extra."""


def needs(handler: Handler, extra: str = "local") -> Handler:
    """``handler``, with a missing optional dependency turned into :class:`MissingExtra` naming its extra.

    ``extra`` is the command's own extra, named when the missing module is in it; a module of another
    extra only (databricks-sdk for a local run that reads a Databricks secret scope) names that one.
    """

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except ModuleNotFoundError as err:
            missing = (err.name or "").split(".")[0]
            named = extra if missing in EXTRAS[extra] else next((e for e, modules in EXTRAS.items() if missing in modules), None)
            if named is None:
                raise
            raise MissingExtra(f"this command needs the {missing} module, which is not installed: pip install 'rulewatch[{named}]'") from err

    return run


def command(target: str, extra: str = "local") -> Handler:
    """The handler ``"module:function"``, imported only when its command runs (see :func:`needs`).

    Building the parser then imports none of the heavy modules.
    """
    module, name = target.split(":")
    return needs(lambda args: getattr(importlib.import_module(module), name)(args), extra)


def progress(command: str, step: str) -> None:
    """A progress line on stderr, so a command that waits (Spark starts in 30-40 s) is not silent
    while stdout stays its result alone (a rules file, a report path)."""
    print(f"{command}: {step} ...", file=sys.stderr, flush=True)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (the usage is one ``--help`` away), and that names a
    mistyped flag first: argparse would otherwise report the required flag it hides (``--lakehose x``
    reads as "--lakehouse is required")."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        argv = sys.argv[1:] if args is None else list(args)
        if not self._subparsers:  # a command's own parser: every flag it is given is one of its own
            value_next = False
            for token in argv:
                if token == "--":
                    break
                if value_next or not token.startswith("-") or any(c.isspace() for c in token):
                    value_next = False  # an option's value (even one like "-- comment"), or a positional
                    continue
                if not token.startswith("--"):  # a short option: -e VALUE, or -eVALUE
                    short = self._option_string_actions.get(token[:2])
                    value_next = short is not None and short.nargs != 0 and len(token) == 2
                    continue
                flag, _, given = token.partition("=")
                action = self._action_of(flag)
                if action is None:
                    close = difflib.get_close_matches(flag, list(self._option_string_actions), n=1)
                    self.error(f"unknown flag {flag}" + (f" (did you mean {close[0]}?)" if close else ""))
                value_next = action is not ... and action.nargs != 0 and not given
        return super().parse_known_args(args, namespace)

    def _action_of(self, flag: str) -> Any:
        """The action ``flag`` names (argparse also takes an unambiguous prefix: --lake for --lakehouse);
        ``...`` for an ambiguous prefix, which argparse itself reports; None for no flag of this command."""
        if flag in self._option_string_actions:
            return self._option_string_actions[flag]
        if not self.allow_abbrev:
            return None
        matches = {self._option_string_actions[f] for f in self._option_string_actions if f.startswith(flag)}
        return matches.pop() if len(matches) == 1 else (... if matches else None)


def _gold_setting(name: str, value: Any) -> None:
    try:
        GoldSettings(**{name: value})
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _whole(text: str, name: str, example: int) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} must be a whole number such as {example}, got {text!r}") from None


def _number(text: str, name: str, example: float) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} must be a number such as {example:g}, got {text!r}") from None


def shards(text: str) -> int:
    """``--shards``: a whole number GoldSettings accepts."""
    value = _whole(text, "shards", GoldSettings.shards)
    _gold_setting("shards", value)
    return value


def state_slots(text: str) -> int:
    """``--state-slots``: a state layout GoldSettings accepts (0: the batch layout)."""
    value = _whole(text, "state_slots", 64)
    _gold_setting("state_slots", value)
    return value


def layout_options(parser: argparse.ArgumentParser, state_slots_help: str) -> None:
    """``--shards`` and ``--state-slots``, which default to what gold's checkpoint began with
    (``checkpoints.gold_layout``), and to GoldSettings' defaults for a new one."""
    parser.add_argument(
        "--shards", type=shards, help=f"hash shards of the key evaluated per Python call, fixed per checkpoint "
        f"(default: what gold's checkpoint began with; {GoldSettings.shards} for a new one)",
    )  # fmt: skip
    parser.add_argument("--state-slots", type=state_slots, help=state_slots_help)


def gold_layout(args: argparse.Namespace, checkpoint: str) -> dict[str, int]:
    """The shards and state layout ``args`` ask for, unset ones filled from gold's checkpoint; names the
    filled ones that differ from the defaults. Imports pyarrow: call it once a command runs."""
    from rulewatch.spark.storage.checkpoints import as_flags, gold_layout as resolved

    layout, recorded = resolved(checkpoint, {"shards": args.shards, "state_slots": args.state_slots}, GoldSettings().layout)
    if recorded:
        print(f"rulewatch: gold's checkpoint began with {as_flags(recorded)}; resuming with it")
    return layout


def allowed_lateness(text: str) -> str:
    """``--allowed-lateness``: a duration GoldSettings accepts (``rules.parse_duration``'s forms)."""
    _gold_setting("allowed_lateness", text)
    return text


def count(name: str, example: int, minimum: int = 1, maximum: int | None = None) -> Callable[[str], int]:
    """A whole-number check for ``name`` (as the message calls it) between ``minimum`` and ``maximum``."""

    def check(text: str) -> int:
        value = _whole(text, name, example)
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"{name} must be {bounds}, got {value}")
        return value

    return check


rule_id = count("a rule id", 1, 1, MAX_RULE_ID)


def generator(field: str, example: float) -> Callable[[str], float]:
    """A check of GeneratorConfig's ``field`` with the config's own limits."""
    flag = f"--{field.replace('_', '-')} "

    def check(text: str) -> float:
        value = _number(text, field.replace("_", " "), example)
        try:
            GeneratorConfig(**{field: value})
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix(flag)) from None
        return value

    return check


def seconds(name: str, example: float) -> Callable[[str], float]:
    """A check for a number of seconds, 0 or more, that ``name`` (as the message calls it) takes."""

    def check(text: str) -> float:
        value = _number(text, name, example)
        if not 0 <= value < float("inf"):
            raise argparse.ArgumentTypeError(f"{name} must be 0 seconds or more, got {text!r}")
        return value

    return check


def minutes(text: str) -> float:
    """``demo --minutes``: minutes of generated traffic, above 0."""
    value = _number(text, "minutes", 2)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0 minutes, got {value:g}")
    return value


# What Spark's processingTime trigger takes, narrowed to the forms that say what they mean.
_TRIGGER = re.compile(r"\d+ (millisecond|second|minute|hour)s?")


def trigger(text: str) -> str:
    """``--trigger``: a processing-time interval such as ``0 seconds`` or ``500 milliseconds``."""
    if not _TRIGGER.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(
            f"expected a whole number and a unit (milliseconds, seconds, minutes or hours) such as '0 seconds' or '500 milliseconds', got {text!r}"
        )
    return text.strip()


def master_url(text: str) -> str:
    if problem := master_problem(text):
        raise argparse.ArgumentTypeError(problem)
    return text


def master_option(parser: argparse.ArgumentParser) -> None:
    """``--master URL`` for a command that starts Spark: where it runs (main() hands it to the session)."""
    parser.add_argument(
        "--master", type=master_url, metavar="URL",
        help=f"Spark master to run on: spark://HOST:PORT for a standalone cluster, local[N] for this process "
        f"(default: {MASTER_ENV}, else local[2]; docs/scale.md)",
    )  # fmt: skip


def key_value(text: str) -> tuple[str, str]:
    """``--param`` / ``--var``: ``NAME=VALUE`` (the value may be empty)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def window_metrics_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--window-metrics", choices=WINDOW_METRICS_KEYS, default="near",
        # argparse %-formats help texts: the share's percent sign doubled.
        help=f"keys given a gold/window_metrics row per batch: near (default) those whose peak reached "
        f"{NEAR_LIMIT_SHARE:.0%}% of an upper limit, and every key of other rules; all: every key touched "
        "(each rule's summary row there counts every evaluated key either way)",
    )  # fmt: skip
