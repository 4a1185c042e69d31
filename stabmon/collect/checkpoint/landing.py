"""Where the restart after a transient fault lands: the state a diagnosis' re-run trained again on a good execution.

A diagnosis (:mod:`stabmon.diagnose`) re-runs the recorded steps ``c..s`` from the checkpoint of step ``c``. When
step ``s`` does not reproduce (``hardware_suspect``: the first execution computed what the same inputs do not), the
re-run holds the state after steps ``c..s-1`` trained again on a good execution, each step checked against the
record: the state a rollback to ``c`` reaches once the loop has trained those steps a second time. The default
runbook answers that verdict with that very rollback, in the same flush. :class:`RerunLanding` keeps the re-run's
state as a checkpoint of step ``s`` in host memory, and the rollback lands on it instead of training ``s - c``
steps again (Megatron's rerun state machine likewise goes on from a transient fault's good re-execution).

The state is a checkpoint's, entry by entry:

* the model, optimizer and GradScaler as the re-run left them (before step ``s``'s update);
* the scheduler as the checkpoint's, stepped ``s - c`` times;
* the monitor's own state as the checkpoint's, with the step count ``s``, the data position of step ``s``'s batch and
  the skip guard's running mean fed the re-run's gradient norms (what the flushes of the steps trained again feed
  it); the entries a rollback leaves as they are (:data:`~stabmon.collect.checkpoint.monitor_state.EXCLUDED`) are the
  checkpoint's and are not loaded.

It is built only where each entry is known to be right, and the diagnosis' record says why not otherwise (the
rollback then lands on a checkpoint, as without it):

* one process (the diagnosis offers it nowhere else);
* the monitor counts the steps (a framework keeps its own count and data position through a rollback);
* a loop that draws its batches through ``monitor.steps()`` recorded step ``s``'s batch index and the checkpoint's
  data position is step ``c``'s (a loop that draws its own batches has no position to set);
* no scheduler, or one of torch's that the loop steps once per optimizer step: its ``last_epoch`` has moved as many
  steps as the run since the checkpoint (``ReduceLROnPlateau`` steps on a metric: refused).

It lives until the end of the flush that made it (:meth:`drop`): a rollback in a later flush lands on a checkpoint
as before. Until then it holds one copy of the model's weights; the optimizer state is the re-run's own tensors,
which the diagnosis' restore replaced and did not overwrite (checked: were they shared, it is refused). A rollback
takes it when it is at least as new as the newest checkpoint it may land on, and it validates as a checkpoint does
(finite, fits the model and optimizer). Nothing of it is written to disk; the rollback's own follow-up saves the
restored state on the new timeline, as after any rollback, so a resume continues from it.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stabmon.checkpoints import CheckpointInfo, nonfinite_entry
from stabmon.collect.batches import BatchLog
from stabmon.collect.checkpoint.restore import ROLLBACK, NamedStates, TrainingState
from stabmon.collect.checkpoint.snapshots import nbytes, tensors
from stabmon.collect.run_state import RunState
from stabmon.collect.step.optim import OptimizerHooks
from stabmon.events import Metric, StepRecord

log = logging.getLogger(__name__)

PREFIX = "memory://rerun-"
"""The ``path`` of a landing's :class:`~stabmon.checkpoints.CheckpointInfo` (no file: host memory)."""


@dataclass(frozen=True)
class Landing:
    """A checkpoint of step ``info.step`` built from a re-run (see the module docstring)."""

    info: CheckpointInfo
    state: dict[str, Any]
    start: int
    """The checkpoint step the re-run started from."""


