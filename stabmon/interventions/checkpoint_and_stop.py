"""``checkpoint_and_stop``: save a checkpoint and stop the run with :data:`STOP_EXIT_CODE`.

This is the only way stabmon ends a run on purpose. The target saves (atomically) and asks the training
loop to stop; the process then exits with :data:`STOP_EXIT_CODE` (86) so a job scheduler or wrapper script
can tell "stabmon stopped this run for a human to look at" from a crash (1, or a signal) and from success
(0). The same path is taken when the kill-switch file appears (see :class:`stabmon.checkpoints.KillSwitch`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from stabmon.checkpoints import STOP_EXIT_CODE
from stabmon.interventions.base import Intervention, Params
from stabmon.interventions.registry import register

__all__ = ["STOP_EXIT_CODE", "CheckpointAndStop", "CheckpointAndStopParams"]


class CheckpointAndStopParams(Params):
    """``reason``: recorded with the checkpoint and shown in the alert. ``exit_code``: the process's exit code
    (default :data:`STOP_EXIT_CODE`); e.g. :data:`~stabmon.checkpoints.HARDWARE_EXIT_CODE` after ``diagnose``
    found a hardware suspect, so the scheduler moves the job to other machines."""

    reason: str = "runbook: checkpoint and stop"
    exit_code: int | None = Field(default=None, ge=1, le=255)


@register
class CheckpointAndStop(Intervention):
    """Save and stop.

    >>> from stabmon.interventions.handle import Handle
    >>> from stabmon.overrides import Overrides
    >>> def stop(*, reason): return {"path": "ckpt-42.pt", "exit_code": STOP_EXIT_CODE}
    >>> h = Handle(Overrides(), clock=lambda: 42, hparams=dict, checkpoint_and_stop=stop)
    >>> CheckpointAndStop(h, {}, decision_id="d").apply().after["exit_code"]
    86
    """

    name = "checkpoint_and_stop"
    Params = CheckpointAndStopParams
    revertible = False
    stops_run = True
    stays_in_force = False  # the run ends: nothing is left to revert or keep

    def _apply(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        assert isinstance(self.params, CheckpointAndStopParams)
        code = self.params.exit_code
        kwargs = {} if code is None else {"exit_code": code}
        result = dict(self.target.checkpoint_and_stop(reason=self.params.reason, **kwargs))
        result.setdefault("exit_code", STOP_EXIT_CODE if code is None else code)
        return {"step": int(self.target.step)}, result
