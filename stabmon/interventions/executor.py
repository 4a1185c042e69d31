"""The executor: turns the engine's decisions into interventions on their target.

:class:`Executor` is the :class:`~stabmon.pipeline.ExecutorLike` of every pipeline. It hands each intervention
the run's :class:`~stabmon.interventions.handle.Handle`: live the monitor's, in replay (``simulated=True``) a
:class:`~stabmon.replay.simulate.Simulation`'s. It looks the
action up in the registry, builds the intervention, applies it and returns its audit record; a ``revert``
decision undoes the intervention named in ``params["intervention_id"]``. A failure is caught, logged and
counted, never raised into training: one line is logged (the traceback only at DEBUG level), the returned
record carries the failure in ``error`` and the engine judges the rung as failed, so the runbook's next rung or
its ``on_failure`` follows. A change that would do nothing or move a value the harmful way
(:class:`~stabmon.interventions.base.NoChange`) is not applied: the record carries the reason in
``not_applied``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from stabmon.events import Anomaly, Decision, InterventionRecord
from stabmon.interventions.base import Intervention, NoChange
from stabmon.interventions.registry import INTERVENTIONS, get_intervention
from stabmon.interventions.traits import REVERT, traits_of

if TYPE_CHECKING:
    from stabmon.interventions.handle import Handle

log = logging.getLogger(__name__)

EVIDENCE_HORIZON = 100
"""Steps between a report that names a layer (``evidence_kinds``) and a decision that may still take it as its
evidence: an older report may no longer hold."""


class Executor:
    """Apply decisions to a target, one at a time, keeping what is needed to revert them (also across a
    resume).

    >>> from stabmon.events import Decision, DecisionStatus
    >>> from stabmon.interventions.handle import Handle
    >>> from stabmon.overrides import Overrides
    >>> def T(): return Handle(Overrides(), clock=lambda: 3, hparams=lambda: {"clip": 1.0})
    >>> ex = Executor(T())
    >>> d = Decision(step=3, action="set_clip", params={"max_norm": 0.5}, status=DecisionStatus.APPLY,
    ...              runbook="r", rule="spike", rung=0, reason="test")
    >>> rec = ex.execute(d); ex.target.overrides.max_norm
    0.5
    >>> undo = Decision(step=9, action="revert", params={"intervention_id": rec.id},
    ...                 status=DecisionStatus.APPLY, runbook="r", rule="spike", rung=0, reason="test")
    >>> _ = ex.execute(undo); ex.target.overrides.max_norm is None
    True
    """

    def __init__(self, target: Handle, *, simulated: bool = False) -> None:
        self.target = target
        self.simulated = simulated
        self.errors = 0
        self._applied: dict[str, Intervention] = {}  # intervention record id -> the intervention
        self._released: dict[str, list[Intervention]] = {}  # release record id -> what it gave back

    def with_evidence(self, decision: Decision, anomaly: Anomaly, recent: Iterable[Anomaly] = ()) -> Decision:
        """``decision`` with ``metric`` (and ``value``, the last evidence value) from ``anomaly`` when its
        intervention takes its target from the evidence and the rung did not name one. An intervention that reads
        only some kinds of report (``evidence_kinds``) takes the newest of ``recent`` of those kinds within
        :data:`EVIDENCE_HORIZON` steps of the decision when ``anomaly`` is of another kind, and nothing without
        one."""
        from stabmon.interventions._state import StateIntervention, tensors_of
        cls = INTERVENTIONS.get(decision.action)
        if cls is None or not issubclass(cls, StateIntervention) or not cls.takes_evidence \
                or "metric" in decision.params:
            return decision
        if cls.evidence_kinds and anomaly.kind not in cls.evidence_kinds:
            named = [a for a in recent if a.kind in cls.evidence_kinds and tensors_of(a.metric)
                     and abs(decision.step - a.step) <= EVIDENCE_HORIZON]
            if not named:
                return decision  # no report of the kinds it reads: it names nothing (the rung is not applicable)
            anomaly = named[-1]
        params = {**decision.params, "metric": anomaly.metric}
        value = anomaly.evidence[-1][1] if anomaly.evidence else None
        if value is not None and math.isfinite(value):
            params["value"] = float(value)
        return dataclasses.replace(decision, params=params)

    def commit(self, decision: Decision, tell: Callable[[Decision, InterventionRecord], None],
               into: list[Any]) -> None:
        """The one commit point of a change: apply ``decision`` (:meth:`execute`), append its record to ``into``
        (first: whatever follows, the change is on the record), then ``tell`` the engine what it changed. The
        follow-ups it leaves (a rollback's checkpoint) are claimed by its record and done by the flush once every
        rank has followed. Whole or absent: when the engine cannot take a change that can be undone, it is undone
        and its record carries the failure (a change that cannot be undone, a restored state, stays on the
        record as done)."""
        record = self.execute(decision)
        if record is None:
            return
        into.append(record)
        try:
            tell(decision, record)
        except Exception as exc:  # noqa: BLE001 - never raise into training; never leave a change half-made
            into[-1] = self._untold(decision, record, exc)

    def _untold(self, decision: Decision, record: InterventionRecord, exc: Exception) -> InterventionRecord:
        self.errors += 1
        problem = f"the engine could not take it: {type(exc).__name__}: {_first_line(exc)}"
        intervention = self._applied.get(record.id)
        if intervention is None or not record.ok:
            log.error("stabmon: %s at step %s: %s; the change stands", decision.action, record.step, problem)
            return record
        try:
            intervention.revert(decision_id=decision.id)
        except Exception as undo:  # noqa: BLE001
            log.error("stabmon: %s at step %s: %s, and undoing it failed (%s: %s); the change stands",
                      decision.action, record.step, problem, type(undo).__name__, _first_line(undo))
            return record
        del self._applied[record.id]
        log.error("stabmon: %s at step %s: %s; undone", decision.action, record.step, problem)
        return dataclasses.replace(record, error=f"{problem} (undone)")

    def execute(self, decision: Decision) -> InterventionRecord | None:
        """Apply (or revert, release, re-apply) ``decision``; its audit record. Never raises."""
        record = self._execute(decision)
        if self.target.follow_ups is not None:  # a live run's changes may leave follow-ups
            self.target.follow_ups.claim(record.id)
        return record

    def _execute(self, decision: Decision) -> InterventionRecord:
        try:
            traits = traits_of(decision.action)
            if traits.undoes:
                return self._revert(decision)
            if traits.releases:
                return self._release(decision)
            if traits.reapplies:
                return self._reapply(decision)
            return self._apply(decision)
        except NoChange as exc:  # nothing to do, or only harm to do: skipped, not failed
            log.info("stabmon: %s for decision %s skipped: %s", decision.action, decision.id, exc)
            return InterventionRecord(
                decision_id=decision.id, step=_step(self.target), action=decision.action, before={},
                after={}, not_applied=str(exc), simulated=self.simulated,
            )
        except Exception as exc:  # noqa: BLE001 - never raise into training
            self.errors += 1
            # one line: the runbook moves on (the rung is judged failed); the traceback only at DEBUG level
            log.error("stabmon: %s at step %s failed (decision %s): %s: %s; the runbook's next rung or "
                      "on_failure follows", decision.action, _step(self.target), decision.id, type(exc).__name__,
                      _first_line(exc))
            log.debug("stabmon: %s failed", decision.action, exc_info=True)
            return InterventionRecord(
                decision_id=decision.id, step=_step(self.target), action=decision.action, before={},
                after={}, error=f"{type(exc).__name__}: {exc}", reverted=decision.action == REVERT,
                simulated=self.simulated,
            )

    def _apply(self, decision: Decision) -> InterventionRecord:
        cls = get_intervention(decision.action)
        intervention = cls(self.target, decision.params, decision_id=decision.id, simulated=self.simulated)
        record = intervention.apply()
        if cls.revertible:
            self._applied[record.id] = intervention
        return record

    def _revert(self, decision: Decision) -> InterventionRecord:
        intervention_id = decision.params.get("intervention_id")
        intervention = self._applied.get(str(intervention_id))
        if intervention is None:
            raise LookupError(f"no revertible intervention {intervention_id!r} applied by this executor")
        record = intervention.revert(decision_id=decision.id)
        del self._applied[str(intervention_id)]
        return record

    def _release(self, decision: Decision) -> InterventionRecord:
        """Give back the changes named in ``params["intervention_ids"]`` (newest first): each is reverted, and a
        learning rate that comes back up climbs to the schedule over ``params["steps"]`` steps instead of at
        once. The record shows the values before and after, and the re-warm-up. Whole or nothing: when one of
        them cannot be given back, those already given back are put back and every one stays in force."""
        ids = [str(i) for i in decision.params.get("intervention_ids", ())]
        missing = [i for i in ids if i not in self._applied]
        if not ids or missing:
            raise LookupError(f"no change in force to release: {', '.join(missing) or 'none named'}")
        lr_now = _lr(self.target)
        before: dict[str, Any] = {}
        after: dict[str, Any] = {}
        steps = int(decision.params.get("steps", 0))
        given_back: list[Intervention] = []
        try:
            for record_id in ids:
                intervention = self._applied[record_id]
                undone = intervention.release(decision_id=decision.id, steps=steps)
                given_back.append(intervention)
                for key, value in undone.before.items():
                    before.setdefault(key, value)
                after.update(undone.after)
        except Exception:
            self._put_back(given_back, decision.id)
            raise
        for record_id in ids:
            del self._applied[record_id]
        lr_back = _lr(self.target)
        if lr_now is not None and lr_back and 0 < lr_now < lr_back and steps > 0:
            self.target.overrides.ramp(lr_now / lr_back, steps)
            before["lr"], after["lr"] = lr_now, lr_back
            after.update(ramp_from=lr_now / lr_back, ramp_steps=steps)
        record = InterventionRecord(decision_id=decision.id, step=_step(self.target), action=decision.action,
                                    before=before, after=after, simulated=self.simulated)
        self._released[record.id] = given_back
        return record

    def _put_back(self, given_back: list[Intervention], decision_id: str) -> None:
        """Undo a release that failed part-way: what it gave back is in force again (oldest first)."""
        for intervention in reversed(given_back):
            try:
                intervention.reapply(decision_id=decision_id)
            except Exception as exc:  # noqa: BLE001 - said, and kept where a later revert can still find it
                log.error("stabmon: %s (decision %s) was given back by a release that failed and could not be "
                          "put back: %s: %s", intervention.name, intervention.decision_id, type(exc).__name__,
                          _first_line(exc))

    def _reapply(self, decision: Decision) -> InterventionRecord:
        """Put back what the release named in ``params["intervention_id"]`` gave back (the re-warm-up ends).
        Whole or nothing: when one of them cannot be put back, those already put back are given back again and
        the release stands."""
        release_id = str(decision.params.get("intervention_id"))
        given_back = self._released.get(release_id)
        if given_back is None:
            raise LookupError(f"no release {release_id!r} to undo by this executor")
        ramp = (self.target.overrides.ramp_from, self.target.overrides.ramp_steps,
                self.target.overrides.ramp_done)
        self.target.overrides.ramp(1.0, 0)
        before: dict[str, Any] = {}
        after: dict[str, Any] = {}
        done: list[Intervention] = []
        try:
            for intervention in reversed(given_back):  # oldest first, as they were applied
                record = intervention.reapply(decision_id=decision.id)
                done.append(intervention)
                for key, value in record.before.items():
                    before.setdefault(key, value)
                after.update(record.after)
        except Exception:
            for intervention in reversed(done):
                intervention.release(decision_id=decision.id, steps=0)
            o = self.target.overrides
            o.ramp_from, o.ramp_steps, o.ramp_done = ramp
            raise
        del self._released[release_id]
        for intervention in done:
            assert intervention.record is not None
            self._applied[intervention.record.id] = intervention
        return InterventionRecord(decision_id=decision.id, step=_step(self.target), action=decision.action,
                                  before=before, after=after, simulated=self.simulated)

    def state_dict(self) -> dict[str, Any]:
        return {"errors": self.errors, "applied": {k: v.state_dict() for k, v in self._applied.items()},
                "released": {k: [v.state_dict() for v in vs] for k, vs in self._released.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.errors = int(state.get("errors", 0))
        self._applied = {record_id: self._restored(sd) for record_id, sd in state.get("applied", {}).items()}
        self._released = {k: [self._restored(sd) for sd in vs] for k, vs in state.get("released", {}).items()}

    def _restored(self, sd: Mapping[str, Any]) -> Intervention:
        intervention = get_intervention(sd["name"])(
            self.target, sd["params"], decision_id=sd["decision_id"], simulated=self.simulated
        )
        intervention.load_state_dict(dict(sd))
        return intervention


def _lr(target: Any) -> float | None:
    """The learning rate in force on ``target`` (None: it reports none)."""
    try:
        lr = target.hparams().get("lr")
    except Exception:  # noqa: BLE001 - a target that cannot report its LR gets no re-warm-up
        return None
    return float(lr) if isinstance(lr, (int, float)) else None


def _step(target: Any) -> int:
    try:
        return int(target.step)
    except Exception:  # noqa: BLE001
        return -1


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0]
