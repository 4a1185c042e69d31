"""``scale_layer_lr``: cut the learning rate of the param groups that hold the flagged layer, and only theirs.

A learning rate can be wrong for one part of the model only: an output layer trained at many times the LR of the
rest (no z-loss: Wortsman et al. 2023's output-logit divergence), a head or an embedding given its own LR. Its
weights then move far faster than every other layer's, and a global answer is the wrong one: a global LR cut
or cap slows the whole model to calm one group, and a restart brings the same LR back. This rung multiplies the
learning rate of the param groups holding the flagged tensors by ``factor`` (0.1), in place, and leaves every
other group as its schedule has it.

Which layer: the rung's ``tensors`` (parameter names or layer prefixes), else the layer of the latest
``out_of_line`` report (the incident's own anomaly, or the newest report within :data:`~stabmon.interventions.
executor.EVIDENCE_HORIZON` steps; the detector compares each layer's update ratio ``||dtheta|| / ||theta||`` with
the other layers', sampled by default with Adam/AdamW and where ``MonitorConfig.updates`` asks), filled in by the
pipeline so every rank cuts the same groups. Another anomaly's layer (a gradient-norm spike in ``blocks.1``) is no
evidence that the layer's learning rate is wrong, and is not taken. Without any of them the rung is "not
applicable" (skipped, logged) and the ladder moves on, and so it is when the groups it would cut hold more than
``max_share`` (half) of the model's parameters: that is a global cut, ``scale_lr``'s.

Judged like every rung; reverted (the group's factor back) when it did not resolve the incident. Released when it
did: the cut holds until the schedule alone gives the group at most the LR the cut gave it when it was made
(a schedule that decays has then done the cut's work), and is then lifted, re-warmed over the release's steps
(:meth:`~stabmon.overrides.Overrides.settle_layers`); the trouble coming back puts it back.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from stabmon.interventions._state import StateIntervention, tensors_of
from stabmon.interventions.base import NoChange, Params
from stabmon.interventions.handle import Training
from stabmon.interventions.registry import register

LAYER_LR = "layer_lr"
"""The lever this rung pulls: one group's learning rate (not the run's: a later global LR rung still counts)."""


class ScaleLayerLrParams(Params):
    """``factor``: multiplies the flagged groups' learning rate (0.1: a tenth). ``tensors``: parameter names or
    layer prefixes (empty: from the evidence, see the module docstring). ``max_share``: the largest share of the
    model's parameters the groups cut may hold. ``metric``/``value``: the evidence (filled in by the pipeline)."""

    factor: float = Field(default=0.1, gt=0, lt=1)
    tensors: list[str] = Field(default_factory=list)
    max_share: float = Field(default=0.5, gt=0, le=1)
    metric: str | None = None
    value: float | None = None


