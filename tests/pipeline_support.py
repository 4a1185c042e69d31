"""A detector suite double for pipeline tests: it reports the anomalies planned for each step (the engine and the
executor under test are real)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stabmon.events import Anomaly, StepRecord


class PlannedReports:
    """Reports ``plan[step]`` on the record of that step, nothing on the others."""

    def __init__(self, plan: Mapping[int, Sequence[Anomaly]]) -> None:
        self.plan = plan

    def update(self, record: StepRecord) -> list[Anomaly]:
        return list(self.plan.get(record.step, ()))

    def enter_grace(self, steps: int | None = None) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
