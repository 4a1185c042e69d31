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

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from stabmon.interventions._state import SECOND_MOMENT, StateIntervention, tensors_of
from stabmon.interventions.base import Params
from stabmon.interventions.handle import Training
from stabmon.interventions.registry import register

log = logging.getLogger(__name__)


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

    >>> from stabmon.interventions.handle import Handle
    >>> from stabmon.overrides import Overrides
    >>> h = Handle(Overrides(), clock=lambda: 7, hparams=dict)  # a replay's: no model, the change is noted
    >>> rec = ResetMoments(h, {"metric": "grad_norm/blocks.1"}, decision_id="d").apply()
    >>> rec.after["tensors"], h.overrides.rewarm_left, h.notes[0]["action"]
    (['blocks.1'], 20, 'reset_moments')
    """

    name = "reset_moments"
    Params = ResetMomentsParams
    revertible = False
    needs = frozenset({SECOND_MOMENT})

    def _apply(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        p = self.params
        assert isinstance(p, ResetMomentsParams)
        training = self.check_applicable()
        tensors = tuple(p.tensors) or tensors_of(p.metric)
        if training is None:
            facts = {"simulated": True, "step": self.target.step, "action": self.name,
                     "tensors": list(tensors) or "all", "second_moment": p.second_moment}
            self.target.note(dict(facts))
        else:
            facts = reset(training, tensors, second_moment=p.second_moment, step=self.target.step)
        overrides = self.target.overrides
        before = {"tensors": list(tensors) or "all", "rewarm_left": overrides.rewarm_left}
        overrides.rewarm_steps, overrides.rewarm_left = p.rewarm_steps, p.rewarm_steps
        return before, {**facts, "second_moment": p.second_moment, "rewarm_steps": p.rewarm_steps}


def reset(training: Training, tensors: Sequence[str], *, second_moment: bool, step: int) -> dict[str, Any]:
    """Zero the first (and second) moments of ``tensors`` (all when empty) in ``training``'s optimizer; the audit
    facts."""
    from stabmon.collect.step.moments import reset_moments

    done = reset_moments(training.model, training.optimizer, names=tensors, second=second_moment)
    log.warning("stabmon: moments of %d tensors reset at step %d (%s)", len(done), step, ", ".join(tensors) or "all")
    return {"reset": len(done), "tensors": done[:20]}
