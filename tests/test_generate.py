"""The live generator: steady rate, deterministic, background below every rule, each pattern above its own."""

from __future__ import annotations

import json
from collections import defaultdict
from decimal import Decimal

import pytest

from rulewatch.spark.live.generate import PATTERNS, Generator, GeneratorConfig, group_key, read_labels, run
from rulewatch.spark.layers.silver import DEFAULT_PAYMENT_TYPES


def ticks(config: GeneratorConfig, step: float = 0.2) -> tuple[list[dict], list]:
    generator = Generator(config)
    events, labels, elapsed = [], [], 0.0
    while not generator.finished:
        elapsed += step
        batch, new = generator.tick(elapsed, int(elapsed * 1000))
        events += batch
        labels += new
    return events, labels


def crossings(events: list[dict]) -> set[tuple[int, str]]:
    """(rule id, group key) of every key whose whole-run aggregate crosses a live rule.

    Whole-run aggregates bound every windowed one from above, so a key absent here can never alert;
    the patterns span seconds, well inside every window, so theirs equal the windowed ones.
    """
    pair_sum: dict[str, Decimal] = defaultdict(Decimal)
    payer_count: dict[str, int] = defaultdict(int)
    user_ips: dict[str, set] = defaultdict(set)
    ip_users: dict[str, set] = defaultdict(set)
    for e in events:
        if "payeeId" in e:
            pair_sum[group_key([e["payeeId"], e["beneficiaryId"]])] += Decimal(e["paymentAmount"])
            payer_count[group_key([e["payeeId"]])] += 1
        elif e.get("action") == "login":
            user_ips[group_key([e["userId"]])].add(e["ip"])
            ip_users[group_key([e["ip"]])].add(e["userId"])
    return (
        {(1, k) for k, v in pair_sum.items() if v > 1000}
        | {(2, k) for k, v in payer_count.items() if v >= 5}
        | {(3, k) for k, v in user_ips.items() if len(v) > 4}
        | {(5, k) for k, v in ip_users.items() if len(v) > 4}
    )


def test_every_generated_payment_type_passes_silver():
    events, _ = ticks(GeneratorConfig(rate=500, duration=10, pattern_every=1, run_id="f6"))
    assert {e["paymentType"] for e in events if "paymentType" in e} <= set(DEFAULT_PAYMENT_TYPES.split(","))


def test_steady_rate_and_wall_clock_event_time():
    generator = Generator(GeneratorConfig(rate=500, duration=10, run_id="a1"))
    first, _ = generator.tick(0.5, 1_000)
    second, _ = generator.tick(1.0, 2_000)
    assert len(first) == 250 and len(second) == 250
    assert {e["eventTime"] for e in first} == {1_000} and {e["eventTime"] for e in second} == {2_000}
    assert all(e["transactionId"].startswith("a1-") for e in first + second)


def test_same_seed_same_traffic_other_seed_other_traffic():
    config = GeneratorConfig(rate=300, duration=6, pattern_every=1, run_id="b2")
    assert ticks(config) == ticks(config)
    assert ticks(config)[0] != ticks(GeneratorConfig(rate=300, duration=6, pattern_every=1, run_id="b2", seed=8))[0]


def test_only_injected_patterns_cross_the_rules():
    events, labels = ticks(GeneratorConfig(rate=2000, duration=30, pattern_every=1.5, run_id="c3"))
    assert len(events) == 60_000
    assert len({e["transactionId"] for e in events}) == len(events)
    assert {label.pattern for label in labels} == set(PATTERNS)
    # Every instance crosses exactly the rule meant for it, and nothing else crosses anything.
    assert crossings(events) == {(label.rule_id, label.group_key) for label in labels}
    ids = {e["transactionId"] for e in events}
    assert all(set(label.transaction_ids) <= ids for label in labels)


def test_patterns_that_cannot_finish_in_time_are_not_started():
    _, labels = ticks(GeneratorConfig(rate=100, duration=12, pattern_every=2, run_id="d4"))
    # Instance 4 (a drain starting at 10 s) would need 9 s more; instance 5 (a burst at 12 s) 1.75 s.
    assert [label.instance for label in labels] == [0, 1, 2, 3]


def test_run_lands_whole_files_and_labels_beside_them(tmp_path):
    landing, labels = tmp_path / "landing", tmp_path / "labels"
    result = run(GeneratorConfig(rate=400, duration=3, pattern_every=0.5, file_interval=0.1, run_id="e5"), landing, labels)
    files = sorted(landing.iterdir())
    assert not [f for f in files if f.name.startswith(".")]  # no temp files left behind
    landed = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    assert len(landed) == result.events == 1200 and result.files == len(files)
    written = read_labels(labels)
    # Only the burst at 1 s fits in 3 s (a drain takes 9 s, the spray at 1.5 s would end at 3.25 s).
    assert [label.pattern for label in written] == ["burst"]
    assert all(set(label.transaction_ids) <= {e["transactionId"] for e in landed} for label in written)


def test_bad_settings_and_folders_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--rate must be above 0"):
        GeneratorConfig(rate=0)
    with pytest.raises(ValueError, match="--run-id must be 1 to 8 lowercase hex digits"):
        GeneratorConfig(run_id="run-1")
    with pytest.raises(ValueError, match="is inside the landing folder"):
        run(GeneratorConfig(duration=0.1), tmp_path / "landing", tmp_path / "landing" / "labels")