@register
class ScaleLayerLr(StateIntervention):
    """Cut the learning rate of the flagged layer's param groups.

    >>> import torch
    >>> from stabmon.interventions.handle import Handle, Training
    >>> from stabmon.overrides import Overrides
    >>> body, lm_head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
    >>> model = torch.nn.ModuleDict({"body": body, "lm_head": lm_head})
    >>> opt = torch.optim.SGD([{"params": body.parameters()}, {"params": lm_head.parameters(), "lr": 9.0}], lr=1e-3)
    >>> t = Handle(Overrides(), clock=lambda: 20, hparams=dict, training=Training(model, opt))
    >>> rec = ScaleLayerLr(t, {"metric": "update_ratio/lm_head"}, decision_id="d").apply()
    >>> rec.after["groups"], t.overrides.layer_factor(1), t.overrides.layer_factor(0)
    ({'1': 0.1}, 0.1, 1.0)
    """

    name = "scale_layer_lr"
    Params = ScaleLayerLrParams
    revertible = True
    evidence_kinds = ("out_of_line",)
    samples = "updates"  # the per-layer update ratios the out_of_line detector compares

    @classmethod
    def levers(cls, params: Mapping[str, Any]) -> frozenset[str]:
        return frozenset({LAYER_LR})

    def _apply(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        p = self.params
        assert isinstance(p, ScaleLayerLrParams)
        training = self.check_applicable()
        tensors = tuple(p.tensors) or tensors_of(p.metric)
        if not tensors:
            raise NoChange("not applicable: no layer is flagged (name tensors, or sample the update ratios with "
                           "MonitorConfig.updates so that the out_of_line detector can name one)")
        if training is None:  # a replay knows no param groups: the cut is recorded only
            return {"tensors": list(tensors)}, {"tensors": list(tensors), "factor": p.factor, "simulated": True}
        found = layer_groups(training, tensors)
        groups: dict[int, Any] = found["groups"]
        share = float(found["share"])
        if share > p.max_share:
            raise NoChange(f"not applicable: {', '.join(tensors)} share(s) param group(s) "
                           f"{', '.join(map(str, sorted(groups)))} with {share:.0%} of the model's parameters: "
                           f"a cut there is a global one (scale_lr)")
        overrides = self.target.overrides
        old = copy.deepcopy(overrides.layer_lr)
        new = copy.deepcopy(old)
        for i in groups:
            prev = new.get(str(i))
            factor = prev["factor"] if prev and not prev.get("done") else 1.0  # a cut being lifted starts afresh
            new[str(i)] = {"factor": factor * p.factor}
        overrides.layer_lr = new
        overrides.validate()
        self._undo = {"old": old, "new": copy.deepcopy(new),
                      "lrs": {str(i): lr for i, lr in groups.items() if isinstance(lr, (int, float))}}
        before = {"tensors": list(tensors), "groups": {str(i): old.get(str(i), {}).get("factor", 1.0)
                                                         for i in groups},
                  "lr": {str(i): lr for i, lr in groups.items()}}
        after = {"tensors": list(tensors), "groups": {str(i): new[str(i)]["factor"] for i in groups},
                 "share": round(share, 6)}
        return before, after

    def _set(self, which: str) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        """Set the layer cuts to what they were before this rung (``"old"``) or after it (``"new"``)."""
        if which not in self._undo:
            raise NoChange("this rung changed no param group (a replay's)")
        overrides = self.target.overrides
        before = {"layer_lr": copy.deepcopy(overrides.layer_lr)}
        overrides.layer_lr = copy.deepcopy(self._undo[which])
        return before, {"layer_lr": copy.deepcopy(overrides.layer_lr)}

    def _revert(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        return self._set("old")

    def _reapply(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        return self._set("new")

    def _release(self, steps: int) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        """Held until the schedule gives each cut group at most what the cut gave it, then lifted over ``steps``."""
        before, _ = self._set("new")
        released = self.target.overrides.layer_lr
        for group, cut in released.items():
            lr = self._undo["lrs"].get(group)
            cut["lift_below"] = lr * cut["factor"] if lr is not None else 0.0
            cut["ramp"], cut["done"] = int(steps), 0
        return before, {"layer_lr": copy.deepcopy(released),
                        "lifted_below_lr": {g: c["lift_below"] for g, c in released.items()}}


def layer_groups(training: Training, tensors: tuple[str, ...]) -> dict[str, Any]:
    """The optimizer's param groups holding ``tensors`` (names or layer prefixes) with the LR their schedule gives
    them now, and the share of the model's parameters those groups hold: ``{"groups": {index: lr}, "share": f}``."""
    from stabmon.collect.step.moments import select

    wanted = {id(p) for p in select(training.model, tensors).values()}
    groups: dict[int, Any] = {}
    total = held = 0
    for i, group in enumerate(training.optimizer.param_groups):
        n = sum(p.numel() for p in group["params"])
        total += n
        if any(id(p) in wanted for p in group["params"]):
            lr = group.get("lr")
            groups[i] = float(lr) if isinstance(lr, (int, float)) else None
            held += n
    if not groups:
        raise ValueError(f"tensors: {', '.join(tensors)} are in no param group of the optimizer")
    return {"groups": groups, "share": held / total if total else 1.0}
