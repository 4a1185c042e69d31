"""``adaptive_clip``: clip each gradient tensor against its own running norm (AdaGC, arXiv 2502.11034).

Sets ``overrides.adaptive_clip`` (``lambda_rel``) and ``adaptive_clip_beta``: from the next step on, the optimizer
hook clips every gradient tensor to ``lambda_rel x`` the running mean of its own clipped norm, on the norms it
computes anyway (summed over ranks under FSDP: the same coefficients on every rank). On until the incident is
judged; reverting (``on_failure: revert``, or the engine releasing it) turns it off.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from stabmon.interventions._state import OverridesIntervention
from stabmon.interventions.base import Params
from stabmon.interventions.registry import register


class AdaptiveClipParams(Params):
    """``lambda_rel``: clip a tensor above this multiple of its running norm (> 1; AdaGC: 1.05).
    ``beta``: decay of the running norm (AdaGC: 0.98). ``metric``/``value``: filled in by the pipeline."""

    lambda_rel: float = Field(default=1.05, gt=1, le=100)
    beta: float = Field(default=0.98, gt=0, lt=1)
    metric: str | None = None
    value: float | None = None


@register
class AdaptiveClip(OverridesIntervention):
    """Turn on per-tensor adaptive clipping.

    >>> from stabmon.interventions.handle import Handle
    >>> from stabmon.overrides import Overrides
    >>> def T(): return Handle(Overrides(), clock=lambda: 5, hparams=lambda: {})
    >>> t = T(); iv = AdaptiveClip(t, {}, decision_id="d"); rec = iv.apply()
    >>> rec.after, t.overrides.adaptive_clip
    ({'adaptive_clip': 1.05, 'adaptive_clip_beta': 0.98}, 1.05)
    >>> _ = iv.revert(decision_id="r"); t.overrides.adaptive_clip is None
    True
    """

    name = "adaptive_clip"
    Params = AdaptiveClipParams

    def _values(self) -> dict[str, Any]:
        p = self.params
        assert isinstance(p, AdaptiveClipParams)
        return {"adaptive_clip": p.lambda_rel, "adaptive_clip_beta": p.beta}
