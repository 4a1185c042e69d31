"""``reset_moments``: zero Adam's first (and optionally second) moments of the flagged tensors, then re-warm the LR.

SPAM (arXiv 2501.06842): a gradient spike lives on in the moments for hundreds of steps (``beta2 = 0.999``);
resetting them drops it at once, and a short LR re-warm-up keeps the first steps on fresh moments small. The
tensors are the rung's ``tensors`` (parameter names or layer prefixes), else the layer the incident's metric
names (``grad_norm/blocks.1``, filled in by the pipeline), else all of them. The re-warm-up multiplies the LR
by ``k / (rewarm_steps + 1)`` on the k-th step after the reset (``overrides.rewarm_left`` counts it down) and
ends by itself. The old moments are gone, so the rung cannot be reverted; an optimizer without Adam moments
makes it "not applicable" (skipped, logged).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from stabmon.interventions._state import SECOND_MOMENT, StateIntervention, tensors_of
from stabmon.interventions.base import Params
from stabmon.interventions.registry import register


class ResetMomentsParams(Params):
    """``tensors``: parameter names or layer prefixes (empty: from the incident's metric, else all).
    ``second_moment``: also zero ``exp_avg_sq`` (default: only ``exp_avg``).
    ``rewarm_steps``: LR re-warm-up length after the reset (0: none).
    ``metric``/``value``: the incident's metric and last value (filled in by the pipeline)."""

    tensors: list[str] = Field(default_factory=list)
    second_moment: bool = False
    rewarm_steps: int = Field(default=20, ge=0, le=100_000)
    metric: str | None = None
    value: float | None = None


@register
class ResetMoments(StateIntervention):
    """Reset the moments of the flagged tensors.

    >>> from stabmon.overrides import Overrides
    >>> class T:
    ...     overrides = Overrides(); step = 7
    ...     def hparams(self): return {}
    ...     def facts(self): return None
    ...     def reset_moments(self, *, tensors, second_moment): return {"reset": 2, "tensors": list(tensors)}
    ...     def qk_clip(self, **kw): return {}
    >>> t = T(); rec = ResetMoments(t, {"metric": "grad_norm/blocks.1"}, decision_id="d").apply()
    >>> rec.after["tensors"], t.overrides.rewarm_left
    (['blocks.1'], 20)
    """

    name = "reset_moments"
    Params = ResetMomentsParams
    revertible = False
    needs = frozenset({SECOND_MOMENT})

    def _apply(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        p = self.params
        assert isinstance(p, ResetMomentsParams)
        self.check_applicable()
        tensors = tuple(p.tensors) or tensors_of(p.metric)
        facts = self.state_target().reset_moments(tensors=tensors, second_moment=p.second_moment)
        overrides = self.target.overrides
        before = {"tensors": list(tensors) or "all", "rewarm_left": overrides.rewarm_left}
        overrides.rewarm_steps, overrides.rewarm_left = p.rewarm_steps, p.rewarm_steps
        return before, {**facts, "second_moment": p.second_moment, "rewarm_steps": p.rewarm_steps}
