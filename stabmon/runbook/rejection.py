"""What rejecting a proposal does to the changes its incident already made (kept apart from the engine).

An incident that climbs its ladder leaves each rung's change in force while the next is proposed. The
engine keeps those changes in :attr:`Incident.in_force` (:func:`track`, on every applied decision and
revert). When a human rejects the next proposal, the incident closes and the runbook's
``approval.on_reject`` says what happens to them (:func:`plan`):

- ``revert`` (the default): every change that can be undone is reverted, newest first, by ``revert``
  decisions of the same incident, each naming the rejected decision in ``params["rejected"]``; a change that
  cannot be undone (a rollback, a skipped step) stays, and the reason says so.
- ``keep``: they stay in force.

The rejected decision's reason ends with what happened, e.g. ``rejected at step 45 (on_reject: revert):
reverting rung 1 (set_clip)``, and ``stabmon trace`` shows the values each revert restored.

>>> from stabmon.runbook.state import Change, Incident
>>> inc = Incident(id="i", rule="r", anomaly_id=None, metric="loss", onset_step=0, baseline=None, trigger="t")
>>> inc.in_force = [Change("iv1", "d1", "set_clip", 0, True), Change("iv2", "d2", "rollback", 1, False)]
>>> note, undo = plan(inc, step=45, policy="revert")
>>> note, [c.intervention_id for c in undo]
('rejected at step 45 (on_reject: revert): reverting rung 1 (set_clip); rung 2 (rollback) cannot be undone', ['iv1'])
>>> plan(inc, step=45, policy="keep")[0]
'rejected at step 45 (on_reject: keep): rung 1 (set_clip), rung 2 (rollback) stay in force'
"""

from __future__ import annotations

from stabmon.events import Decision, InterventionRecord
from stabmon.interventions.traits import traits_of
from stabmon.runbook.state import Change, Incident


def track(incident: Incident, decision: Decision, record: InterventionRecord) -> None:
    """Update the incident's changes in force with an applied decision (or the revert of one). What leaves
    nothing in force (an alert, a diagnosis, a stop: ``stays_in_force`` false), failed or was skipped is not
    tracked."""
    traits = traits_of(decision.action)
    if traits.undoes or traits.releases:
        if record.ok:
            gone = {str(decision.params.get("intervention_id"))} | set(decision.params.get("intervention_ids", ()))
            incident.in_force = [c for c in incident.in_force if c.intervention_id not in gone]
        return
    if not traits.stays_in_force or not record.ok or record.not_applied is not None or traits.reapplies:
        return
    incident.in_force.append(Change(intervention_id=record.id, decision_id=decision.id, action=decision.action,
                                    rung=decision.rung, revertible=holds(decision.action, record)))


def holds(action: str, record: InterventionRecord) -> bool:
    """Whether the change ``record`` made stays in force until undone, as its intervention class says (an action
    this process has not registered: as its traits say)."""
    from stabmon.interventions import INTERVENTIONS

    cls = INTERVENTIONS.get(action)
    return cls.holds(record) if cls is not None else traits_of(action).revertible


def plan(incident: Incident, *, step: int, policy: str) -> tuple[str, list[Change]]:
    """(the note added to the rejected decision's reason, the changes to revert, newest first)."""
    head = f"rejected at step {step} (on_reject: {policy})"
    changes = incident.in_force
    if not changes:
        return f"{head}: the incident had changed nothing", []
    if policy == "keep":
        return f"{head}: {_names(changes)} stay{'s' if len(changes) == 1 else ''} in force", []
    undo = [c for c in reversed(changes) if c.revertible]
    stuck = [c for c in changes if not c.revertible]
    parts = [f"reverting {_names(undo)}"] if undo else []
    if stuck:
        parts.append(f"{_names(stuck)} cannot be undone")
    return f"{head}: {'; '.join(parts)}", undo


def _names(changes: list[Change]) -> str:
    return ", ".join(f"rung {c.rung + 1} ({c.action})" for c in changes)
