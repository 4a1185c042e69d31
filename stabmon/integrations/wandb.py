"""Mirror stabmon into Weights & Biases (extra ``wandb``): metrics through ``run.log`` against a
``stabmon/step`` axis, every intervention as ``run.alert``, and all events as a ``stabmon/events`` table at the
end. ``mode="offline"`` (the default) writes the run under ``dir`` and talks to no server; upload it later
with ``wandb sync``.

>>> WandbMirror(mode="sometimes")
Traceback (most recent call last):
...
ValueError: wandb.mode must be one of offline, online, disabled, got 'sometimes'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stabmon.events import InterventionRecord, StepRecord
from stabmon.integrations.mirror import Mirror, describe
from stabmon.interventions.traits import recorded_traits
from stabmon.sinks import LowVolumeEvent

MODES = ("offline", "online", "disabled")
STEP = "stabmon/step"


class WandbMirror(Mirror):
    """A W&B run per stabmon run. ``init`` holds further ``wandb.init`` keyword arguments (entity, tags, ...)."""

    def __init__(self, *, project: str = "stabmon", mode: str = "offline", dir: str | None = None,
                 init: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"wandb.mode must be one of {', '.join(MODES)}, got {mode!r}")
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("WandbMirror needs wandb: pip install 'stabmon[wandb]'") from exc
        self._wandb: Any = wandb
        self.project, self.mode, self.dir, self.init = project, mode, dir, dict(init or {})
        self.run: Any = None
        self._rows: list[list[Any]] = []

    def _open(self, *, run_id: str, name: str, config: Mapping[str, Any]) -> None:
        self.run = self._wandb.init(project=self.project, name=name, mode=self.mode, dir=self.dir,
                                    config={"stabmon_run_id": run_id, **config}, **self.init)
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)

    def _steps(self, records: Sequence[StepRecord]) -> None:
        if self.run is None:
            return
        for r in records:
            self.run.log({**r.metrics, STEP: r.step})

    def _events(self, events: Sequence[LowVolumeEvent]) -> None:
        if self.run is None:
            return
        for e in events:
            kind, text = describe(e)
            self._rows.append([e.step, kind, text])
            if isinstance(e, InterventionRecord):
                changed = recorded_traits(e.action).changes_training
                level = self._wandb.AlertLevel.WARN if changed else self._wandb.AlertLevel.INFO
                self.run.alert(title=f"stabmon {kind}: {e.action} at step {e.step}", text=text, level=level,
                               wait_duration=0)

    def _close(self, status: str) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        if self._rows:
            run.log({"stabmon/events": self._wandb.Table(columns=["step", "kind", "text"], data=self._rows)})
        run.summary["stabmon/status"] = status
        run.finish(exit_code=0 if status in ("finished", "completed") else 1)
