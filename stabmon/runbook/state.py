"""The runbook engine's state: what it remembers between records, as dataclasses.

::

    anomaly a rule matches --> Sighting (per rule, until the persistence horizon passes)
    a rule fires           --> Incident --(each observed record)--> WindowRow in Incident.window

:func:`incident_state` / :func:`incident_from_state` turn an :class:`Incident` into plain values and back
(``dataclasses.asdict``, with the decision's status as its string value), so an engine's ``state_dict`` is safe
for ``torch.load(weights_only=True)`` and JSON. It also reads the incident of a state saved before
these dataclasses (state ``version`` 1).

>>> inc = Incident(id="i1", rule="spikes", anomaly_id="a1", metric="loss", onset_step=3, baseline=2.0,
...                trigger="spike on loss at step 3")
>>> inc.window.append(WindowRow(step=4, loss=2.1, signal=2.1, matched=0))
>>> incident_from_state(incident_state(inc)) == inc
True
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stabmon.events import Decision, DecisionStatus


@dataclass(slots=True)
class Sighting:
    """An anomaly a rule matched, kept for the rule's persistence test (``seen`` of the last ``of`` records).

    >>> Sighting(tick=12, step=1040, onset=1037).onset
    1037
    """

    tick: int  #: the engine's record counter when it was seen
    step: int  #: the anomaly's step
    onset: int  #: the first step of its evidence (where a rollback must reach back to)


@dataclass(slots=True)
class WindowRow:
    """One record observed after a change, as the change is judged on it.

    >>> WindowRow(step=7, loss=2.5, signal=None, matched=1).matched
    1
    """

    step: int
    loss: float | None  #: the record's loss (None: not reported; NaN kept, it fails a ``loss_within`` test)
    signal: float | None  #: the record's value of the metric that triggered the incident
    matched: int  #: anomalies in the record that the incident's rule matches


@dataclass(slots=True)
class Change:
    """A change an incident made to training that is still in force (what a rejection reverts or keeps).

    >>> Change(intervention_id="iv1", decision_id="d1", action="set_clip", rung=0, revertible=True).rung
    0
    """

    intervention_id: str  #: the record of its application (what a revert decision names)
    decision_id: str
    action: str
    rung: int  #: index of its rung in the ladder of the rule that made it
    revertible: bool  #: whether the intervention can be undone (a rollback cannot)


@dataclass(slots=True)
class Incident:
    """One episode, from the anomaly that opened it to the outcome that closed it.

    ``decision`` is the change being proposed or observed; its outcome is judged on ``window``.

    >>> Incident(id="i1", rule="r", anomaly_id=None, metric="loss", onset_step=0, baseline=None,
    ...          trigger="t").phase
    'idle'
    """

    id: str
    rule: str  #: name of the runbook rule that fired
    anomaly_id: str | None  #: the anomaly that opened it
    metric: str  #: that anomaly's metric (its value is the window's ``signal``)
    onset_step: int  #: earliest evidence step of the sightings that made the rule fire
    baseline: float | None  #: median loss before the onset (None: no loss seen before it)
    trigger: str  #: the sentence every decision's reason starts with
    rung: int = 0  #: index of the current rung in the rule's ladder
    attempt: int = 1  #: attempt at the current rung (rungs with ``repeat`` > 1)
    held: int | None = None  #: steps the last failed attempt of the current rung held the trouble off (a repeat
    #: must hold it off longer than the attempt before, or the rung is spent: see ``judging.held``)
    phase: str = "idle"  #: "idle" (no decision yet), "proposed" (waiting for an answer) or "observing"
    decision: Decision | None = None  #: the current decision
    decision_tick: int = 0  #: the record counter when a proposal was made (its approval timeout counts from it)
    decision_time: float | None = None  #: wall-clock time of that record (a timeout given as a duration)
    window: list[WindowRow] = field(default_factory=list)
    intervention_id: str | None = None  #: the record of the current decision's application
    error: str | None = None  #: why the current decision failed to apply
    skipped: str | None = None  #: why the current decision was not applied (it would change nothing, or do harm)
    effective_step: int | None = None  #: records of earlier steps predate the change: not observed
    await_step: int | None = None  #: a live rollback: observing starts at the record of this (restored) step
    until_step: int | None = None  #: a rollback: the step it rolled back from; its window runs past it (judging)
    rewound_by: int = 0  #: a live rollback that left the step count to a framework: how far the restored training
    #: lags the count (its restored step minus its checkpoint's); the onset comes back that much later (judging)
    changed: bool = False  #: a decision of this incident changed training
    alerted: bool = False  #: a decision of this incident was only an alert
    stop: bool = False  #: the pending decision is the runbook's checkpoint-and-stop
    releasing: bool = False  #: the current decision gives back the changes that resolved it (a release)
    diagnosis: str | None = None  #: the verdict of an applied ``diagnose`` rung, until the engine follows it
    cleared: int | None = None  #: the checkpoint step a diagnosis judged from, where its verdict did not blame the
    #: state (``data``, ``hardware_suspect``): a known-good state, so a restart lands no further back than it
    in_force: list[Change] = field(default_factory=list)  #: changes made and not reverted, oldest first
    seen: str = ""  #: the first line of the opening anomaly's message: what an ``alert_only`` with no text says
    reached: float | None = None  #: the lowest loss before the onset (of the baseline's records)
    noise: float | None = None  #: the pre-incident losses' spread (1.4826 x their MAD; None: under 5 of them)
    changed_at: int | None = None  #: the step the incident's first change to training took effect (a diagnosis
    #: re-runs and replays only steps before it: later ones ran under a change that may be reverted since)
    others: list[str] = field(default_factory=list)  #: anomalies of other rules that change training, seen while
    #: the current decision was observed (each counted against it as the incident's own; the first few kept)

    @property
    def current(self) -> Decision:
        """The current decision: an open incident always has one (its first is issued as it opens)."""
        assert self.decision is not None, f"incident {self.id} has no decision"
        return self.decision


_INCIDENT_FIELDS = frozenset(f.name for f in dataclasses.fields(Incident))


def decision_state(decision: Decision) -> dict[str, Any]:
    """Plain values of a Decision (the status as its string value)."""
    d = dataclasses.asdict(decision)
    d["status"] = decision.status.value
    d["params"] = dict(decision.params)
    return d


def decision_from_state(d: Mapping[str, Any]) -> Decision:
    return Decision(**{**d, "status": DecisionStatus(d["status"]), "params": copy.deepcopy(dict(d["params"]))})


def incident_state(inc: Incident) -> dict[str, Any]:
    d = dataclasses.asdict(inc)
    d["decision"] = None if inc.decision is None else decision_state(inc.decision)
    return d


def incident_from_state(d: Mapping[str, Any], *, version: int = 2) -> Incident:
    """The inverse of :func:`incident_state`. ``version=1``: the incident as the engine of state version 1
    kept it, a dict of these fields (some present only once set) with ``[step, loss, signal, matched]``
    lists as window rows."""
    values = dict(d)
    rows = d.get("window", ())
    values["window"] = [WindowRow(*w) for w in rows] if version == 1 else [WindowRow(**w) for w in rows]
    values["in_force"] = [Change(**c) for c in d.get("in_force", ())]
    decision = d.get("decision")
    values["decision"] = None if decision is None else decision_from_state(decision)
    unknown = sorted(set(values) - _INCIDENT_FIELDS)
    if unknown:
        raise ValueError(f"engine.state.incident.{unknown[0]} is not a field of an incident")
    return Incident(**values)


