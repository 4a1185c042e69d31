"""Shared machinery of the interventions that act on the optimizer state or the weights in place.

``reset_moments``, ``adaptive_clip``, ``clip_update``, ``qk_clip`` and ``skip_step`` derive from
:class:`StateIntervention`. What each needs from the run is declared on its class (``needs``) and checked
against the run's :class:`RunFacts` both before the run (``stabmon runbook validate``, the monitor's start-up
warnings: :func:`not_applicable`) and when the rung comes (a rung that cannot act is skipped as
:class:`~stabmon.interventions.base.NoChange`, logged "not applicable", never a crash mid-run).

A rung may leave out which tensor, layer or head it acts on: the pipeline then fills ``metric`` (and ``value``,
the anomaly's last evidence value) from the anomaly that opened the incident (``takes_evidence``), and
:func:`tensors_of` / :func:`attention_of` read the target from the metric's name: ``grad_norm/blocks.1`` names
the layer ``blocks.1``, ``attn_logit/blocks.1.attn`` the attention layer ``blocks.1.attn`` and
``attn_logit/blocks.1.attn/h3`` also its head 3. A metric that names no tensor (``loss``) means all of them.

>>> tensors_of("grad_norm/blocks.1"), tensors_of("loss"), attention_of("attn_logit/blocks.0.attn/h3")
(('blocks.1',), (), ('blocks.0.attn', (3,)))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from stabmon.interventions.base import Intervention, NoChange
from stabmon.interventions.handle import Training, training_of

SECOND_MOMENT = "second_moment"
ADAM_UPDATE = "adam_update"
ATTENTION = "attention"


@dataclass(frozen=True)
class RunFacts:
    """What a live run offers the state-level interventions (a replay knows none of it: ``None`` there)."""

    tensors: frozenset[str]
    """Parameter names, without wrapper prefixes."""
    second_moment: str | None
    """Why the optimizer keeps no ``exp_avg_sq`` (None: it does)."""
    adam_update: str | None
    """Why the optimizer's step cannot be recomputed for ``clip_update`` (None: Adam/AdamW, it can)."""
    attention: tuple[str, ...]
    """Names of the recognised attention modules."""


class StateIntervention(Intervention):
    """Base of the state-level interventions; see the module docstring."""

    changes_training: ClassVar[bool] = True
    stops_run: ClassVar[bool] = False
    rewinds_step: ClassVar[bool] = False
    takes_evidence: ClassVar[bool] = True
    """The pipeline fills ``metric``/``value`` from the incident's anomaly when the rung does not give them."""
    evidence_kinds: ClassVar[tuple[str, ...]] = ()
    """The only kinds of report whose metric may name the target (empty: any): when the incident's anomaly is of
    another kind, the newest recent report of these kinds is the evidence (the pipeline reads them:
    :meth:`~stabmon.interventions.executor.Executor.with_evidence`)."""
    needs: ClassVar[frozenset[str]] = frozenset()
    """What the run must offer: ``second_moment``, ``adam_update``, ``attention``."""

    @classmethod
    def needs_for(cls, params: Mapping[str, Any]) -> frozenset[str]:
        """What a rung with these ``params`` needs (``needs``, unless a parameter changes it)."""
        return cls.needs

    def check_applicable(self) -> Training | None:
        """Raise :class:`NoChange` ("not applicable: ...") when the run cannot take this change; the model and
        optimizer it acts on (None in replay, which knows neither: every rung is taken as applicable there)."""
        training = training_of(self.target)
        if training is not None:
            problem = not_applicable(type(self), self.params.model_dump(), run_facts(training))
            if problem is not None:
                raise NoChange(f"not applicable: {problem}")
        return training


def run_facts(training: Training) -> RunFacts:
    """What the state-level interventions can act on in a run of ``training``'s model and optimizer."""
    from stabmon.collect.cluster.sharding import clean_name
    from stabmon.collect.step.inplace import adam_like
    from stabmon.collect.step.moments import missing_state
    from stabmon.collect.step.qk import attention_layers

    model, optimizer = training.model, training.optimizer
    return RunFacts(tensors=frozenset(clean_name(n) for n, _ in model.named_parameters()),
                    second_moment=missing_state(optimizer, "exp_avg_sq"), adam_update=adam_like(optimizer),
                    attention=tuple(attention_layers(model)))


def not_applicable(cls: type[Intervention], params: Mapping[str, Any], facts: RunFacts) -> str | None:
    """Why a rung of ``cls`` with ``params`` cannot act on a run with ``facts`` (None: it can)."""
    if not issubclass(cls, StateIntervention):
        return None
    needs = cls.needs_for(params)
    if SECOND_MOMENT in needs and facts.second_moment is not None:
        return facts.second_moment
    if ADAM_UPDATE in needs and facts.adam_update is not None:
        return facts.adam_update
    if ATTENTION in needs:
        layer = params.get("layer")
        if not facts.attention:
            return "the model has no recognised attention module (see stabmon.collect.step.qk)"
        if layer is not None and layer not in facts.attention:
            return f"layer {layer!r} is no recognised attention module of the model"
    for name in params.get("tensors") or ():
        if not any(t == name or t.startswith(name + ".") for t in facts.tensors):
            return f"tensor {name!r} names no parameter or layer of the model"
    return None


def tensors_of(metric: str | None) -> tuple[str, ...]:
    """The layer or tensor an anomaly's metric names (``()``: all)."""
    if not metric or "/" not in metric:
        return ()
    return (metric.split("/")[1],)


def attention_of(metric: str | None) -> tuple[str | None, tuple[int, ...]]:
    """(layer, heads) an ``attn_logit/<layer>[/<k>]`` metric names (the collector's names; ``h<k>`` is read too);
    (None, ()) for any other metric.

    >>> attention_of("attn_logit/blocks.0.attn/3"), attention_of("attn_logit/blocks.0.attn"), attention_of("loss")
    (('blocks.0.attn', (3,)), ('blocks.0.attn', ()), (None, ()))
    """
    if not metric or not metric.startswith("attn_logit/"):
        return None, ()
    parts = metric.split("/")
    head = parts[2].removeprefix("h") if len(parts) > 2 else ""
    return parts[1], (int(head),) if head.isdigit() else ()


class OverridesIntervention(StateIntervention):
    """Sets several fields of ``target.overrides`` at once; reverting restores them all."""

    revertible = True

    def _values(self) -> dict[str, Any]:
        raise NotImplementedError

    def _apply(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        self.check_applicable()
        overrides = self.target.overrides
        new = self._values()
        old = {k: getattr(overrides, k) for k in new}
        if old == new:
            raise NoChange(f"{self.name}: {new} already in force")
        for k, v in new.items():
            setattr(overrides, k, v)
        try:
            overrides.validate()
        except ValueError:
            for k, v in old.items():
                setattr(overrides, k, v)
            raise
        self._undo = dict(old)
        return old, new

    def _revert(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        overrides = self.target.overrides
        current = {k: getattr(overrides, k) for k in self._undo}
        for k, v in self._undo.items():
            setattr(overrides, k, v)
        return current, dict(self._undo)
