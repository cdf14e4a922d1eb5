"""The rules one shard knows: each valid rule with the commit version that last changed it, its clear
point, and what that means for the history a keyset's keys must keep."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rulewatch.engine.rules import Rule, RuleError, RuleState, parse_rule


@dataclass
class RuleBook:
    """The rules a shard knows, each with the rules-table commit version that last changed it.

    ``cleared`` holds each rule's clear point (event time, ms): after a "clear state" command the
    rule sees only events later than that, as if it had been created then (its history, cooldown
    and reported values from before are forgotten). Rules sharing the key's history are unaffected.
    """

    rules: dict[int, tuple[Rule, int]] = field(default_factory=dict)
    cleared: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> str:
        rules = {str(rid): [rule.to_json(), version] for rid, (rule, version) in sorted(self.rules.items())}
        return json.dumps({"rules": rules, "cleared": {str(rid): at for rid, at in sorted(self.cleared.items())}})

    @classmethod
    def from_json(cls, text: str | None) -> "RuleBook":
        if not text:
            return cls()
        doc = json.loads(text)
        if "rules" not in doc:  # written before clear points existed: the rules alone
            doc = {"rules": doc, "cleared": {}}
        return cls(
            {int(rid): (parse_rule(body), int(version)) for rid, (body, version) in doc["rules"].items()},
            {int(rid): int(at) for rid, at in doc["cleared"].items()},
        )

    def clear(self, rule_id: int | None, before_ms: int) -> None:
        """Forget what ``rule_id`` (every current rule if None) has seen up to ``before_ms``."""
        for rid in self.rules if rule_id is None else [rule_id] if rule_id in self.rules else []:
            self.cleared[rid] = max(self.cleared.get(rid, before_ms), before_ms)

    def apply(self, change_type: str, row: Mapping[str, Any], version: int) -> RuleError | None:
        """Apply one change-data-feed row; an invalid row leaves the last valid rule in place."""
        rule_id = row.get("ruleId")
        if change_type == "delete":
            self.rules.pop(int(rule_id), None)
            self.cleared.pop(int(rule_id), None)
            return None
        body = {k: v for k, v in row.items() if v is not None}
        try:
            rule = parse_rule(body)
        except RuleError as err:
            return err
        if rule.state is RuleState.DELETE:
            self.rules.pop(rule.rule_id, None)
            self.cleared.pop(rule.rule_id, None)
        else:
            self.rules[rule.rule_id] = (rule, version)
        return None

    def active_by_keyset(self) -> dict[str, list[tuple[Rule, int, int | None]]]:
        """Active rules per keyset, each with its version and clear point (None: never cleared)."""
        out: dict[str, list[tuple[Rule, int, int | None]]] = {}
        for rid, (rule, version) in self.rules.items():
            if rule.state is RuleState.ACTIVE:
                out.setdefault(rule.keyset, []).append((rule, version, self.cleared.get(rid)))
        return out

    def retention_ms(self, keyset: str) -> int:
        """Raw history a key must keep: its widest exact window among rules not deleted (paused
        ones resume), or the largest bucket of its bucketed rules."""
        # A bucketed rule needs raw events only for its open bucket; older ones are folded.
        widths = [r.bucket_ms or r.window_ms for r, _ in self.rules.values() if r.keyset == keyset]
        return max(widths, default=0)

    def memory_ms(self, keyset: str) -> int:
        """How long a key's per-rule memory (cooldown, reported values, folded buckets) stays meaningful."""
        spans = [max(r.window_ms + r.bucket_ms, r.cooldown_ms) for r, _ in self.rules.values() if r.keyset == keyset]
        return max(spans, default=0)
