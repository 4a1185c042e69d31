"""The monitor's own state in a checkpoint, entry by entry, and what each reason to load leaves alone.

A checkpoint (:class:`~stabmon.collect.checkpoint.restore.TrainingState`) holds ``model``, ``optimizer``, ``scaler``,
``scheduler`` and ``monitor``; ``monitor`` is the dict ``Monitor.state_dict()`` returns, format version 1:

==============  ======================================================  ==================
entry           owner                                                   on rollback
==============  ======================================================  ==================
``step``        the :class:`~stabmon.collect.run_state.RunState`       restored
``data``        its data cursor (position, batches to skip)             restored
``overrides``   its overrides                                           kept as they are
``hooks``       the optimizer hooks (the skip guard's baseline)         restored
``embeddings``  embedding drift's reference rows                        restored
``pending``     the steps not flushed yet when it was written          kept as they are
``pipeline``    detectors and runbook engine                            kept as they are
``executor``    interventions in force, to revert                       kept as they are
``follower``    decisions the other ranks have followed                 kept as they are
``notifier``    the alert gates' memory (who was told what, and when)   kept as they are
``checkpoints`` the checkpoint registry (adopted on resume)             kept as they are
==============  ======================================================  ==================

plus ``version``, ``run_id`` and ``run_name``, saved and never loaded. A rollback happens in the middle of an
incident: the engine is handling it, the overrides and the interventions in force are its doing, and the
channels have been told about it; all of that describes the run as it is now, not as it was at the checkpoint.
A resume loads every entry. :data:`EXCLUDED` is the one place these sets are written.

>>> from stabmon.collect.checkpoint.restore import ROLLBACK
>>> sorted(EXCLUDED[ROLLBACK])[:3]
['monitor.checkpoints', 'monitor.executor', 'monitor.follower']
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from stabmon.checkpoints import CheckpointManager, CheckpointStore
from stabmon.collect.checkpoint.restore import RESUME, ROLLBACK, NamedStates, Stateful
from stabmon.collect.failsafe import Failsafe
from stabmon.collect.flushing import Outbox
from stabmon.collect.run_state import RunState
from stabmon.pipeline import Pipeline, ReseedableEngine

VERSION = 1
"""The format of the monitor's state; a later format keeps a reader for this one."""

EXCLUDED: Mapping[str, frozenset[str]] = {
    ROLLBACK: frozenset(
        f"monitor.{name}"
        for name in ("overrides", "pipeline", "executor", "follower", "notifier", "checkpoints", "pending")
    ),
    RESUME: frozenset(),
}
"""Per reason to load a checkpoint, the entries left as they are (see the module docstring)."""

COUNTED_BY_FRAMEWORK = frozenset({"monitor.step", "monitor.data"})
"""Also left as they are by a rollback when a framework counts the steps (:class:`~stabmon.spec.Loop`): the
framework's step count and data position go on, and the monitor follows them."""


def excluded(*, counts_steps: bool) -> Mapping[str, frozenset[str]]:
    """:data:`EXCLUDED`, with :data:`COUNTED_BY_FRAMEWORK` on rollback when the monitor does not count the
    steps."""
    if counts_steps:
        return EXCLUDED
    return {**EXCLUDED, ROLLBACK: EXCLUDED[ROLLBACK] | COUNTED_BY_FRAMEWORK}


REQUIRED = {"monitor": "save monitor.state_dict() under 'monitor'"}
"""What a checkpoint must hold besides the model and optimizer, with the hint its absence gets."""


class StepCounter:
    """The run's step counter as an entry (an int, as saved since format 1); loading it marks the run restored.

    >>> run = RunState()
    >>> StepCounter(run).load_state_dict(40); run.step, run.restored
    (40, True)
    """

    def __init__(self, run: RunState) -> None:
        self.run = run

    def state_dict(self) -> int:
        return self.run.step

    def load_state_dict(self, state: Any) -> None:
        self.run.step = int(state)
        self.run.restored = True

    def snapshot(self) -> tuple[int, bool]:
        return self.run.step, self.run.restored

    def restore(self, snapshot: tuple[int, bool]) -> None:
        self.run.step, self.run.restored = snapshot


