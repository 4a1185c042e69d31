"""``scale_lr``: multiply the learning rate the scheduler produces, held around ``optimizer.step()``.

The change lives in ``overrides.lr_scale``; the monitor multiplies every param group's learning rate by it
just before the optimizer step and restores the scheduler's value right after, so any LR scheduler keeps
its own trajectory underneath and cannot overwrite the intervention, and the scale survives a resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, model_validator

from stabmon.interventions._override import OverrideIntervention
from stabmon.interventions.base import Params
from stabmon.interventions.registry import register


class ScaleLrParams(Params):
    """Exactly one of ``factor`` (multiply the scale in force: ``0.9`` = "cut LR by 10%") or ``scale`` (set
    the scale relative to the schedule: ``0.667`` = "two-thirds of the planned LR")."""

    factor: float | None = Field(default=None, gt=0)
    scale: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_of(self) -> ScaleLrParams:
        if (self.factor is None) == (self.scale is None):
            raise ValueError("give exactly one of factor or scale")
        return self


@register
class ScaleLr(OverrideIntervention):
    """Scale the learning rate.

    >>> from stabmon.interventions.handle import Handle
    >>> from stabmon.overrides import Overrides
    >>> def T(): return Handle(Overrides(), clock=lambda: 5, hparams=lambda: {"lr": 1e-3})
    >>> t = T(); rec = ScaleLr(t, {"factor": 0.9}, decision_id="d").apply()
    >>> t.overrides.lr_scale, round(rec.after["lr"], 6)
    (0.9, 0.0009)
    """

    name = "scale_lr"
    Params = ScaleLrParams
    field = "lr_scale"
    direction = -1
    hparam = "lr"

    @classmethod
    def levers(cls, params: Mapping[str, Any]) -> frozenset[str]:
        """``{"lr"}`` for a cut (``factor`` or ``scale`` below 1)."""
        cut = params.get("factor") if params.get("factor") is not None else params.get("scale")
        return frozenset({"lr"}) if cut is not None and cut < 1 else frozenset()

    def _new_value(self, current: Any) -> Any:
        p = self.params
        assert isinstance(p, ScaleLrParams)
        return current * p.factor if p.factor is not None else p.scale

    def _compared(self, in_force: Any, old: Any, new: Any) -> tuple[Any, Any]:
        return old, new  # the scales: a schedule at LR 0 (warm-up) still takes the cut for its later steps

    def _expected(self, in_force: Any, old: Any, new: Any) -> Any:
        if in_force is None:
            return None
        return in_force / old * new
