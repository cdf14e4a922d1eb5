"""Rescaling gold (``rulewatch gold rescale``) moves every key's windows to the new shards: nothing lost, nothing repeated.

Generated payments in three hour-long thirds, each landed and run in turn, into two lakehouses: A keeps its
4 shards; B is rescaled to 8 after the first third and to 2 after the second. The rules' windows (up to 3 h),
a cooldown, reported distinct values and folded buckets all reach across the rescales, so a key that
lost its history or memory would alert differently. A's and B's alerts must be the same rows, and the
brute-force oracle's. Three payments of the second third are older than the watermark the first third
left: late in A, and late in B only if the rescaled query carries the old watermark over (each is big
enough to alert if evaluated).
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
import sys
from decimal import Decimal
from pathlib import Path
from unittest import mock

import pytest

from rulewatch.cli.main import main
from rulewatch.spark.evaluator.settings import GoldSettings
from rulewatch.spark.layers.pipeline import run_all
from rulewatch.spark.layers import rescale
from rulewatch.spark.layers.rescale import rescale_gold
from rulewatch.spark.storage.checkpoints import GOLD_LAYOUT, CheckpointError
from rulewatch.spark.storage.lakehouse import Lakehouse

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle import oracle  # noqa: E402

pytestmark = pytest.mark.slow

HOUR = 3_600_000
T0 = 1_793_527_200_000  # 2026-11-01T10:00:00Z
RULES = [
    {"ruleId": 1, "ruleState": "ACTIVE", "groupingKeyNames": ["payeeId"], "aggregateFieldName": "paymentAmount",
     "aggregatorFunctionType": "SUM", "limitOperatorType": "GREATER", "limit": 900, "window": "60m"},
    {"ruleId": 2, "ruleState": "ACTIVE", "groupingKeyNames": ["payeeId", "beneficiaryId"], "aggregateFieldName": "transactionId",
     "aggregatorFunctionType": "COUNT", "limitOperatorType": "GREATER_EQUAL", "limit": 3, "window": "45m", "cooldown": "20m"},
    {"ruleId": 3, "ruleState": "ACTIVE", "groupingKeyNames": ["payeeId"], "aggregateFieldName": "beneficiaryId",
     "aggregatorFunctionType": "UNIQUE_COUNT", "limitOperatorType": "GREATER", "limit": 3, "window": "2h",
     "reportNewValuesOnly": True},
    {"ruleId": 4, "ruleState": "ACTIVE", "groupingKeyNames": ["paymentType"], "aggregateFieldName": "paymentAmount",
     "aggregatorFunctionType": "SUM", "limitOperatorType": "GREATER", "limit": 25000, "window": "3h", "bucket": "10m"},
]  # fmt: skip
# Applied before the last third: rule 1's limit lowered.
RULES_LATER = [{**RULES[0], "limit": 700}, *RULES[1:]]
# The alerts' columns that do not depend on when or where a row was written.
SAME = ("alert_id", "rule_id", "rule_version", "group_key", "transaction_id", "event_time", "aggregate_value", "limit",
        "window_start", "window_end", "event_count", "distinct_values")  # fmt: skip


def _payments(seed: int = 11) -> tuple[list[list[dict]], list[dict]]:
    """Three thirds of payments in time order across thirds, and the late ones landed in the second."""
    rng = random.Random(seed)
    thirds = []
    for third in range(3):
        times = sorted(rng.randrange(T0 + third * HOUR, T0 + (third + 1) * HOUR, 1000) for _ in range(260))
        thirds.append([
            {"transactionId": f"t{third}-{n}", "eventTime": t, "payeeId": f"payee-{rng.randrange(12)}",
             "beneficiaryId": f"ben-{rng.randrange(6)}", "paymentAmount": rng.randrange(1, 200),
             "paymentType": rng.choice(["CSH", "CRD"])}
            for n, t in enumerate(times)
        ])  # fmt: skip
    # The first third leaves the watermark at its newest event minus the hour of lateness, just under T0.
    late = [{"transactionId": f"late-{n}", "eventTime": T0 - 30 * 60_000 + n, "payeeId": "payee-1", "beneficiaryId": "ben-1",
             "paymentAmount": 5000, "paymentType": "CSH"} for n in range(3)]  # fmt: skip
    thirds[1] = late + thirds[1]
    return thirds, late


def _alerts(spark, lakehouse: Lakehouse) -> list[tuple]:
    return sorted(tuple(r) for r in spark.read.format("delta").load(lakehouse.alerts).select(*SAME).collect())


@pytest.fixture(scope="module")
def runs(spark, tmp_path_factory):
    root = tmp_path_factory.mktemp("rescale")
    rules, later = root / "rules.json", root / "rules-later.json"
    rules.write_text(json.dumps(RULES))
    later.write_text(json.dumps(RULES_LATER))
    thirds, late = _payments()
    kept, rescaled = Lakehouse(str(root / "kept")), Lakehouse(str(root / "rescaled"))
    folder = root / "landing"  # both read it, one third after another
    folder.mkdir()
    steps = []
    for n, third in enumerate(thirds):
        (folder / f"third-{n}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in third))
        for lakehouse, shards in ((kept, 4), (rescaled, [4, 3, 2][n])):
            if n == 0 and lakehouse is rescaled:
                shutil.copytree(kept.root, rescaled.root)  # the same first run on 4 shards: a copy of kept's
                continue
            if n == 1 and lakehouse is rescaled:
                # Back to back: the 8-shard query never sees an event, so the 3-shard one must get the
                # 4-shard one's watermark through it.
                steps.append(_rescale(spark, lakehouse, 8, via_cli=False))
                steps.append(_rescale(spark, lakehouse, 3, via_cli=False))
            if n == 2 and lakehouse is rescaled:
                steps.append(_interrupted(spark, lakehouse, shards, folder))
                steps.append(_rescale(spark, lakehouse, shards, via_cli=True))
            rules_file = {0: rules, 2: later}.get(n)  # the last third after a rule change, made after the last rescale
            run_all(spark, lakehouse, str(folder), str(rules_file) if rules_file else None, GoldSettings(shards=shards), log=lambda _: None)
    return kept, rescaled, thirds, late, steps


def _interrupted(spark, lakehouse: Lakehouse, shards: int, landing: Path) -> str:
    """A rescale that dies after moving the old checkpoint aside, before its first batch; then a run,
    which must be refused before it reads anything (it would start the new shards without their state).
    Returns the refusal."""
    def dies(*_args, **_kwargs):
        raise RuntimeError("killed")

    with mock.patch.object(rescale, "record_command", dies), pytest.raises(RuntimeError, match="killed"):
        rescale_gold(spark, lakehouse, shards, say=lambda _: None)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["run", "--lakehouse", lakehouse.root, "--landing", str(landing), "--shards", str(shards)]) == 2
    return err.getvalue()


def _rescale(spark, lakehouse: Lakehouse, shards: int, via_cli: bool):
    if via_cli:
        assert main(["gold", "rescale", "--lakehouse", lakehouse.root, "--shards", str(shards)]) == 0
        return json.loads(Path(lakehouse.checkpoint("gold"), GOLD_LAYOUT).read_text())
    return rescale_gold(spark, lakehouse, shards, say=lambda _: None)


def test_rescaled_gold_alerts_exactly_as_gold_that_kept_its_shards_and_as_the_oracle(spark, runs):
    kept, rescaled, thirds, late, _ = runs
    alerts = _alerts(spark, kept)
    assert alerts == _alerts(spark, rescaled)
    on_time = [{**p, "paymentAmount": Decimal(p["paymentAmount"])} for third in thirds for p in third if p not in late]
    # Each event is evaluated with the rules as they were when it arrived (rule 1 keeps no memory across the change).
    expected = sorted(
        (a["rule_id"], a["group_key"], a["transaction_id"], Decimal(a["aggregate_value"]))
        for rules, last_third in ((RULES, False), (RULES_LATER, True))
        for a in oracle(on_time, rules)
        if a["transaction_id"].startswith("t2-") == last_third
    )
    got = sorted((a[1], a[3], a[4], Decimal(a[6])) for a in alerts)
    assert [(a, v.normalize()) for *a, v in got] == [(a, v.normalize()) for *a, v in expected]
    # Every rule fired in the thirds after a rescale, so each kind of state crossed one.
    assert {a[1] for a in alerts if not a[4].startswith("t0-")} == {1, 2, 3, 4}


def test_the_old_watermark_holds_after_a_rescale(spark, runs):
    kept, rescaled, _, late, _ = runs
    for lakehouse in (kept, rescaled):
        recorded = spark.read.format("delta").load(lakehouse.late_events).select("transaction_id").distinct().collect()
        assert sorted(r.transaction_id for r in recorded) == sorted(p["transactionId"] for p in late), lakehouse.root


def test_a_rescale_that_died_midway_refuses_other_runs_and_is_finished_by_running_it_again(runs):
    *_, (_, _, refusal, last) = runs
    assert "rescale to 2 shards did not finish" in refusal and "rulewatch gold rescale --shards 2" in refusal
    assert last["shards"] == 2 and last["rescaled_from"]["shards"] == 3  # finished by the CLI


def test_gold_batches_go_on_numbering_from_the_old_checkpoint(spark, runs):
    _, rescaled, _, _, (first, second, _, last) = runs
    assert (first.shards_before, first.shards, second.shards_before, second.shards) == (4, 8, 8, 3)
    assert first.keys == second.keys > 0
    assert second.batch == first.batch + 1  # the 8-shard query ran one batch: the rescale's own
    assert last["batch_base"] > second.batch + 1
    rows = spark.read.format("delta").load(rescaled.pipeline_metrics).where("layer = 'gold'").select("batch_id").collect()
    ids = sorted(r.batch_id for r in rows)
    assert ids == list(range(len(ids)))  # one row per batch, none skipped or repeated across both rescales
    # The old checkpoints are kept aside, the staged state is gone.
    checkpoints = Path(rescaled.checkpoint("gold")).parent
    assert len(list(checkpoints.glob("gold.before-rescale-*"))) == 3
    assert not list(Path(rescaled.checkpoint("gold")).glob("rulewatch-rescale-state"))


def test_a_rescale_to_the_same_count_or_of_gold_that_never_ran_is_refused(spark, runs, tmp_path, capsys):
    _, rescaled, *_ = runs
    with pytest.raises(CheckpointError, match="already runs 2 shards"):
        rescale_gold(spark, rescaled, 2)
    assert main(["gold", "rescale", "--lakehouse", str(tmp_path / "empty"), "--shards", "8"]) == 2
    assert "gold has not run" in capsys.readouterr().err
