"""``set_beta2``: set Adam / AdamW's second-moment decay (``betas[1]``) for every param group."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from stabmon.interventions._override import OverrideIntervention
from stabmon.interventions.base import Params
from stabmon.interventions.registry import register


class SetBeta2Params(Params):
    """``beta2``: the new decay, in (0, 1). Lower values forget old squared gradients faster (OPT: 0.98 ->
    0.95)."""

    beta2: float = Field(gt=0, lt=1)


@register
class SetBeta2(OverrideIntervention):
    """Change Adam's beta2.

    >>> from stabmon.interventions.handle import Handle
    >>> from stabmon.overrides import Overrides
    >>> def T(): return Handle(Overrides(), clock=lambda: 5, hparams=lambda: {"beta2": 0.98})
    >>> t = T(); _ = SetBeta2(t, {"beta2": 0.95}, decision_id="d").apply(); t.overrides.beta2
    0.95
    """

    name = "set_beta2"
    Params = SetBeta2Params
    field = "beta2"
    direction = -1
    hparam = "beta2"

    def _new_value(self, current: Any) -> Any:
        assert isinstance(self.params, SetBeta2Params)
        return self.params.beta2
