"""``diagnose``: find out why an incident happened before acting on it: ``data``, ``state`` or
``hardware_suspect``.

The target re-runs the steps from the checkpoint before the incident (a result that does not reproduce is a
transient fault) and replays the incident's batches at that checkpoint (they stand out there too: the data;
they do not: the state), see :mod:`stabmon.diagnose` and docs/diagnose.md. The verdict and its evidence (a
:class:`~stabmon.diagnose.Diagnosis`) are the record's ``after``; the engine then follows the runbook rule
whose ``when: {verdict: ...}`` matches it. It
changes nothing in the run (model, optimizer and RNG are restored exactly), so it cannot be reverted.

``onset_step``, ``step`` and ``metric`` are filled in by the engine (the incident's onset, the step that
opened it, and the metric it is about); a runbook does not set them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from stabmon.diagnose.verdict import Diagnosis
from stabmon.interventions.base import Intervention, Params
from stabmon.interventions.registry import register


class DiagnoseParams(Params):
    """``max_batches``: incident batches replayed (and as many reference batches before them).
    ``rtol``: relative difference of a re-run step's loss or grad norm from the record that counts as not
    reproduced (a deterministic re-run gives 0; GPU kernels with atomics differ by far less than 1e-4).
    ``recur``: the fraction of the recorded excess the incident's batches must show again at the checkpoint
    for the verdict ``data``."""

    max_batches: int = Field(default=8, ge=1, le=64)
    rtol: float = Field(default=1e-4, gt=0, lt=1)
    recur: float = Field(default=0.5, gt=0, le=1)
    onset_step: int | None = None
    step: int | None = None
    metric: str | None = None


@register
class Diagnose(Intervention):
    """Ask the target for a verdict.

    >>> from stabmon.interventions.handle import Handle
    >>> from stabmon.overrides import Overrides
    >>> def diagnose(**params): return Diagnosis("data", "seen again", onset_step=params["onset_step"])
    >>> h = Handle(Overrides(), clock=lambda: 160, hparams=dict, diagnose=diagnose)
    >>> rec = Diagnose(h, {"onset_step": 150, "step": 152, "metric": "loss"}, decision_id="d").apply()
    >>> rec.after["verdict"], rec.before["step"]
    ('data', 160)
    """

    name = "diagnose"
    Params = DiagnoseParams
    revertible = False
    diagnoses = True
    stays_in_force = False  # it re-runs steps and puts the state back as it was

    def _apply(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        p = self.params
        assert isinstance(p, DiagnoseParams)
        step = int(self.target.step)
        onset = p.onset_step if p.onset_step is not None else step
        found: Diagnosis = self.target.diagnose(
            onset_step=onset, step=p.step if p.step is not None else step, metric=p.metric or "loss",
            max_batches=p.max_batches, rtol=p.rtol, recur=p.recur,
        )
        return {"step": step}, found.as_after()
