"""The replay side of interventions: a simulation that records what would have changed, without torch.

:meth:`Simulation.handle` is the :class:`~stabmon.interventions.handle.Handle` of a replay: the real intervention
classes (through :class:`stabmon.interventions.Executor` with ``simulated=True``) act on it exactly as they act
on the live run's: overrides are set on its :class:`~stabmon.overrides.Overrides`, a rollback is
answered with the checkpoint the run would have gone back to (the last one at a multiple of
``checkpoint_interval`` at least ``lookback`` steps before the onset; ``None``: the run saved none, and the
rollback fails as it did live) and the batch range it would have skipped, and checkpoint-and-stop marks the
step at which the run would have stopped, and the state-level changes (``reset_moments``, ``qk_clip``; the handle
holds no model) are noted as what they would have touched (:attr:`Simulation.state_changes`); the per-step ones
(``adaptive_clip``, ``clip_update``, ``skip_step``) are overrides like the others. The recorded run keeps going
(it is a recording), so replay continues after a simulated stop or rollback and reports them.

Timing follows the live monitor, which runs the pipeline at a flush, after a block of ``flush_every`` steps
has completed: an intervention acts from the step after the block, so ``step`` is the block's last step plus
one. :func:`stabmon.replay.replay.replay` calls :meth:`Simulation.begin_block` with each block.

>>> from stabmon.events import StepRecord
>>> t = Simulation(checkpoint_interval=100)
>>> t.begin_block([StepRecord(step=950, metrics={"lr": 3e-4})])
>>> t.step, t.hparams()["lr"]
(951, 0.0003)
>>> t.rollback(onset_step=940, lookback=100, skip_batches=200)["checkpoint_step"]
800
>>> t.checkpoint_and_stop(reason="diverged")["stopped_at"], t.stopped_at
(951, 951)
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

from stabmon.diagnose.verdict import Diagnosis
from stabmon.events import Metric, StepRecord
from stabmon.interventions.handle import Handle
from stabmon.overrides import Overrides

_HPARAMS = frozenset((Metric.LR, Metric.BETA2, Metric.WEIGHT_DECAY, Metric.CLIP))
_BY_HANDLE: weakref.WeakValueDictionary[int, Simulation] = weakref.WeakValueDictionary()
NOT_DIAGNOSED = ("not run: a replay has no model to re-run steps on or batches to replay, so no verdict; the "
                 "diagnose rung counts as failed and its rule's next rung follows (a live run follows its verdict)")
"""The ``summary`` of every ``diagnose`` in a replay (the table and ``stabmon trace`` show it)."""


class Simulation:
    """What a replay's interventions would have done to the recorded run; see the module docstring."""

    def __init__(self, *, checkpoint_interval: int | None = 1, overrides: Overrides | None = None) -> None:
        if checkpoint_interval is not None and checkpoint_interval < 1:
            raise ValueError(f"replay.checkpoint_interval must be >= 1 or None, got {checkpoint_interval}")
        self.overrides = overrides if overrides is not None else Overrides()
        self.checkpoint_interval = checkpoint_interval
        self._step = 0
        self._batch_index: int | None = None
        self._recorded: dict[str, float] = {}
        self.rollbacks: list[dict[str, Any]] = []
        self.stops: list[dict[str, Any]] = []
        self.not_diagnosed: list[int] = []
        """Steps at which a ``diagnose`` rung could not run (see :meth:`diagnose`)."""
        self.stopped_at: int | None = None
        self.handle = Handle(self.overrides, clock=lambda: self._step, hparams=self.hparams, rollback=self.rollback,
                             checkpoint_and_stop=self.checkpoint_and_stop, diagnose=self.diagnose)
        """What the replay's executor hands its interventions."""
        _BY_HANDLE[id(self.handle)] = self

    @staticmethod
    def of(handle: object) -> Simulation | None:
        """The simulation whose :attr:`handle` ``handle`` is (None: another's, such as a test double)."""
        found = _BY_HANDLE.get(id(handle))
        return found if found is not None and found.handle is handle else None

    @property
    def state_changes(self) -> list[dict[str, Any]]:
        """``reset_moments`` and ``qk_clip`` changes the run would have made (replay has no weights to change)."""
        return self.handle.notes

    @property
    def step(self) -> int:
        return self._step

    def begin_block(self, records: Sequence[StepRecord]) -> None:
        """A flush block is about to go through the pipeline: stand where a live monitor stands at that flush
        (after the block's last step, with the values recorded up to then)."""
        recorded = self._recorded
        last = None
        for last in records:  # in the record's own order (a record has few metrics: one pass, no lookups)
            for name, value in last.metrics.items():
                if name in _HPARAMS and math.isfinite(value):
                    recorded[name] = value
        if last is not None:
            if last.step + 1 > self._step:  # a release's re-warm-up moves on with the recorded steps
                self.overrides.advance(last.step + 1 - self._step)
            if "lr" in recorded:
                self.overrides.settle(recorded["lr"])
            self.overrides.at_step(last.step + 1)  # the next block's steps: in a remembered fault's range?
            if self.overrides.rewarm_left:  # a re-warm-up in force counts down as the recorded steps pass
                self.overrides.rewarm_left = max(0, self.overrides.rewarm_left - (last.step + 1 - self._step))
            self._step = last.step + 1
            self._batch_index = None if last.batch_index is None else last.batch_index + 1

    def hparams(self) -> dict[str, float]:
        """The recorded values, with the simulated overrides applied on top."""
        out = dict(self._recorded)
        o = self.overrides
        if "lr" in out:
            out["lr"] = o.scaled_lr(out["lr"])
        for key, value in (("beta2", o.beta2), ("weight_decay", o.weight_decay), ("clip", o.max_norm)):
            if value is not None:
                out[key] = value
        out.setdefault("clip", math.inf if o.max_norm is None else o.max_norm)
        return out

    def rollback(self, *, onset_step: int, lookback: int, skip_batches: int, **_: Any) -> dict[str, Any]:
        if self.checkpoint_interval is None:  # the recorded run saved none: its rollback failed, so does ours
            raise RuntimeError("rollback needs checkpoints: the recorded run saved none")
        latest = max(0, onset_step - lookback)
        checkpoint = latest - latest % self.checkpoint_interval
        start = self._batch_index if self._batch_index is not None else self._step
        result = {
            "simulated": True,
            "checkpoint_step": checkpoint,
            "restored_step": checkpoint,
            "skipped_batches": [start, start + skip_batches] if skip_batches else [],
            "steps_lost": self._step - checkpoint,
        }
        self.rollbacks.append({"step": self._step, **result})
        return result

    def checkpoint_and_stop(self, *, reason: str, exit_code: int | None = None) -> dict[str, Any]:
        if self.stopped_at is None:
            self.stopped_at = self._step
        result: dict[str, Any] = {"simulated": True, "stopped_at": self._step, "reason": reason}
        if exit_code is not None:
            result["exit_code"] = exit_code
        self.stops.append(result)
        return result

    def diagnose(self, **params: Any) -> Diagnosis:
        """Replay has no model to re-run steps on or batches to replay: no verdict is made up. The diagnosis is
        ``inconclusive`` with that reason, so the rung counts as failed and the rule's next rung follows (a live
        run follows its verdict instead); :meth:`summary` lists these steps as ``not_diagnosed``."""
        self.not_diagnosed.append(self._step)
        return Diagnosis.inconclusive(NOT_DIAGNOSED, onset_step=params.get("onset_step"), step=params.get("step"),
                                      simulated=True, not_run="replay")

    def summary(self) -> dict[str, Any]:
        return {
            "overrides": self.overrides.state_dict(),
            "rollbacks": list(self.rollbacks),
            "stopped_at": self.stopped_at,
            "not_diagnosed": list(self.not_diagnosed),
            "state_changes": list(self.state_changes),
        }
