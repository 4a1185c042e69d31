"""What interventions act on: :class:`InterventionTarget`, the live monitor's target or the replay simulator.

An intervention that changes the model or the optimizer in place reads them with :func:`training_of` (None in
replay), so it is one module: its live effect and what replay records of it in one place, registered with
``@register`` (:mod:`stabmon.interventions.registry`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from stabmon.overrides import Overrides


@runtime_checkable
class InterventionTarget(Protocol):
    """What interventions act on: the live :class:`~stabmon.collect.target.LiveTarget`, or a replay
    simulator."""

    @property
    def overrides(self) -> Overrides:
        """The overrides in force; interventions change this object, never replace it."""

    @property
    def step(self) -> int:
        """The current optimizer step."""

    def hparams(self) -> dict[str, float]:
        """Values in force now: ``lr``, ``beta2``, ``weight_decay``, ``clip`` (absent when not applicable)."""

    def rollback(
        self, *, onset_step: int, lookback: int, skip_batches: int, checkpoint_dir: str | None = None
    ) -> dict[str, Any]:
        """Restore the last-known-good checkpoint saved at least ``lookback`` steps before ``onset_step`` (from
        ``checkpoint_dir`` when given, else the target's own checkpoints) and skip the next ``skip_batches``
        batches of data. Returns what happened (checkpoint path and step, restored step, skipped batch range) for
        the audit row. The rollback rung's ``lr_factor`` / ``lr_cap`` / ``onset_lr`` are not passed here: the
        intervention applies them to :attr:`overrides` after this returns."""

    def checkpoint_and_stop(self, *, reason: str, exit_code: int | None = None) -> dict[str, Any]:
        """Save a checkpoint and ask the training loop to stop with the documented exit code (or
        ``exit_code``)."""


@dataclass(frozen=True)
class Training:
    """The live run's model and optimizer (this rank's), for an intervention that changes them in place. Every
    rank runs the decision with its own; what the change leaves in them is in the next checkpoint."""

    model: Any
    """The ``torch.nn.Module`` the monitor watches (as the user passed it: a DDP or FSDP wrapper stays)."""
    optimizer: Any
    """Its ``torch.optim.Optimizer``."""


@runtime_checkable
class HoldsTraining(Protocol):
    """A target that holds the model and optimizer (the live one)."""

    @property
    def training(self) -> Training: ...


def training_of(target: Any) -> Training | None:
    """The model and optimizer ``target`` acts on; None in replay (it has no weights: an in-place intervention
    then says what it would have done)."""
    return target.training if isinstance(target, HoldsTraining) else None
