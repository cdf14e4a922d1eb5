"""``rulewatch bench`` as users run it, on inputs small enough for CI: the figures it prints are of
the runs it says, and the job it times gives the alerts the brute-force oracle gives on its data."""

from __future__ import annotations

import json
import re
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from rulewatch.cli.bench import BENCH_RULES, PIPELINE_LIMITS, land_payments
from rulewatch.cli.main import main

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle import oracle  # noqa: E402

pytestmark = pytest.mark.jvm

FIGURES = r"^  (?P<name>.+?) +(?P<seconds>\d+\.\d)s +(?P<rate>[\d,]+) events/s"


@pytest.mark.slow
def test_pipeline_bench_times_a_job_whose_alerts_are_the_oracles_in_each_round(spark, tmp_path, capsys):
    events, keys = 3_000, 10
    assert main(["bench", "--pipeline", "--events", str(events), "--keys", str(keys), "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    # The same payments the bench generated (fixed seed), read with a parser of our own.
    land_payments(str(tmp_path), events, keys, files=10)
    payments = [json.loads(line, parse_float=Decimal) for f in sorted(tmp_path.glob("*.jsonl")) for line in f.read_text().splitlines()]
    expected = oracle(payments, [{**BENCH_RULES[0], "limit": PIPELINE_LIMITS.get(keys, 25_000)}])
    assert len(payments) == events and 0 < len(expected) < events  # the rule both fires and stays quiet
    rounds = re.split(r"^ round \d of 2.*$", out, flags=re.M)[1:]
    assert len(rounds) == 2, out
    for text in rounds:  # each round its own lakehouse: the second does not find the first's alerts
        assert re.search(rf"^  alerts {len(expected):,}$", text, re.M), out
        layers = {m["name"]: m for m in re.finditer(FIGURES, text, re.M)}
        assert list(layers) == ["stateless pass-through", "bronze", "silver", "gold", "whole job"], out
        parts = sum(float(layers[name]["seconds"]) for name in ("bronze", "silver", "gold"))
        # The whole job is the layers one after the other, then their metrics rows' one commit.
        assert parts - 0.15 <= float(layers["whole job"]["seconds"]) <= parts + 5


def test_evaluator_bench_measures_each_layout_once_beside_the_pass_through(spark, capsys):
    argv = ["bench", "--events", "2000", "--keys", "50", "--batch-events", "1000", "--state-slots", "0", "4", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = re.findall(FIGURES + r"  ratio \d+\.\d\d  state rows written/batch (?P<rows>[\d,]+)", out, re.M)
    assert [name for name, *_ in rows] == ["stateless pass-through", "evaluator, batch layout", "evaluator, 4 slots/shard"], out
    written = [int(r[-1].replace(",", "")) for r in rows]
    # Only the evaluators keep state.
    assert written[0] == 0 and written[1] > 0 and written[2] > 0, out
    # Each row is followed by where its seconds went; only the evaluators have a stateful operator's part.
    splits = re.findall(r"^    queryPlanning (\d+\.\d)s, latestOffset \d+\.\ds, addBatch (\d+\.\d)s(.*)$", out, re.M)
    assert len(splits) == 3 and all(float(add_batch) > 0 for _, add_batch, _ in splits), out
    assert splits[0][2] == "", out
    for _, _, operator in splits[1:]:
        updates = re.fullmatch(r"; stateful operator, task time: updates (\d+\.\d)s, commit \d+\.\ds, removals \d+\.\ds", operator)
        assert updates and float(updates[1]) > 0, out
