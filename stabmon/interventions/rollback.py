"""``rollback``: restore the last-known-good checkpoint saved before the anomaly's onset and skip data.

The target (the live monitor, or the replay simulator) does the work through
:class:`stabmon.checkpoints.CheckpointManager`: it looks for a checkpoint saved at least ``lookback`` steps
before ``onset_step``, validates it (exists, byte count, loads, finite tensors) and falls back to older ones,
restores model, optimizer, scaler, scheduler, monitor state and step counter, and skips the next
``skip_batches`` batches through the monitor's data position, recording every skipped index. PaLM's recipe:
``lookback: 100`` and ``skip_batches`` between 200 and 500. The restored weights cannot be un-restored; what a
rollback can undo is the learning-rate change it made (``lr_cap``, ``lr_factor``): reverting it (a failed rung
before the next, or the release of a resolved incident) gives that back and leaves the weights as they are.

``onset_step`` is filled in by the engine (the first step of the incident's evidence); a runbook does not
set it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from stabmon.events import InterventionRecord
from stabmon.interventions.base import Intervention, NoChange, Params
from stabmon.interventions.registry import register


class RollbackParams(Params):
    """``lookback``: how many steps before the onset the checkpoint must have been saved (>= 0).
    ``skip_batches``: how many batches to skip after restoring (>= 0).
    ``lr_factor``: restart with the learning-rate scale in force multiplied by this (``0.5`` = "roll back and
    halve the LR"; with the rung's ``repeat`` it keeps halving while the instability recurs). None: the LR in
    force is kept.
    ``lr_cap``: restart with the learning rate capped at this fraction of the one in force at the incident's
    onset (``onset_lr``, set by the engine; else the one in force now): ``0.5`` = never again above half the LR at
    which the trouble began, whatever the schedule does next. A cap already in force is cut by the same fraction,
    so with ``repeat`` it keeps halving while the instability recurs. None: no new cap.
    ``checkpoint_dir``: where the checkpoints are, when not the monitor's own directory; must exist.
    ``screen``: instead of skipping batches, screen them: from the restored step to ``skip_batches`` steps past
    the onset, each batch is trained on unless its loss (a step's micro-batches' mean, as its record holds it)
    exceeds ``screen_bar`` (set by the engine from the losses before the onset), in which case its update is
    discarded on the device, as the skip guard discards one: a
    bad shard costs its own batches, not a fixed count. Where it cannot act (no baseline, several processes, a
    loop that observes the loss after ``optimizer.step()``, replay), the ``skip_batches`` are skipped as
    without it.
    ``onset_step``, ``onset_lr``, ``screen_bar``: set by the engine. So is ``cleared_step``: the checkpoint a
    diagnosis judged the state good at (a ``data`` or ``hardware_suspect`` verdict); the rollback then lands no
    further back than it, even where the onset is earlier."""

    lookback: int = Field(default=100, ge=0)
    skip_batches: int = Field(default=0, ge=0)
    lr_factor: float | None = Field(default=None, gt=0, le=1)
    lr_cap: float | None = Field(default=None, gt=0, le=1)
    onset_lr: float | None = Field(default=None, gt=0)
    checkpoint_dir: str | None = None
    screen: bool | None = None
    screen_bar: float | None = None
    onset_step: int | None = None
    cleared_step: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _screen_reach(self) -> RollbackParams:
        if self.screen and not self.skip_batches:
            raise ValueError("screen needs skip_batches > 0 (how many steps past the onset to screen)")
        return self

    @field_validator("checkpoint_dir")
    @classmethod
    def _exists(cls, value: str | None) -> str | None:
        if value is not None and not Path(os.path.expandvars(value)).expanduser().is_dir():
            raise ValueError(f"checkpoint directory does not exist: {value}")
        return value


@register
class Rollback(Intervention):
    """Roll back to a validated checkpoint.

    >>> from stabmon.interventions.handle import Handle
    >>> from stabmon.overrides import Overrides
    >>> def rollback(*, onset_step, lookback, skip_batches):
    ...     return {"checkpoint_step": 700, "restored_step": 700, "skipped": [700, 700 + skip_batches]}
    >>> def T(): return Handle(Overrides(), clock=lambda: 900, hparams=dict, rollback=rollback)
    >>> rec = Rollback(T(), {"onset_step": 850, "skip_batches": 200}, decision_id="d").apply()
    >>> rec.before["step"], rec.after["restored_step"]
    (900, 700)
    >>> t = T(); rec = Rollback(t, {"onset_step": 850, "lr_factor": 0.5}, decision_id="d").apply()
    >>> rec.before["lr_scale"], rec.after["lr_scale"], t.overrides.lr_scale
    (1.0, 0.5, 0.5)
    """

    name = "rollback"
    Params = RollbackParams
    revertible = True  # its learning-rate change; see holds()
    rewinds_step = True

    @classmethod
    def levers(cls, params: Mapping[str, Any]) -> frozenset[str]:
        """``"lr"`` for a restart with the learning rate capped or cut, ``"data"`` for one that skips batches. A
        plain restart pulls neither: it is never passed over."""
        lr = params.get("lr_cap") is not None or (params.get("lr_factor") or 1.0) < 1.0
        return frozenset({"lr"} if lr else set()) | frozenset({"data"} if params.get("skip_batches") else set())

    @classmethod
    def holds(cls, record: InterventionRecord) -> bool:
        """Only a rollback that capped or scaled the learning rate, or screens the data, leaves something in force
        to undo."""
        return any(key in record.after for key in (*_LR_FIELDS, "screen_bar"))

    def _apply(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        p = self.params
        assert isinstance(p, RollbackParams)
        before_step = int(self.target.step)
        onset = p.onset_step if p.onset_step is not None else before_step
        screen = bool(p.screen and p.skip_batches and p.screen_bar is not None and self.target.screens())
        land = onset if p.cleared_step is None else max(onset, p.cleared_step)  # a state a diagnosis cleared
        kwargs: dict[str, Any] = {"onset_step": land, "lookback": p.lookback,
                                  "skip_batches": 0 if screen else p.skip_batches}
        if p.checkpoint_dir is not None:
            kwargs["checkpoint_dir"] = p.checkpoint_dir
        lr_now = (p.onset_lr or _lr_in_force(self.target)) if p.lr_cap is not None else None
        result = dict(self.target.rollback(**kwargs))
        before: dict[str, Any] = {"step": before_step, "onset_step": onset, "lookback": p.lookback}
        if p.cleared_step is not None:
            before["cleared_step"] = p.cleared_step
        if screen:  # from where it landed to skip_batches steps past the onset: a high loss loses its update
            overrides = self.target.overrides
            start = int(result.get("restored_step", self.target.step))
            end = max(start, onset) + p.skip_batches
            before["screen_bar"] = overrides.screen_bar
            was = (overrides.screen_bar, overrides.screen_until)
            overrides.screen_bar, overrides.screen_until = p.screen_bar, end
            result["screened"], result["screen_bar"] = [start, end], p.screen_bar
            self._undo["screen"] = [was, (overrides.screen_bar, overrides.screen_until)]
        if p.lr_cap is not None and lr_now is not None:  # never again above a fraction of the LR that broke it
            overrides = self.target.overrides
            before["lr_cap"] = overrides.lr_cap
            cap = lr_now * p.lr_cap
            overrides.lr_cap = cap if overrides.lr_cap is None else min(cap, overrides.lr_cap * p.lr_cap)
            result["lr_cap"] = overrides.lr_cap
            self._undo["lr_cap"] = [before["lr_cap"], overrides.lr_cap]
            # the steps that broke down: when the run is there again, the cap is in force. Where it rolled back
            # from is the rollback's own fact (a rank called into it by rank 0 stands at the restored step by now)
            end = int(result.get("from_step", before_step))
            if onset < end:
                overrides.remember(start=onset, end=end, lr_cap=overrides.lr_cap)
                result["remembered"] = [onset, end]
                self._undo["remembered"] = [onset, end]
        if p.lr_factor is not None:  # restart with a lower LR: the one recipe change this rung makes
            overrides = self.target.overrides
            before["lr_scale"] = overrides.lr_scale
            overrides.lr_scale = overrides.lr_scale * p.lr_factor
            result["lr_scale"] = overrides.lr_scale
            self._undo["lr_scale"] = [before["lr_scale"], overrides.lr_scale]
        return before, result

    def _revert(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        """Give back the learning-rate change (the weights stay as restored), and forget the range it remembered
        (a cap that did not resolve the incident is no fix to put back there), and end the data screen."""
        screen = self._undo.get("screen")
        if screen is None:
            before, after = self._set(0)
        else:
            before, after = self._set(0) if any(k in self._undo for k in _LR_FIELDS) else ({}, {})
            overrides = self.target.overrides
            before = {**before, "screen_bar": overrides.screen_bar}
            overrides.screen_bar, overrides.screen_until = screen[0]
            after = {**after, "screen_bar": overrides.screen_bar}
        if (known := self._undo.get("remembered")) is not None:
            self.target.overrides.forget(start=known[0], end=known[1])
            after = {**after, "forgot": known}
        return before, after

    def _release(self, steps: int) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        """A cap is given back only once the schedule is below the LR at which the trouble began (a schedule
        still above it, a warm-up that keeps rising, would only bring the trouble back): until then it holds,
        and the record says when it lifts. A factor is given back at once. A data screen runs to its end (the
        batches it covers are still to come)."""
        p = self.params
        assert isinstance(p, RollbackParams)
        if self._screen_only():  # nothing to give back: the screen ends by itself
            return self._screen_values(), self._screen_values()
        cap = self._undo.get("lr_cap")
        if cap is None or p.onset_lr is None or cap[0] is not None:
            return self._set(0)
        overrides = self.target.overrides
        before: dict[str, Any] = {"lr_cap": overrides.lr_cap}
        after: dict[str, Any] = {"lr_cap": overrides.lr_cap, "lifted_below_lr": p.onset_lr}
        if "lr_scale" in self._undo:
            before["lr_scale"], overrides.lr_scale = overrides.lr_scale, self._undo["lr_scale"][0]
            after["lr_scale"] = overrides.lr_scale
        overrides.release_cap(below=p.onset_lr, steps=steps)
        return before, after

    def _reapply(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        if self._screen_only():  # the release left the screen as it was
            return self._screen_values(), self._screen_values()
        self.target.overrides.cap_until = None
        if (known := self._undo.get("remembered")) is not None:
            cap = self._undo["lr_cap"][1]
            self.target.overrides.remember(start=known[0], end=known[1], lr_cap=cap)
        return self._set(1)

    def _screen_only(self) -> bool:
        return "screen" in self._undo and not any(k in self._undo for k in _LR_FIELDS)

    def _screen_values(self) -> dict[str, Any]:
        overrides = self.target.overrides
        return {"screen_bar": overrides.screen_bar, "screen_until": overrides.screen_until}

    def _set(self, which: int) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        """Set each learning-rate override this rollback changed to its value before (0) or after (1) it."""
        changed = {k: v for k, v in self._undo.items() if k in _LR_FIELDS}
        if not changed:
            raise NoChange("this rollback changed no learning-rate setting: the restored weights stay")
        overrides = self.target.overrides
        before = {k: getattr(overrides, k) for k in changed}
        for key, values in changed.items():
            setattr(overrides, key, values[which])
        return before, {k: getattr(overrides, k) for k in changed}


_LR_FIELDS = ("lr_cap", "lr_scale")


def _lr_in_force(target: Any) -> float | None:
    try:
        lr = target.hparams().get("lr")
    except Exception:  # noqa: BLE001 - a target that cannot report its LR gets no cap
        return None
    return float(lr) if lr is not None else None
