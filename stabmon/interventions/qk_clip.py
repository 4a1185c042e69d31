"""``qk_clip``: shrink the query/key weights of the attention heads whose logits grew too large (Kimi K2's
QK-clip / MuonClip, arXiv 2507.20534).

When a head's max attention logit ``S`` exceeds ``tau`` (100), its query and key projections are scaled by
``sqrt(tau / S)`` each (the head's logits by ``tau / S``); other heads are untouched.

**Standing** (the default, as Kimi K2 runs it): the clip is turned on (``overrides.qk_tau``) and from then on,
after every optimizer step, each head whose max logit on the sampled sub-batch exceeded ``tau`` is scaled back
to it (:class:`stabmon.collect.step.qk.StandingQkClip`: measured on every step while on, device arithmetic only). On
until the incident is judged: reverting it turns the clip off (the weights it scaled stay as trained); releasing
it (the incident resolved) raises its bound geometrically to 8x tau over the release's steps, then turns it off, so
the heads grow back gradually and a returning trouble is seen while they are still bounded; the trouble returning
puts it back on at tau. A model whose attention the monitor cannot measure gets a warning.
One clip does not hold while the learning rate that grew the logits is still in force: on ``attn-logit-growth``
a single clip at detection was followed by the same growth and a restart (``docs/recovery.md``).

**Once** (``standing: false``): the offending head is scaled once, now. The layer and head come from the rung
(``layer``, ``heads``) or from the incident's metric (``attn_logit/<layer>[/<head>]``) and its last value
(``S``), filled in by the pipeline; ``max_logit`` overrides ``S``; ``S <= tau`` changes nothing (skipped). The
scaled weights are trained on from there: that part cannot be reverted.

A model without a recognised attention module, or a layer that is none, makes it "not applicable".
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from stabmon.events import InterventionRecord
from stabmon.interventions._state import ATTENTION, StateIntervention, attention_of
from stabmon.interventions.base import NoChange, Params
from stabmon.interventions.registry import register
from stabmon.overrides import QK_RELEASE_RISE

log = logging.getLogger(__name__)


class QkClipParams(Params):
    """``tau``: the largest logit a head may keep (Kimi K2: 100). ``standing``: clip after every step until the
    incident is judged (default), or once. For a clip once: ``layer``, the attention module (None: from the
    metric, else the model's only one); ``heads``, head indices (empty: from the metric, else all heads of the
    layer); ``max_logit``, the offending logit (None: the metric's last value). ``metric``/``value``: filled in by
    the pipeline."""

    tau: float = Field(default=100.0, gt=0)
    standing: bool = True
    layer: str | None = None
    heads: list[int] = Field(default_factory=list)
    max_logit: float | None = Field(default=None, gt=0)
    metric: str | None = None
    value: float | None = None


@register
class QkClip(StateIntervention):
    """Clip the offending heads' query/key weights: from now on after every step (standing), or once.

    >>> from stabmon.interventions.handle import Handle
    >>> from stabmon.overrides import Overrides
    >>> def T(): return Handle(Overrides(), clock=lambda: 9, hparams=dict)  # a replay's: the clip once is noted
    >>> params = {"metric": "attn_logit/blocks.0.attn/2", "value": 400.0}
    >>> rec = QkClip(T(), {**params, "standing": False}, decision_id="d").apply()
    >>> rec.after["layer"], rec.after["heads"], rec.after["factor"]
    ('blocks.0.attn', [2], 0.25)
    >>> t = T(); iv = QkClip(t, params, decision_id="s"); rec = iv.apply()
    >>> rec.before, rec.after, t.overrides.qk_tau
    ({'qk_tau': None}, {'qk_tau': 100.0}, 100.0)
    >>> _ = iv.revert(decision_id="r"); t.overrides.qk_tau is None
    True
    """

    samples = "attention"  # the per-head max attention logits it holds under tau
    name = "qk_clip"
    Params = QkClipParams
    revertible = True
    needs = frozenset({ATTENTION})

    @classmethod
    def holds(cls, record: InterventionRecord) -> bool:
        """A standing clip stays on until it is turned off; a clip once is done."""
        return "qk_tau" in record.after

    def _apply(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        p = self.params
        assert isinstance(p, QkClipParams)
        training = self.check_applicable()
        if p.standing:
            overrides = self.target.overrides
            if overrides.qk_tau == p.tau:
                raise NoChange(f"a standing qk_clip at tau {p.tau:g} is already on")
            before = overrides.qk_tau
            overrides.qk_tau = p.tau
            self._undo = {"qk_tau": before}
            return {"qk_tau": before}, {"qk_tau": p.tau}
        layer, heads = attention_of(p.metric)
        layer = p.layer if p.layer is not None else layer
        chosen = list(p.heads) or list(heads) or None
        logit = p.max_logit if p.max_logit is not None else p.value
        if logit is None:
            raise NoChange("no max logit: give max_logit, or answer an attn_logit anomaly")
        if logit <= p.tau:
            raise NoChange(f"max logit {logit:.4g} is not above tau {p.tau:g}")
        factor = p.tau / logit
        if training is None:
            facts = {"simulated": True, "step": self.target.step, "action": self.name, "layer": layer,
                     "heads": chosen or "all", "factor": factor}
            self.target.note(dict(facts))
        else:
            from stabmon.collect.step.qk import qk_clip

            facts = qk_clip(training.model, layer=layer, heads=chosen, factor=factor)
            log.warning("stabmon: qk_clip at step %d: %s heads %s x %.4g logits", self.target.step, facts["layer"],
                        facts["heads"], factor)
        return {"max_logit": logit, "tau": p.tau}, facts

    def _release(self, steps: int) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        """Give the clip back gradually: its bound rises to ``QK_RELEASE_RISE`` x tau over ``steps`` steps, then
        it is off (at once when ``steps`` is 0)."""
        overrides = self.target.overrides
        if steps < 1 or overrides.qk_tau is None:
            return self._revert()
        overrides.qk_release_steps, overrides.qk_release_done = int(steps), 0
        return {"qk_tau": overrides.qk_tau}, {"qk_tau": overrides.qk_tau, "release_steps": int(steps),
                                              "rise": QK_RELEASE_RISE}

    def _revert(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        overrides = self.target.overrides
        now, overrides.qk_tau = overrides.qk_tau, self._undo.get("qk_tau")
        overrides.qk_release_steps = overrides.qk_release_done = 0
        return {"qk_tau": now}, {"qk_tau": overrides.qk_tau}

    def _reapply(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        p = self.params
        assert isinstance(p, QkClipParams)
        overrides = self.target.overrides
        now, overrides.qk_tau = overrides.qk_tau, p.tau
        overrides.qk_release_steps = overrides.qk_release_done = 0
        return {"qk_tau": now}, {"qk_tau": p.tau}
