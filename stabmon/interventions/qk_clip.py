"""``qk_clip``: shrink the query/key weights of the attention heads whose logits grew too large (Kimi K2's
QK-clip / MuonClip, arXiv 2507.20534).

When a head's max attention logit ``S`` exceeds ``tau`` (100), its query and key projections are scaled by
``sqrt(tau / S)`` each (the head's logits by ``tau / S``); other heads are untouched. The layer and head come
from the rung (``layer``, ``heads``) or from the incident's metric (``attn_logit/<layer>[/h<k>]``) and its last
value (``S``), filled in by the pipeline; ``max_logit`` overrides ``S``. ``S <= tau`` changes nothing (skipped).
A model without a recognised attention module, or a layer that is none, makes it "not applicable". The scaled
weights are trained on from there: the rung cannot be reverted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from stabmon.interventions._state import ATTENTION, StateIntervention, attention_of
from stabmon.interventions.base import NoChange, Params


class QkClipParams(Params):
    """``tau``: the largest logit a head may keep (Kimi K2: 100). ``layer``: the attention module (None: from the
    metric, else the model's only one). ``heads``: head indices (empty: from the metric, else all heads of the
    layer). ``max_logit``: the offending logit (None: the metric's last value). ``metric``/``value``: filled in by
    the pipeline."""

    tau: float = Field(default=100.0, gt=0)
    layer: str | None = None
    heads: list[int] = Field(default_factory=list)
    max_logit: float | None = Field(default=None, gt=0)
    metric: str | None = None
    value: float | None = None


class QkClip(StateIntervention):
    """Rescale the offending heads' query/key weights.

    >>> from stabmon.overrides import Overrides
    >>> class T:
    ...     overrides = Overrides(); step = 9
    ...     def hparams(self): return {}
    ...     def facts(self): return None
    ...     def reset_moments(self, **kw): return {}
    ...     def qk_clip(self, *, layer, heads, factor): return {"layer": layer, "heads": heads, "factor": factor}
    >>> rec = QkClip(T(), {"metric": "attn_logit/blocks.0.attn/h2", "value": 400.0}, decision_id="d").apply()
    >>> rec.after["layer"], rec.after["heads"], rec.after["factor"]
    ('blocks.0.attn', [2], 0.25)
    """

    name = "qk_clip"
    Params = QkClipParams
    revertible = False
    needs = frozenset({ATTENTION})

    def _apply(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        p = self.params
        assert isinstance(p, QkClipParams)
        self.check_applicable()
        layer, heads = attention_of(p.metric)
        layer = p.layer if p.layer is not None else layer
        chosen = list(p.heads) or list(heads) or None
        logit = p.max_logit if p.max_logit is not None else p.value
        if logit is None:
            raise NoChange("no max logit: give max_logit, or answer an attn_logit anomaly")
        if logit <= p.tau:
            raise NoChange(f"max logit {logit:.4g} is not above tau {p.tau:g}")
        factor = p.tau / logit
        facts = self.state_target().qk_clip(layer=layer, heads=chosen, factor=factor)
        return {"max_logit": logit, "tau": p.tau}, facts
