"""``set_weight_decay``: set the (decoupled) weight decay for every param group."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from stabmon.interventions._override import OverrideIntervention
from stabmon.interventions.base import Params
from stabmon.interventions.registry import register


class SetWeightDecayParams(Params):
    """``weight_decay``: the new value (>= 0). OPT-175B raised it from 0.05 to 0.1."""

    weight_decay: float = Field(ge=0)


@register
class SetWeightDecay(OverrideIntervention):
    """Change weight decay.

    >>> from stabmon.interventions.handle import Handle
    >>> from stabmon.overrides import Overrides
    >>> def T(): return Handle(Overrides(), clock=lambda: 5, hparams=lambda: {"weight_decay": 0.05})
    >>> rec = SetWeightDecay(T(), {"weight_decay": 0.1}, decision_id="d").apply()
    >>> rec.before["weight_decay"]
    0.05
    """

    name = "set_weight_decay"
    Params = SetWeightDecayParams
    field = "weight_decay"
    direction = 1
    hparam = "weight_decay"

    def _new_value(self, current: Any) -> Any:
        assert isinstance(self.params, SetWeightDecayParams)
        return self.params.weight_decay