class PipelineState:
    """The pipeline's state (detectors and engine); after a load, the engine takes fresh ids (another run may
    continue from the same state) and the detectors re-enter their grace period. Saving goes through the
    failsafe: a detector that cannot say its state does not fail the checkpoint."""

    def __init__(self, pipeline: Pipeline, *, failsafe: Failsafe, grace_steps: int | None) -> None:
        self.pipeline, self.failsafe, self.grace_steps = pipeline, failsafe, grace_steps

    def state_dict(self) -> Any:
        return self.failsafe.call("pipeline", self.pipeline.state_dict)

    def load_state_dict(self, state: Any) -> None:
        self.pipeline.load_state_dict(state)
        engine = self.pipeline.engine
        if isinstance(engine, ReseedableEngine):  # another run may continue from this same state: never share an id
            engine.reseed()
        self.failsafe.call("pipeline", lambda: self.pipeline.detectors.enter_grace(self.grace_steps))

    def snapshot(self) -> Any:
        return copy.deepcopy(self.state_dict())

    def restore(self, snapshot: Any) -> None:
        """The pipeline's state as it was: the engine's ids and the detectors' grace included."""
        if snapshot is not None:
            self.pipeline.load_state_dict(snapshot)


class NotifierState:
    """The alert gates' memory, through the outbox (None without a notifier, or on ranks other than 0)."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox

    def state_dict(self) -> Any:
        return self.outbox.notifier_state()

    def load_state_dict(self, state: Any) -> None:
        self.outbox.load_notifier_state(state)


class RegistryState:
    """The checkpoint registry: saved as it is, adopted on resume (maybe from another directory)."""

    def __init__(self, checkpoints: CheckpointStore) -> None:
        self.checkpoints = checkpoints

    def state_dict(self) -> Any:
        return self.checkpoints.state_dict()

    def load_state_dict(self, state: Any) -> None:
        if state:
            self.checkpoints.adopt(state)

    def snapshot(self) -> Any:
        checkpoints = self.checkpoints
        return checkpoints.registry_snapshot() if isinstance(checkpoints, CheckpointManager) else None

    def restore(self, snapshot: Any) -> None:
        """The registry as it was, adopted checkpoints dropped (another kind of store keeps them: they are
        valid checkpoints, not its own to prune)."""
        checkpoints = self.checkpoints
        if snapshot is not None and isinstance(checkpoints, CheckpointManager):
            checkpoints.restore_registry(snapshot)


def build_monitor_state(
    *,
    run: RunState,
    signals: Mapping[str, Stateful | None],
    follower: Stateful,
    outbox: Outbox,
    checkpoints: CheckpointStore | None,
    run_name: str,
) -> NamedStates:
    """The monitor's entries that exist before the pipeline does; the pipeline's join with
    :func:`add_pipeline_state` (the pipeline acts on the target that holds the training state)."""
    states: dict[str, Stateful | None] = {
        "step": StepCounter(run),
        "data": run.cursor,
        "overrides": run.overrides,
        **signals,
        "follower": follower,
        "notifier": NotifierState(outbox),
        "checkpoints": RegistryState(checkpoints) if checkpoints is not None else None,
    }
    meta = {"version": lambda: VERSION, "run_id": lambda: outbox.run_id, "run_name": lambda: run_name}
    return NamedStates(states, meta=meta)


def add_pipeline_state(
    states: NamedStates, pipeline: Pipeline, *, failsafe: Failsafe, grace_steps: int | None
) -> None:
    """The pipeline's and the executor's entries (an executor that keeps no state saves None)."""
    executor = pipeline.executor
    states.states["pipeline"] = PipelineState(pipeline, failsafe=failsafe, grace_steps=grace_steps)
    states.states["executor"] = executor if isinstance(executor, Stateful) else None
