"""Does a runbook fit the optimizer in force? Warnings for rungs that would change nothing or cannot act.

A rung that would move a value the harmful way, or not at all, is skipped when it comes (see
:class:`~stabmon.interventions.base.NoChange`); this module says so before the run starts, so the person who
chose the runbook can pick another. Each rule's ladder is walked in order with the values in force, so
OPT-175B's clipping ladder ``1.5 -> 1.0`` on a run that already clips at 1.0 reports both rungs.

>>> from stabmon.runbook import load_runbook
>>> for line in fit_warnings(load_runbook("opt175b"), {"clip": 1.0, "beta2": 0.95, "weight_decay": 0.1}):
...     print(line)
rule instability rung 1: set_clip to 1.5 would not lower clip (1 in force): it will be skipped
rule instability rung 2: set_clip to 1 would not lower clip (1 in force): it will be skipped
rule instability rung 3: set_beta2 to 0.95 would not lower beta2 (0.95 in force): it will be skipped
rule instability rung 4: set_weight_decay to 0.1 would not raise weight_decay (0.1 in force): it will be skipped
>>> for part in fit_warnings(load_runbook("palm-rollback"), {}, checkpoints=False)[-1].split("; "):
...     print(part)
rollback needs checkpoints (Monitor checkpoint_dir= or checkpoints=): rule loss_spike rung 1
rule loss_spike rung 2
rule loss_scale_collapse rung 1 will fail
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from stabmon.interventions import INTERVENTIONS, Intervention, RunFacts, ScaleLr, get_intervention, not_applicable
from stabmon.interventions._override import OverrideIntervention
from stabmon.interventions.traits import levers_of, traits_of
from stabmon.runbook.schema import Runbook


def unfit_rungs(
    runbook: Runbook, *, checkpoints: bool | None = None, facts: RunFacts | None = None,
    sampled: AbstractSet[str] | None = None, batches: bool | None = None,
) -> dict[tuple[str, int], str]:
    """The rungs that cannot act in this loop, by ``(rule name, rung index from 0)``, with why: the engine passes
    over them without trying, escalating or paging (:meth:`~stabmon.runbook.engine.Engine.drop_rungs`). What is
    not known is not held against a rung (a None argument). ``checkpoints=False``: no checkpoint store (a rollback
    has nothing to restore, a diagnosis nothing to re-run from); ``facts``: the run's model and optimizer state
    (a state-level rung that finds nothing to act on); ``sampled``: the ``MonitorConfig`` sections that sample (a
    rung whose evidence a section off would sample); ``batches=False``: the loop hands no batch to the monitor
    (a diagnosis has nothing to replay).

    >>> from stabmon.runbook import load_runbook
    >>> dropped = unfit_rungs(load_runbook("default"), checkpoints=False, batches=False)
    >>> print(dropped[("nonfinite", 0)]); print(dropped[("nonfinite", 1)])
    diagnose needs checkpoints to re-run from (Monitor checkpoint_dir= or checkpoints=)
    rollback needs checkpoints (Monitor checkpoint_dir= or checkpoints=)
    """
    out: dict[tuple[str, int], str] = {}
    for rule in runbook.rules:
        for i, rung in enumerate(rule.ladder):
            why = _cannot_act(rung, checkpoints=checkpoints, facts=facts, sampled=sampled, batches=batches)
            if why is not None:
                out[(rule.name, i)] = why
        if batches is False:
            out.update(_restarts_subsumed(rule, out))
    return out


def _restarts_subsumed(rule: Any, unfit: Mapping[tuple[str, int], str]) -> dict[tuple[str, int], str]:
    """Without the batches a rollback that only skips data is a plain restart; where a later rung of the ladder
    restarts too (and changes the recipe as well), the plain one would only meet the same fault again before it:
    dropped, so that the first restart that runs is the one that changes something. A plain restart that is the
    ladder's last restart is kept (a transient fault is fixed by restarting alone).

    >>> from stabmon.runbook import load_runbook
    >>> rb = load_runbook("default")
    >>> dropped = unfit_rungs(rb, batches=False)
    >>> why = dropped[("instability", 2)]
    >>> why.startswith("rollback skips batches"), why.endswith("a later rung of its ladder restarts with a change")
    (True, True)
    >>> ("loss_scale", 0) in dropped  # its last restart: kept, a plain restart
    False
    """
    out: dict[tuple[str, int], str] = {}
    ladder: list[Any] = list(rule.ladder)
    for i, rung in enumerate(ladder):
        if (rule.name, i) in unfit or not traits_of(rung.action).rewinds_step:
            continue
        if levers_of(rung.action, rung.params.model_dump()) != {"data"}:
            continue
        if any((rule.name, j) not in unfit and traits_of(ladder[j].action).rewinds_step
               and levers_of(ladder[j].action, ladder[j].params.model_dump()) - {"data"}
               for j in range(i + 1, len(ladder))):
            out[(rule.name, i)] = (f"{rung.action} skips batches, and this loop hands none to the monitor: it would "
                                   "be a plain restart, and a later rung of its ladder restarts with a change")
    return out


def dropped_as_config(runbook: str, unfit: Mapping[tuple[str, int], str]) -> dict[str, Any]:
    """:func:`unfit_rungs`' result for ``runbook`` as plain values, stored with a live run, so that a replay of the
    run with that runbook drops the same rungs (:func:`dropped_from_config`).

    >>> config = {"ladder": dropped_as_config("default", {("r", 1): "why"})}
    >>> dropped_from_config(config, runbook="default"), dropped_from_config(config, runbook="opt175b")
    ({('r', 1): 'why'}, {})
    """
    return {"runbook": runbook, "dropped": {f"{rule}/{index}": why for (rule, index), why in unfit.items()}}


def dropped_from_config(config: Mapping[str, Any], *, runbook: str) -> dict[tuple[str, int], str]:
    """The rungs a stored live run dropped from ``runbook`` (nothing when it ran another runbook, or stored none:
    an import, an older release)."""
    ladder = config.get("ladder")
    dropped = ladder.get("dropped") if isinstance(ladder, Mapping) and ladder.get("runbook") == runbook else None
    if not isinstance(dropped, Mapping):
        return {}
    out: dict[tuple[str, int], str] = {}
    for key, why in dropped.items():
        rule, _, index = str(key).rpartition("/")
        if rule and index.isdigit():
            out[(rule, int(index))] = str(why)
    return out


def _cannot_act(rung: Any, *, checkpoints: bool | None, facts: RunFacts | None,
                sampled: AbstractSet[str] | None, batches: bool | None) -> str | None:
    cls = INTERVENTIONS[rung.action]
    traits = traits_of(rung.action)
    if facts is not None and (problem := not_applicable(cls, rung.params.model_dump(), facts)) is not None:
        return f"{rung.action} is not applicable ({problem})"
    section = cls.samples
    if sampled is not None and section is not None and section not in sampled:
        return (f"{rung.action} acts on what MonitorConfig.{section} samples, and it samples nothing (every=0; "
                f"set e.g. MonitorConfig.{section}.every=10)")
    if traits.rewinds_step and checkpoints is False:
        return "rollback needs checkpoints (Monitor checkpoint_dir= or checkpoints=)"
    if traits.diagnoses and checkpoints is False:
        return f"{rung.action} needs checkpoints to re-run from (Monitor checkpoint_dir= or checkpoints=)"
    if traits.diagnoses and batches is False:
        return (f"{rung.action} needs the batches: this loop hands none to the monitor (draw them through "
                "monitor.steps(loader), or pass begin_step(batch=...))")
    return None


def fit_warnings(
    runbook: Runbook, hparams: Mapping[str, float], *, checkpoints: bool | None = None,
    facts: RunFacts | None = None, sampled: AbstractSet[str] | None = None,
) -> list[str]:
    """One line per rung that cannot act on a run with these ``hparams`` (as
    :meth:`~stabmon.monitor.Monitor.hparams` reports them: a missing key means the optimizer has no such
    setting). ``checkpoints=False`` also reports the rollbacks, which need checkpoints to restore (one line for
    all of them); ``facts`` (the live run's optimizer state and model) also the state-level rungs that cannot act
    (no ``exp_avg_sq``, no recognised attention module, a tensor that does not exist); ``sampled`` (the
    ``MonitorConfig`` sections that sample, e.g. ``{"updates"}``) also the rungs that act on what a section off
    would sample (one line per section)."""
    out: list[str] = []
    rollbacks: list[str] = []
    idle: dict[str, list[str]] = {}  # MonitorConfig section off -> the rungs that act on what it samples
    for rule in runbook.rules:
        in_force = dict(hparams)
        ladder: list[Any] = list(rule.ladder)  # one pydantic model per action
        for i, rung in enumerate(ladder, start=1):
            where = f"rule {rule.name} rung {i}: {rung.action}"
            problem = not_applicable(INTERVENTIONS[rung.action], rung.params.model_dump(), facts) if facts else None
            if problem is not None:
                out.append(f"{where} is not applicable ({problem}): it will be skipped")
            section = INTERVENTIONS[rung.action].samples
            if problem is None and sampled is not None and section is not None and section not in sampled:
                idle.setdefault(section, []).append(f"rule {rule.name} rung {i} ({rung.action})")
            if traits_of(rung.action).rewinds_step and checkpoints is False:
                rollbacks.append(f"rule {rule.name} rung {i}")
            out += _override_warnings(where, get_intervention(rung.action), rung.params, in_force)
    for section, rungs in idle.items():  # one line per section, however many rungs: the fix is the same
        out.append(f"MonitorConfig.{section} samples nothing (every=0): {'; '.join(rungs)} will be skipped "
                   f"(set MonitorConfig.{section}.every, e.g. 10, for the evidence they act on)")
    if rollbacks:  # one line, however many rungs: the fix is the same
        out.append("rollback needs checkpoints (Monitor checkpoint_dir= or checkpoints=): "
                   f"{'; '.join(rollbacks)} will fail")
    return out


def _override_warnings(where: str, cls: type[Intervention], params: Any, in_force: dict[str, float]) -> list[str]:
    """What a rung that sets one value would do with the values in force (which it updates, for the next rung);
    the value and the way it may move are the intervention's own declarations (``hparam``, ``direction``)."""
    if issubclass(cls, ScaleLr):
        factor = params.factor
        return ([f"{where} factor {factor:g} would not lower the LR: it will be skipped"]
                if factor is not None and factor >= 1 else [])
    if not issubclass(cls, OverrideIntervention) or not cls.direction or len(cls.Params.model_fields) != 1:
        return []
    (param,) = cls.Params.model_fields  # the one value the rung sets
    hparam, direction, target = cls.hparam, cls.direction, float(getattr(params, param))
    if hparam not in in_force:
        return [f"{where}: the optimizer has no {hparam}: it will change nothing"]
    now = float(in_force[hparam])
    if (target - now) * direction <= 0:
        way = "lower" if direction < 0 else "raise"
        return [f"{where} to {target:g} would not {way} {hparam} ({now:g} in force): it will be skipped"]
    in_force[hparam] = target
    return []
