"""What a checkpoint holds and how it is restored.

:class:`TrainingState` is everything needed to continue exactly: model, optimizer, GradScaler, scheduler and
the monitor's own state (step counter, data position and skipped batches, overrides, detector/engine/executor
state). Rollback (:meth:`stabmon.collect.target.LiveTarget.rollback`) restores one through it.

>>> import torch
>>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> state = TrainingState(model, opt)
>>> sorted(state.state_dict())
['model', 'monitor', 'optimizer', 'scaler', 'scheduler']
>>> state.mismatch({"model": {}})
"does not match the model: missing ['bias', 'weight'], unexpected []"
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Protocol


class Stateful(Protocol):
    """The monitor's own state, saved inside the training state (``pipeline=False`` on load keeps the
    detectors, engine and executor as they are)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], *, pipeline: bool = True) -> None: ...


@dataclass
class TrainingState:
    """The objects a checkpoint holds; see the module docstring."""

    model: Any
    optimizer: Any
    scaler: Any = None
    scheduler: Any = None
    monitor: Stateful | None = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "monitor": self.monitor.state_dict() if self.monitor is not None else None,
        }

    def mismatch(self, state: Any) -> str | None:
        """Why ``state`` cannot be restored into the model and optimizer (missing or unexpected keys, another
        shape or dtype, another optimizer layout), or None when it fits. Reads metadata only."""
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            return "holds no model state"
        problem = _model_mismatch(self.model.state_dict(), state["model"])
        if problem is not None:
            return problem
        groups = (state.get("optimizer") or {}).get("param_groups")
        want = [len(g["params"]) for g in self.optimizer.param_groups]
        if groups is None or [len(g.get("params", ())) for g in groups] != want:
            return f"does not match the optimizer: parameter groups of sizes {want} expected"
        if self.monitor is not None and not isinstance(state.get("monitor"), dict):
            return "holds no monitor state (save monitor.state_dict() under 'monitor')"
        return None

    def load(self, state: dict[str, Any], *, pipeline: bool = True) -> None:
        """Restore everything :meth:`state_dict` saved (``pipeline=False`` keeps detector/engine state).

        All or nothing: ``ValueError`` before anything is touched when the state does not fit the model or the
        optimizer, and the previous state is put back if loading fails part-way."""
        problem = self.mismatch(state)
        if problem is not None:
            raise ValueError(f"checkpoint {problem}")
        before = copy.deepcopy({k: v for k, v in self.state_dict().items() if k != "monitor"})
        try:
            self._load(state, pipeline=pipeline)
        except BaseException:
            self._load({**before, "monitor": None}, pipeline=pipeline)
            raise

    def _load(self, state: dict[str, Any], *, pipeline: bool) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.monitor is not None and state.get("monitor") is not None:
            self.monitor.load_state_dict(state["monitor"], pipeline=pipeline)


def _model_mismatch(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    import torch

    missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    if missing or extra:
        return f"does not match the model: missing {missing[:3]}, unexpected {extra[:3]}"
    for key, t in mine.items():
        o = theirs[key]
        if not isinstance(o, torch.Tensor) or o.shape != t.shape or o.dtype != t.dtype:
            got = f"{tuple(o.shape)} {o.dtype}" if isinstance(o, torch.Tensor) else type(o).__name__
            return f"does not match the model: {key} is {got}, the model has {tuple(t.shape)} {t.dtype}"
    return None
