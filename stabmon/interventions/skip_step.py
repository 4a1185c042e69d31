"""``skip_step``: discard bad updates on the device, whole or element by element.

``factor`` sets ``overrides.skip_factor``: from the next step on, the monitor's optimizer hook discards the update
(with tensor operations on the device, no host synchronisation) whenever the step's gradient norm exceeds
``factor`` times its running mean, as OLMo-core and metaseq do; every skipped update is counted and written
at the next flush (metric ``skipped``). With fused Adam/AdamW, and with torch's default Adam/AdamW (stepped
through the fused kernel while the guard is on), the discard copies nothing (:mod:`stabmon.collect.step.guard`).

``theta`` sets ``overrides.skip_theta``: gradient elements with ``g^2 > theta x v`` (Adam's ``exp_avg_sq``) are
zeroed before each step (SPAM's spike-aware clipping, arXiv 2501.06842, ``theta = 5000``), so one spiking
element does not cost the whole update; it needs an optimizer with ``exp_avg_sq``. Give either or both.
Reverting turns the guard back to what it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, model_validator

from stabmon.interventions._state import SECOND_MOMENT, OverridesIntervention
from stabmon.interventions.base import Params
from stabmon.interventions.registry import register


class SkipStepParams(Params):
    """``factor``: discard an update whose gradient norm exceeds factor x its running mean (> 1).
    ``theta``: zero gradient elements with g^2 > theta x exp_avg_sq (> 1; SPAM: 5000). At least one of the two.
    ``metric``/``value``: filled in by the pipeline."""

    factor: float | None = Field(default=None, gt=1)
    theta: float | None = Field(default=None, gt=1)
    metric: str | None = None
    value: float | None = None

    @model_validator(mode="after")
    def _one(self) -> SkipStepParams:
        if self.factor is None and self.theta is None:
            raise ValueError("give factor (whole steps), theta (elements), or both")
        return self


@register
class SkipStep(OverridesIntervention):
    """Guard against single bad updates.

    >>> from stabmon.interventions.handle import Handle
    >>> from stabmon.overrides import Overrides
    >>> def T(): return Handle(Overrides(), clock=lambda: 5, hparams=lambda: {})
    >>> t = T(); _ = SkipStep(t, {"factor": 6.0}, decision_id="d").apply(); t.overrides.skip_factor
    6.0
    >>> t = T(); rec = SkipStep(t, {"theta": 5000.0}, decision_id="d").apply(); rec.after
    {'skip_theta': 5000.0}
    """

    name = "skip_step"
    Params = SkipStepParams

    @classmethod
    def needs_for(cls, params: Mapping[str, Any]) -> frozenset[str]:
        return frozenset({SECOND_MOMENT}) if params.get("theta") is not None else frozenset()

    def _values(self) -> dict[str, Any]:
        p = self.params
        assert isinstance(p, SkipStepParams)
        out: dict[str, Any] = {}
        if p.factor is not None:
            out["skip_factor"] = p.factor
        if p.theta is not None:
            out["skip_theta"] = p.theta
        return out
