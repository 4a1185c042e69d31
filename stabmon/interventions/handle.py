"""What an intervention acts on: one small :class:`Handle`, the same in a live run and in replay.

The executor passes the handle to every intervention it builds. It holds the overrides in force (what most rungs
change), the run's step, the values in force (``hparams``), the verbs ``rollback``, ``checkpoint_and_stop`` and
``diagnose``, and, live only, this rank's model and optimizer (:class:`Training`). An intervention that changes
them in place reads them with :func:`training_of` (None in replay: it then says what it would have done and
notes it with :meth:`Handle.note`), so one module holds an intervention's live effect and its replay effect
(docs/ARCHITECTURE.md, "How to add an intervention"). The handle imports no torch.

The live monitor builds its handle from its run state, its optimizer hooks and its
:class:`~stabmon.collect.checkpoint.recovery.Recovery` (rollback and stop, joint across ranks); replay from a
:class:`~stabmon.replay.simulate.Simulation`.

>>> from stabmon.overrides import Overrides
>>> h = Handle(Overrides(), clock=lambda: 12, hparams=lambda: {"lr": 1e-3})
>>> h.step, h.training is None, h.hparams()["lr"]
(12, True, 0.001)
>>> h.note({"action": "reset_moments"}); h.notes
[{'action': 'reset_moments', 'step': 12, 'simulated': True}]
>>> h.rollback(onset_step=5, lookback=1, skip_batches=0)
Traceback (most recent call last):
...
stabmon.interventions.handle.CannotAct: rollback: this run has no checkpoints to roll back to
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stabmon.overrides import Overrides

if TYPE_CHECKING:
    from stabmon.diagnose.verdict import Diagnosis
    from stabmon.interventions.commit import FollowUps


class CannotAct(RuntimeError):
    """A verb this run does not offer (no checkpoints to roll back to, no way to re-run steps)."""


@dataclass(frozen=True)
class Training:
    """The live run's model and optimizer (this rank's), for an intervention that changes them in place. Every
    rank runs the decision with its own; what the change leaves in them is in the next checkpoint."""

    model: Any
    """The ``torch.nn.Module`` the monitor watches (as the user passed it: a DDP or FSDP wrapper stays)."""
    optimizer: Any
    """Its ``torch.optim.Optimizer``."""


def _cannot(verb: str, why: str) -> Callable[..., Any]:
    def refuse(**_: Any) -> Any:
        raise CannotAct(f"{verb}: {why}")

    return refuse


@dataclass(eq=False)
class Handle:
    """What the executor hands each intervention; see the module docstring."""

    overrides: Overrides
    """The overrides in force; interventions change this object, never replace it."""
    clock: Callable[[], int]
    """The run's step: optimizer steps completed (the index the next step gets)."""
    hparams: Callable[[], dict[str, float]]
    """``lr``, ``beta2``, ``weight_decay``, ``clip`` in force for the next step (absent when not applicable)."""
    rollback: Callable[..., dict[str, Any]] = _cannot("rollback", "this run has no checkpoints to roll back to")
    """``rollback(onset_step=, lookback=, skip_batches=, checkpoint_dir=None)``: restore the last-known-good
    checkpoint at least ``lookback`` steps before ``onset_step`` and skip ``skip_batches`` batches; the audit facts.
    The rung's LR change is the intervention's own, made on :attr:`overrides` after this returns."""
    checkpoint_and_stop: Callable[..., dict[str, Any]] = _cannot("checkpoint_and_stop", "this run cannot stop")
    """``checkpoint_and_stop(reason=, exit_code=None)``: save a checkpoint and ask the loop to stop."""
    diagnose: Callable[..., Diagnosis] = _cannot("diagnose", "this run cannot re-run steps")
    """``diagnose(onset_step=, step=, metric=, max_batches=, rtol=, recur=)``: the incident's verdict."""
    training: Training | None = None
    """This rank's model and optimizer; None in replay."""
    screens: Callable[[], bool] = lambda: False
    """Whether a data screen can act in this run (``rollback`` with ``screen``): one process whose loop observes
    the loss before ``optimizer.step()``. Replay cannot (it has no losses of batches not yet drawn)."""
    follow_ups: FollowUps | None = None
    """Where a change leaves what must wait until it is committed (the live run's; replay has none)."""
    notes: list[dict[str, Any]] = field(default_factory=list)
    """What replay's in-place interventions would have changed (:meth:`note`)."""

    @property
    def step(self) -> int:
        return self.clock()

    def note(self, change: dict[str, Any]) -> None:
        """Record an in-place change a replay cannot make (it has no weights): ``change`` with the step."""
        change.setdefault("step", self.step)
        change.setdefault("simulated", True)
        self.notes.append(change)


def training_of(target: Handle) -> Training | None:
    """The model and optimizer ``target`` acts on; None in replay (an intervention then says what it would have
    done)."""
    return target.training