class RerunLanding:
    """The landing a diagnosis offered in this flush, if any; see the module docstring."""

    def __init__(self, training: TrainingState, run: RunState) -> None:
        self.training, self.run = training, run
        self.held: Landing | None = None

    def offer(self, *, checkpoint: Mapping[str, Any], start: int, stop: int, trained: Mapping[str, Any],
              recorded: Mapping[int, StepRecord], batches: BatchLog) -> str | None:
        """Keep the state after steps ``start..stop-1`` trained again from ``checkpoint`` (``trained``: the model's,
        optimizer's and GradScaler's state as the re-run left them) as a checkpoint of step ``stop``. Returns why
        it cannot be (None: kept)."""
        self.held = None
        if stop <= start:
            return f"the re-run did not reproduce its first step ({start}): the checkpoint is the landing"
        try:
            monitor = self._monitor(checkpoint.get("monitor"), start, stop, recorded, batches)
            if isinstance(monitor, str):
                return monitor
            scheduler = self._scheduler(checkpoint.get("scheduler"), start, stop)
            if isinstance(scheduler, str):
                return scheduler
            shared = self._shared(trained.get("optimizer"))
            if shared is not None:
                return shared
            optimizer = _at_rest(trained["optimizer"], checkpoint.get("optimizer"), scheduler)
        except Exception as exc:  # noqa: BLE001 - a landing is an optimisation: the checkpoint is the fallback
            return f"{type(exc).__name__}: {exc}"
        state = {**checkpoint, **trained, "optimizer": optimizer, "scheduler": scheduler, "monitor": monitor}
        size = nbytes(trained.get("model"))
        info = CheckpointInfo(step=stop, path=f"{PREFIX}{stop}", nbytes=size, own=True)
        self.held = Landing(info=info, state=state, start=start)
        return None

    def take(self, before_step: int, *, newest: int | None,
             check: Callable[[dict[str, Any]], str | None]) -> Landing | None:
        """The landing, when it is at or before ``before_step``, at least as new as ``newest`` (the newest checkpoint
        step a rollback could land on instead) and valid; it is given up either way once it lands or fails."""
        held = self.held
        if held is None or held.info.step > before_step or (newest is not None and held.info.step < newest):
            return None
        self.held = None
        bad = nonfinite_entry(held.state)
        problem = f"non-finite values in {bad}" if bad is not None else check(held.state)
        if problem is not None:
            log.warning("stabmon: the re-run's state at step %d refused as a landing: %s", held.info.step, problem)
            return None
        return held

    def drop(self) -> None:
        """Forget the landing (the flush that made it is over)."""
        self.held = None

    # -- the entries that move with the steps --------------------------------------------------------------
    def _monitor(self, saved: Any, start: int, stop: int, recorded: Mapping[int, StepRecord],
                 batches: BatchLog) -> dict[str, Any] | str:
        """The checkpoint's monitor state at step ``stop``, or why it cannot be."""
        if not isinstance(saved, Mapping):
            return "the checkpoint holds no monitor state"
        if "monitor.step" in self.training.exclude.get(ROLLBACK, ()):
            return "a framework counts the steps: a rollback leaves its step count and data to it"
        out = dict(saved)
        out["step"] = stop
        data = saved.get("data")
        if self.run.cursor.drawing:  # the loop draws through monitor.steps(): the position of step stop's batch
            first, entry = batches.get(start), batches.get(stop)
            if not isinstance(data, Mapping) or first is None or first.batch_index is None or entry is None \
                    or entry.batch_index is None:
                return "the data position of the steps re-run is not known"
            position, skip = int(data["position"]), set(data.get("skip", ()))
            if position > first.batch_index or any(i not in skip for i in range(position, first.batch_index)):
                return (f"the checkpoint's data position ({position}) is not that of step {start}'s batch "
                        f"({first.batch_index})")
            out["data"] = {**data, "position": entry.batch_index}
        hooks = self._hooks()
        if hooks is not None and isinstance(saved.get("hooks"), Mapping):
            out["hooks"] = hooks.learned(saved["hooks"], ((recorded[s].get(Metric.GRAD_NORM),
                                                           bool(recorded[s].get(Metric.SKIPPED)))
                                                          for s in range(start, stop)))
        return out

    def _hooks(self) -> OptimizerHooks | None:
        monitor = self.training.states.get("monitor")
        hooks = monitor.states.get("hooks") if isinstance(monitor, NamedStates) else None
        return hooks if isinstance(hooks, OptimizerHooks) else None

    def _scheduler(self, saved: Any, start: int, stop: int) -> Any:
        """The checkpoint's scheduler state stepped ``stop - start`` times (None: no scheduler), or why not."""
        live = self.training.states.get("scheduler")
        if live is None:
            return saved
        if not isinstance(live, torch.optim.lr_scheduler.LRScheduler) or \
                isinstance(live, torch.optim.lr_scheduler.ReduceLROnPlateau):
            return f"the scheduler ({type(live).__name__}) is not one stepped once per optimizer step"
        if not isinstance(saved, Mapping) or not isinstance(saved.get("last_epoch"), int):
            return "the checkpoint holds no scheduler state to step"
        if live.last_epoch - saved["last_epoch"] != self.run.step - start:
            return (f"the scheduler moved {live.last_epoch - saved['last_epoch']} steps since the checkpoint, the "
                    f"run {self.run.step - start}: it is not stepped once per optimizer step")
        now = copy.deepcopy(live.state_dict())
        optimizer = live.optimizer
        lrs = [g.get("lr") for g in optimizer.param_groups]
        try:
            live.load_state_dict(copy.deepcopy(dict(saved)))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # ("lr_scheduler.step() before optimizer.step()": not a loop)
                for _ in range(stop - start):
                    live.step()
            return copy.deepcopy(live.state_dict())
        finally:
            live.load_state_dict(now)
            for group, lr in zip(optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr

    def _shared(self, saved: Any) -> str | None:
        """Why the re-run's optimizer state cannot be kept: it shares a tensor with the live optimizer's (a restore
        that wrote into it instead of replacing it)."""
        live = {t.data_ptr() for t in tensors(self.training.optimizer.state_dict().get("state")) if t.numel()}
        if any(t.numel() and t.data_ptr() in live for t in tensors((saved or {}).get("state"))):
            return "the re-run's optimizer state is the live optimizer's (restored in place)"
        return None


def _at_rest(trained: Mapping[str, Any], saved: Any, scheduler: Any) -> dict[str, Any]:
    """The re-run's optimizer state with the checkpoint's param groups (the re-run wrote each step's recorded
    values into them: the learning rate in force, an override's included), their learning rate the one the
    scheduler sets for the next step (the checkpoint's without a scheduler): what a checkpoint of that step holds."""
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(groups, list) or len(groups) != len(trained["param_groups"]):
        raise ValueError("the checkpoint's optimizer has other param groups than the re-run's")
    lrs = scheduler.get("_last_lr") if isinstance(scheduler, Mapping) else None
    if lrs is not None and len(lrs) != len(groups):
        raise ValueError("the scheduler's learning rates do not match the param groups")
    rest = [{**g, "params": t["params"], **({"lr": lrs[i]} if lrs is not None else {})}
            for i, (g, t) in enumerate(zip(groups, trained["param_groups"], strict=True))]
    return {**trained, "param_groups": rest}


__all__ = ["PREFIX", "Landing", "RerunLanding"]
