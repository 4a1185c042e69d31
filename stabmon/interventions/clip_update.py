"""``clip_update``: cap the RMS of each tensor's Adam update (StableAdamW arXiv 2304.13013; Levanter's update
clipping).

Sets ``overrides.update_rms_cap``: after each Adam/AdamW step, a tensor whose update direction
``m^ / (sqrt(v^) + eps)`` has an RMS above ``max_rms`` is moved back to a step of ``lr x max_rms / RMS`` (the
second-moment under-estimation that precedes loss spikes, ``g^2 >> v``, shows as an RMS well above 1). Needs
Adam/AdamW without amsgrad (else "not applicable"). Reverting turns the cap off.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from stabmon.interventions._state import ADAM_UPDATE, OverridesIntervention
from stabmon.interventions.base import Params
from stabmon.interventions.registry import register


class ClipUpdateParams(Params):
    """``max_rms``: the largest RMS of a tensor's update direction (> 0; 1.0 is StableAdamW's).
    ``metric``/``value``: filled in by the pipeline."""

    max_rms: float = Field(default=1.0, gt=0, le=100)
    metric: str | None = None
    value: float | None = None


@register
class ClipUpdate(OverridesIntervention):
    """Cap each tensor's update RMS.

    >>> from stabmon.interventions.handle import Handle
    >>> from stabmon.overrides import Overrides
    >>> def T(): return Handle(Overrides(), clock=lambda: 5, hparams=lambda: {})
    >>> t = T(); rec = ClipUpdate(t, {"max_rms": 1.0}, decision_id="d").apply()
    >>> rec.before, rec.after
    ({'update_rms_cap': None}, {'update_rms_cap': 1.0})
    """

    name = "clip_update"
    Params = ClipUpdateParams
    needs = frozenset({ADAM_UPDATE})

    def _values(self) -> dict[str, Any]:
        p = self.params
        assert isinstance(p, ClipUpdateParams)
        return {"update_rms_cap": p.max_rms}
