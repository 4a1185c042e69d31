"""``set_clip``: set the gradient-clipping threshold (L2 norm of all gradients) the monitor clips to."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from stabmon.interventions._override import OverrideIntervention
from stabmon.interventions.base import Params
from stabmon.interventions.registry import register


class SetClipParams(Params):
    """``max_norm``: the new clipping threshold (> 0)."""

    max_norm: float = Field(gt=0)


@register
class SetClip(OverrideIntervention):
    """Tighten (or loosen) gradient clipping.

    >>> from stabmon.interventions.handle import Handle
    >>> from stabmon.overrides import Overrides
    >>> def T(): return Handle(Overrides(), clock=lambda: 5, hparams=lambda: {"clip": 2.5})
    >>> rec = SetClip(T(), {"max_norm": 1.5}, decision_id="d").apply()
    >>> dict(rec.before), dict(rec.after)
    ({'max_norm': None, 'clip': 2.5}, {'max_norm': 1.5, 'clip': 1.5})
    """

    name = "set_clip"
    Params = SetClipParams
    field = "max_norm"
    direction = -1
    hparam = "clip"

    def _new_value(self, current: Any) -> Any:
        assert isinstance(self.params, SetClipParams)
        return self.params.max_norm
