"""Where every table and checkpoint lives.

Locally each table is a Delta table at ``<root>/<layer>/<table>`` so any Delta reader can open it;
checkpoints sit beside them under ``<root>/_checkpoints``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Lakehouse:
    root: str

    def __post_init__(self) -> None:
        if "://" not in self.root:
            object.__setattr__(self, "root", str(Path(self.root).expanduser().resolve()))

    def table(self, layer: str, name: str) -> str:
        return f"{self.root}/{layer}/{name}"

    def checkpoint(self, query: str) -> str:
        return f"{self.root}/_checkpoints/{query}"

    @property
    def bronze_transactions(self) -> str:
        return self.table("bronze", "transactions")

    @property
    def silver_transactions(self) -> str:
        return self.table("silver", "transactions")

    @property
    def silver_quarantine(self) -> str:
        return self.table("silver", "quarantine")

    @property
    def silver_duplicates(self) -> str:
        return self.table("silver", "duplicates")

    @property
    def rules(self) -> str:
        return self.table("config", "rules")

    @property
    def rule_errors(self) -> str:
        return self.table("config", "rule_errors")

    @property
    def rule_history(self) -> str:
        return self.table("gold", "rule_history")

    @property
    def alerts(self) -> str:
        return self.table("gold", "alerts")

    @property
    def window_metrics(self) -> str:
        return self.table("gold", "window_metrics")

    @property
    def late_events(self) -> str:
        return self.table("gold", "late_events")
