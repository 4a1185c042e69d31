"""The runbook engine: a pure state machine from anomalies to decisions and outcomes (no torch, no I/O).

For each StepRecord (with the anomalies the detectors found in it) the engine moves through::

    idle --(a rule's condition holds)--> proposed (propose mode) --(approved / auto-applied)--> observing
    idle --(a rule's condition holds, apply mode)--------------------------------------------> observing
    observing --(window over, see judging.py)--> judge --> resolved: idle (cooldown)
                                       --> next rung: observing again  | revert, then next rung | stop

It never makes a second change while one is being observed, so every outcome is attributable to one change.
Every decision, outcome and intervention of one episode shares an ``incident_id``. Durations (observation
windows, cooldown, budget window, approval timeout) count processed records, so a rollback that rewinds the
step counter does not confuse them. Identifiers are derived from ``id_seed`` and a counter: with the same seed
and inputs, the engine produces identical events, which is what makes replay reproduce a live run.
:meth:`Engine.reseed` (called by the monitor when it resumes from a saved state) draws a fresh salt, so two
runs continued from one saved state, or a run resumed twice, never hand out the same id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from stabmon.events import (
    NOT_OF_THE_MODEL,
    Anomaly,
    Decision,
    DecisionStatus,
    InterventionRecord,
    Metric,
    Outcome,
    Severity,
    StepRecord,
    Verdict,
    new_id,
)
from stabmon.interventions.alert_only import AlertOnly
from stabmon.interventions.checkpoint_and_stop import CheckpointAndStop
from stabmon.interventions.traits import REAPPLY, RELEASE, REVERT, changed_training, levers_of, traits_of
from stabmon.runbook import judging, rejection, verdicts
from stabmon.runbook.schema import Rule, Runbook, Success
from stabmon.runbook.state import Incident, Sighting, WindowRow, incident_from_state, incident_state

_LOSS, _LR, _SKIPPED = Metric.LOSS, Metric.LR, Metric.SKIPPED  # read on every record: module constants
_HISTORY_MARGIN = 256  # loss history kept beyond baseline_steps, to reach back before a persistent onset
_OTHERS_KEPT = 8  # anomalies of other rules named in a judged rung's evidence (the count is in ``matched``)
_STATE_VERSION = 2  # 1: the incident a dict, sightings and window rows lists
_SIGN_GAP = 16  # steps: a sign this close before an incident's onset belongs to the same episode (see _onset)
_SIGNS_KEPT = 64
_NOT_SIGNS = NOT_OF_THE_MODEL
_POINT_KINDS = frozenset({"spike", "nonfinite"})  # detectors that report each flagged point (see _onset)


class Engine:
    """Turn anomalies into one decision at a time and judge each change after its observation window.

    ``mode`` (``apply`` | ``propose``) overrides the runbook's own; ``id_seed`` makes event ids reproducible.

    >>> from stabmon.runbook import loads_runbook
    >>> rb = loads_runbook('''
    ... name: demo
    ... rules:
    ...   - name: spike
    ...     when: {kind: spike}
    ...     ladder: [{action: set_clip, params: {max_norm: 1.0}, observe: 3}]
    ... ''')
    >>> from stabmon.events import Anomaly, Severity, StepRecord
    >>> eng = Engine(rb, id_seed="doc")
    >>> a = Anomaly(kind="spike", metric="grad_norm", step=1, score=9.0, severity=Severity.ERROR,
    ...             detector="z")
    >>> [(d.action, d.status.value) for d in eng.process(StepRecord(1, {"loss": 2.0}), [a])]
    [('set_clip', 'apply')]
    >>> for s in (2, 3): _ = eng.process(StepRecord(s, {"loss": 2.0}), [])
    >>> [o.verdict.value for o in eng.process(StepRecord(4, {"loss": 2.0}), [])]
    ['resolved']
    """

    def __init__(self, runbook: Runbook, *, mode: str | None = None, id_seed: str | None = None) -> None:
        if mode not in (None, "apply", "propose"):
            raise ValueError(f"engine.mode must be 'apply' or 'propose', got {mode!r}")
        self.runbook = runbook
        self.mode = mode or runbook.mode
        self._salt = id_seed if id_seed is not None else new_id()
        self._counter = 0
        self._tick = 0
        self._now: float | None = None  # wall-clock time of the record being processed
        # recent (step, loss) pairs: a bounded deque, so remembering one per record costs no list shifting
        self._losses: deque[tuple[int, float]] = deque(maxlen=runbook.baseline_steps + _HISTORY_MARGIN)
        self._lrs: deque[tuple[int, float]] = deque(maxlen=runbook.baseline_steps + _HISTORY_MARGIN)
        self._history: dict[str, list[Sighting]] = {}  # rule name -> its sightings within its horizon
        #: the steps of recent signs (anomalies of the model's values, warning or above, any rule): an episode
        self._signs: deque[int] = deque(maxlen=_SIGNS_KEPT)
        self._cooldown_until = 0
        #: rule name -> the levers (``Intervention.levers``) of its changes that did not keep its trouble away
        self._spent: dict[str, set[str]] = {}
        self._budget: list[int] = []  # ticks at which changes were applied (the budget window's count)
        self._incident: Incident | None = None
        self.stopped = False
        self._unfit: dict[tuple[str, int], str] = {}  # rungs that cannot act in this loop: never issued

    def drop_rungs(self, unfit: Mapping[tuple[str, int], str]) -> None:
        """The rungs that cannot act in this loop, by ``(rule name, rung index from 0)`` with why
        (:func:`stabmon.runbook.fit.unfit_rungs`): from now on they are passed over, never tried, escalated to or
        paged for. A setting of the loop, not state: the monitor says it again at every start."""
        self._unfit = dict(unfit)

    # -- public API --
    @property
    def busy(self) -> bool:
        """True while an incident is open (a proposal waits or a change is being observed)."""
        return self._incident is not None

    @property
    def open_onset(self) -> int | None:
        """The open incident's onset (where its rollback lands before), or None."""
        return self._incident.onset_step if self._incident is not None else None

    def process(self, record: StepRecord, anomalies: Sequence[Anomaly]) -> list[Decision | Outcome]:
        self._tick += 1
        self._now = record.time
        metrics, step = record.metrics, record.step
        loss = metrics.get(_LOSS)  # remember the recent losses (inline: this runs on every record)
        if loss is not None and math.isfinite(loss) and metrics.get(_SKIPPED) != 1.0:  # not a discarded update's
            self._losses.append((step, loss))
        lr = metrics.get(_LR)
        if lr is not None:
            self._lrs.append((step, lr))
        for a in anomalies:
            if a.severity >= Severity.WARNING and a.kind not in _NOT_SIGNS:
                self._signs.append(a.step)
        if self.stopped:
            return []
        if self._incident is not None:
            return self._advance(record, anomalies)
        if not anomalies and not self._history:
            return []  # the idle path: nothing new, nothing remembered (see _maybe_open)
        return self._maybe_open(record, anomalies)

    def answer(self, decision_id: str, approved: bool, step: int) -> list[Decision | Outcome]:
        inc = self._incident
        if inc is None or inc.phase != "proposed" or inc.current.id != decision_id:
            return []  # stale: already expired, answered, or not ours
        decision = inc.current
        if not approved:
            return self._reject(decision, step)
        approved_decision = dataclasses.replace(decision, status=DecisionStatus.APPROVED, step=step)
        self._start(approved_decision)
        return [approved_decision]

    def _reject(self, decision: Decision, step: int) -> list[Decision | Outcome]:
        """Close the incident; revert (or keep) what it changed so far, as ``approval.on_reject`` says."""
        inc = self._incident
        assert inc is not None
        note, undo = rejection.plan(inc, step=step, policy=self.runbook.approval.on_reject)
        out: list[Decision | Outcome] = [dataclasses.replace(decision, status=DecisionStatus.REJECTED, step=step,
                                                             reason=f"{decision.reason}; {note}")]
        for change in undo:
            params = {"intervention_id": change.intervention_id, "decision_id": change.decision_id,
                      "rejected": decision.id}
            reason = f"{decision.action} proposal rejected: revert rung {change.rung + 1} ({change.action})"
            revert = self._decision(REVERT, params, DecisionStatus.APPLY, step, reason)
            out.append(dataclasses.replace(revert, rung=change.rung))
        self._close()
        return out

    def hold(self, ticks: int) -> None:
        """Propose mode: the next ``ticks`` records do not count against a waiting proposal's approval
        timeout (its answers cannot be read right now, so an expiry could outrun an approval)."""
        inc = self._incident
        if inc is not None and inc.phase == "proposed":
            inc.decision_tick += ticks
            inc.decision_time = self._now  # a duration restarts: answers could not be read meanwhile

    def applied(self, decision: Decision, record: InterventionRecord) -> None:
        traits = traits_of(decision.action)
        if traits.stops_run and record.ok:
            self.stopped = True
        inc = self._incident
        if inc is not None and decision.incident_id == inc.id:
            rejection.track(inc, decision, record)
        if inc is None or inc.current.id != decision.id:
            return
        inc.intervention_id = record.id
        if changed_training(record):
            inc.changed = True
            inc.changed_at = record.step if inc.changed_at is None else min(inc.changed_at, record.step)
        inc.alerted = inc.alerted or not traits_of(record.action).changes_training
        if not traits.rewinds_step:
            # the change acts from the target's step at application; records of earlier steps still to come
            # (the rest of a live monitor's flush) were measured before it and are not part of its window
            inc.effective_step = record.step
        elif record.ok:
            # its window lasts until the run has trained past the step it rolled back from (see judging)
            inc.rewound_by = 0 if record.simulated else _lag(record)
            inc.until_step = int(record.before.get("step", record.step)) + inc.rewound_by
            if not record.simulated:
                # a live rollback rewound the step counter: records still to come from the abandoned timeline
                # (the rest of the flush) are not part of its window, which starts at the restored step
                inc.await_step = record.step
        if record.error is not None:
            inc.error = record.error
        if record.not_applied is not None:  # nothing changed: no window to wait for, no budget spent
            inc.skipped = record.not_applied
            inc.effective_step = None  # the next rung may follow on the next record, in the same flush
            if self._budget and traits.changes_training:
                self._budget.pop()
        verdicts.note_verdict(inc, decision, record)

    # -- idle: does a rule fire? --
    def _maybe_open(self, record: StepRecord, anomalies: Sequence[Anomaly], *,
                    cooldown: bool = True, since: int | None = None,
                    sign: int | None = None) -> list[Decision | Outcome]:
        if not anomalies and not self._history:
            return []  # the idle path: nothing new, nothing remembered to expire
        fresh: dict[str, Anomaly] = {}
        for a in anomalies:
            rule = self._rule_for(a)
            if rule is None:
                continue
            self._history.setdefault(rule.name, []).append(Sighting(self._tick, a.step, self._onset(a, since, sign)))
            best = fresh.get(rule.name)
            if best is None or a.severity > best.severity or (a.severity == best.severity and a.score >
            best.score):
                fresh[rule.name] = a
        self._history = self._within_horizons()
        if cooldown and self._tick <= self._cooldown_until:
            return []
        for rule in self.runbook.rules:
            if rule.name in fresh and self._persistent(rule):
                return self._open(rule, fresh[rule.name], record)
        return []

    def _onset(self, anomaly: Anomaly, since: int | None = None, sign: int | None = None) -> int:
        """Where the trouble ``anomaly`` reports began, which a rollback must land before.

        A spike or a NaN is reported at every flagged point, so the first of them is where its trouble shows
        first: the flagged point, reached back through the signs that came before it with no gap over
        ``_SIGN_GAP`` steps (the first NaN before the critical one, a spike's first flagged point, the warning
        before the error), and one step more: a step's values are measured on the state the update before it
        left, so that update is the first the fault may have touched (a checkpoint at step N holds the state
        before step N). A detector that reports a trend once it has lasted (a regression, a loss scale that
        fell to its floor, a drift) names the start of its evidence, from before the rise; where this incident
        supersedes a first-sign incident (a ``yields`` rule's), at that sign's onset (``sign``) when it is later:
        the trend is the sign's damage showing, and its window's start only says how much history the detector
        compares (a regression 20 steps after a 10,000x gradient norm would otherwise send the run back 50 steps
        before the spike). Either reaches back to ``since`` (the onset of the incident this one supersedes). A
        rollback further back than the episode's first sign would train again steps the fault never touched."""
        ev = anomaly.evidence
        point = anomaly.kind in _POINT_KINDS or not ev
        start = anomaly.step if point else ev[0][0] if sign is None else max(sign, ev[0][0])
        for step in sorted(set(self._signs), reverse=True):
            if start - _SIGN_GAP <= step < start:
                start = step
        start = max(0, start - 1) if point else start
        return start if since is None else min(start, since)

    def _within_horizons(self) -> dict[str, list[Sighting]]:
        """Each rule's sightings still within its persistence horizon; a rule with none is left out, so an
        emptied history does not keep later records from the idle path."""
        kept: dict[str, list[Sighting]] = {}
        for rule in self.runbook.rules:
            horizon = self._tick - rule.when.persistence.of
            recent = [h for h in self._history.get(rule.name, ()) if h.tick > horizon]
            if recent:
                kept[rule.name] = recent
        return kept

    def _rule_for(self, anomaly: Anomaly) -> Rule | None:
        return next((r for r in self.runbook.rules if verdicts.opens_incidents(r) and r.when.matches(anomaly)),
                    None)

    def _persistent(self, rule: Rule) -> bool:
        return len({h.tick for h in self._history.get(rule.name, [])}) >= rule.when.persistence.seen

    def _open(self, rule: Rule, anomaly: Anomaly, record: StepRecord) -> list[Decision | Outcome]:
        hist = self._history.get(rule.name, [])
        onset = min([h.onset for h in hist] + [anomaly.step])
        before = [v for s, v in self._losses if s < onset][-self.runbook.baseline_steps:]
        if len(before) < judging.MIN_LOSSES:  # a median of a few losses is no baseline (nor is their spread)
            before = []
        seen = len({h.tick for h in hist})
        self._incident = Incident(
            id=self._next_id(), rule=rule.name, anomaly_id=anomaly.id, metric=anomaly.metric, onset_step=onset,
            baseline=statistics.median(before) if before else None,
            trigger=(f"{anomaly.kind} on {anomaly.metric} at step {anomaly.step} "
                     f"(score {anomaly.score:.4g}, {anomaly.severity.value}); "
                     f"seen on {seen} of the last {rule.when.persistence.of} steps"),
            seen=anomaly.message.partition("\n")[0][:500],
            reached=min(before) if before else None,
            noise=judging.spread(before),
        )
        return self._issue_rung(record.step)

    # -- an incident is open --
    def _advance(self, record: StepRecord, anomalies: Sequence[Anomaly]) -> list[Decision | Outcome]:
        inc = self._incident
        assert inc is not None
        rule = self.runbook.rule(inc.rule)
        if anomalies and (rule.yields or not traits_of(inc.current.action).changes_training) \
                and self._acting(anomalies, rule):
            # whenever it comes, an alert awaiting approval (propose mode) included: it has nothing to wait for;
            # a first-sign rule's change is given back and the rule that acts takes over
            return self._supersede(record, anomalies)
        if inc.phase == "proposed":
            return self._timeout(record.step) if self._expired(inc) else []
        if inc.diagnosis is not None and (followed := self._follow_diagnosis(record.step)):
            return followed
        eff = inc.effective_step
        if eff is not None and record.step < eff and inc.error is None:
            return []
        if inc.await_step is not None:
            if record.step != inc.await_step:
                return []
            inc.await_step = None
        mine = [rule.when.matches(a) for a in anomalies]
        own = sum(mine)
        others = self._others_acting([a for a, m in zip(anomalies, mine, strict=True) if not m], rule)
        if others:  # trouble another rule would change training for counts against the change observed as this
            # rule's own does: the run is not well
            inc.others = [*inc.others, *others][:_OTHERS_KEPT]
        matched = own + len(others)
        signal = record.get(inc.metric)
        discarded = record.get(_SKIPPED) == 1.0  # an update the guard or a data screen threw away: no loss to judge
        loss = None if discarded else _num(record.get(_LOSS))
        inc.window.append(WindowRow(record.step, loss, None if discarded and inc.metric == _LOSS else _num(signal),
                                    matched))
        if inc.releasing and matched:  # the trouble is back while the changes are given back: judge now
            out = self._judge(record.step)
            if not own and self._incident is None:
                # another trouble than the one the changes answered: they are put back (giving them back may
                # have let it in), and that trouble opens its own incident now, the cooldown notwithstanding (it
                # was seen before the changes went back in, and a detector that reports once would not see it
                # again)
                out.extend(self._maybe_open(record, anomalies, cooldown=False))
            return out
        if inc.error is None and inc.skipped is None and not judging.window_over(inc, self._judged(inc).observe):
            return []
        return self._judge(record.step)

    def settle(self, record: StepRecord) -> list[Decision | Outcome]:
        """Go on at once, still on ``record``, where the rung just applied needs no record of its own: it changed
        nothing (not applicable in this loop), it failed, or it is a diagnosis whose verdict names the rule to
        follow. Without this the next rung waits for the next record, and where that record is in the next
        flush, for ``flush_every`` more steps of training under the trouble (a regression flagged on the last
        record of a flush used to be diagnosed there and answered 20 steps later). The pipeline calls it after
        each decision it applied; nothing to do: []."""
        inc = self._incident
        if inc is None or inc.phase == "proposed" or inc.releasing or record.step < (inc.await_step or 0):
            return []
        step = record.step
        if inc.diagnosis is not None and (followed := self._follow_diagnosis(step)):
            return followed
        if inc.skipped is not None or inc.error is not None:
            return self._judge(step)
        return []

    def _follow_diagnosis(self, step: int) -> list[Decision | Outcome]:
        """Close the diagnose rung and continue the incident with the rule for its verdict (none: the rung
        failed, its own ladder goes on)."""
        inc = self._incident
        assert inc is not None
        verdict, inc.diagnosis = inc.diagnosis, None
        assert verdict is not None
        rule = verdicts.rule_for_verdict(self.runbook, inc.metric, verdict)
        if rule is None:
            inc.error = f"diagnosed {verdict}, but no rule has when.verdict: {verdict}"
            return []
        done = Outcome(intervention_id=inc.intervention_id, decision_id=inc.current.id, step=step,
                       verdict=Verdict.ESCALATED, evidence={"diagnosis": verdict, "next_rule": rule.name},
                       incident_id=inc.id, id=self._next_id())
        inc.rule, inc.rung, inc.attempt, inc.held = rule.name, 0, 1, None
        inc.trigger = f"{inc.trigger}; diagnosed: {verdict}"
        return [done, *self._issue_rung(step)]

    def _acting(self, anomalies: Sequence[Anomaly], current: Rule) -> bool:
        """Does an anomaly call for a rule that changes training, while only an alert is being observed?"""
        return bool(self._others_acting(anomalies, current))

    def _others_acting(self, anomalies: Sequence[Anomaly], current: Rule) -> list[str]:
        """The anomalies that another rule, one that changes training, would open an incident for (``"<kind> on
        <metric> at step <step> (rule <name>)"``). While a change is observed they count against it like the
        incident's own: a QK-clip that holds the attention logits while the loss regresses has not made the run
        well, and the regression must not wait until the clip is given back (one incident at a time)."""
        out = []
        for a in anomalies:
            rule = self._rule_for(a)
            if rule is not None and rule.name != current.name and traits_of(rule.actions[0]).changes_training:
                out.append(f"{a.kind} on {a.metric} at step {a.step} (rule {rule.name})")
        return out

    def _supersede(self, record: StepRecord, anomalies: Sequence[Anomaly]) -> list[Decision | Outcome]:
        """Close an alert-only incident early (an alert changed nothing, so nothing is left to judge) and let
        the anomaly a rule acts on open its own incident now, instead of being counted against the alert."""
        inc = self._incident
        assert inc is not None
        done = Outcome(intervention_id=inc.intervention_id, decision_id=inc.current.id, step=record.step,
                       verdict=Verdict.SUPERSEDED, evidence={"observed_steps": len(inc.window)},
                       incident_id=inc.id, id=self._next_id())
        # a first sign's change is undone (one change in force at a time); a release has given it back already
        given_back = [] if inc.releasing else self._revert_in_force(record.step, why="superseded by a rule that acts")
        inc.alerted, inc.changed = True, False  # no cooldown: the rule that acts opens its incident now
        self._close()
        sign = inc.onset_step if self.runbook.rule(inc.rule).yields else None
        return [done, *given_back, *self._maybe_open(record, anomalies, since=inc.onset_step, sign=sign)]

    def _expired(self, inc: Incident) -> bool:
        approval = self.runbook.approval
        if approval.steps is not None:
            return self._tick - inc.decision_tick >= approval.steps
        if inc.decision_time is None or self._now is None:  # records without times: a duration cannot pass
            inc.decision_time = inc.decision_time if inc.decision_time is not None else self._now
            return False
        return self._now - inc.decision_time >= (approval.seconds or 0.0)

    def _timeout(self, step: int) -> list[Decision | Outcome]:
        inc = self._incident
        assert inc is not None
        decision = inc.current
        timeout = self.runbook.approval.timeout
        waited = f"no answer after {timeout} steps" if isinstance(timeout, int) else f"no answer within {timeout}"
        if self.runbook.approval.on_timeout == "expire":
            self._close()
            return [dataclasses.replace(decision, status=DecisionStatus.EXPIRED, step=step,
                                        reason=f"{decision.reason}; expired: {waited}")]
        auto = dataclasses.replace(decision, status=DecisionStatus.APPROVED, step=step,
                                   reason=f"{decision.reason}; auto-applied: {waited}")
        self._start(auto)
        return [auto]

    def _judge(self, step: int) -> list[Decision | Outcome]:
        inc = self._incident
        assert inc is not None
        rung = self._judged(inc)
        ok, evidence = judging.criteria(inc, rung)
        rule = self.runbook.rule(inc.rule)
        decision_id = inc.current.id

        def outcome(verdict: Verdict) -> Outcome:
            return Outcome(intervention_id=inc.intervention_id, decision_id=decision_id, step=step,
                           verdict=verdict, evidence=evidence, incident_id=inc.id, id=self._next_id())

        if inc.skipped is not None:  # the rung changed nothing: straight on to the next one, whatever on_failure
            evidence = {"skipped": inc.skipped, "metric": inc.metric}
            has_next = self._has_next(rule, inc.rung)
            out: list[Decision | Outcome] = [outcome(Verdict.ESCALATED if has_next else Verdict.EXHAUSTED)]
            out.extend(self._revert_in_force(step))  # earlier attempts of this rung did not resolve it either
            if has_next:
                inc.rung, inc.attempt, inc.held = inc.rung + 1, 1, None
                return out + self._issue_rung(step)
            self._close()
            return out
        if inc.releasing:
            return self._judge_release(step, ok, outcome)
        if ok:
            resolved = outcome(Verdict.RESOLVED)
            released = self._release(step)
            if not released:
                self._close()
            return [resolved, *released]
        attempt = inc.attempt
        back = inc.error is None and any(r.matched for r in inc.window)  # the trouble came back in its window
        if attempt < rung.repeat and inc.error is None:
            held, before = judging.held(inc.window), inc.held
            if back and (before is None or held > before):  # it bought time: the next attempt may buy more
                inc.attempt, inc.held = attempt + 1, held  # the same rung again, on top of the last attempt
                evidence["attempt"] = attempt
                return [outcome(Verdict.ESCALATED)] + self._issue_rung(step)
            evidence["futile"] = (f"attempt {attempt} held the trouble off {held} steps, no longer than attempt "
                                  f"{attempt - 1} ({before}): repeating the rung does not help" if back else
                                  f"attempt {attempt} kept the trouble away but the loss did not recover: "
                                  "more of the same change will not help")
        if back:  # the rung is spent and what it pulls on did not keep this trouble away: later rungs pulling only
            # that are passed over, in this incident and the rule's later ones
            self._spent.setdefault(inc.rule, set()).update(levers_of(rung.action, rung.params.model_dump()))
        has_next = self._has_next(rule, inc.rung)
        if rung.on_failure == "stop":
            out = [outcome(Verdict.STOPPED)]
            return out + self._issue_stop(step)
        if rung.on_failure == "revert":
            out = [outcome(Verdict.REVERTED)]
        else:
            out = [outcome(Verdict.ESCALATED if has_next else Verdict.EXHAUSTED)]
        out.extend(self._revert_in_force(step))  # one change in force at a time; none left by a spent ladder
        if has_next:
            inc.rung += 1
            inc.attempt, inc.held = 1, None
            return out + self._issue_rung(step)
        self._close()
        return out

    # -- issuing decisions --
    def _issue_rung(self, step: int) -> list[Decision | Outcome]:
        inc = self._incident
        assert inc is not None
        rule = self.runbook.rule(inc.rule)
        passed = []
        while (rule.name, inc.rung) in self._unfit or self._passes(rule, inc.rung):
            if (rule.name, inc.rung) not in self._unfit:  # it pulls only what did not keep this trouble away
                passed.append(f"rung {inc.rung + 1} ({self._rung(inc).action})")
            if inc.rung + 1 >= len(rule.ladder):
                if passed:
                    return self._spent_ladder(step, passed)
                return self._alert_and_close(step, f"{inc.trigger}; no rung of rule {rule.name} left that can act "
                                             "in this loop (see the start-up log); nothing is changed")
            inc.rung, inc.attempt, inc.held = inc.rung + 1, 1, None
        rung = self._rung(inc)
        traits = traits_of(rung.action)
        if traits.changes_training and self._budget_left() <= 0:
            b = self.runbook.budget
            return self._alert_and_close(step, f"{inc.trigger}; budget exhausted ({b.max_interventions} interventions "
                                         f"per {b.per_steps} steps): rung {inc.rung + 1} ({rung.action}) not attempted")
        params = rung.params.model_dump(exclude_none=True)
        params.update(verdicts.diagnose_params(traits, inc, step))
        if "message" in type(rung.params).model_fields and not params.get("message") and inc.seen:
            params["message"] = inc.seen  # an alert says what the detector saw
        if traits.rewinds_step:
            params["onset_step"] = inc.onset_step
            if inc.cleared is not None:  # a state a diagnosis cleared: no need to land before it (Incident.cleared)
                params["cleared_step"] = inc.cleared
            # the LR in force before the onset's update (that update's own LR may be the trouble)
            onset_lr = next((v for st, v in reversed(self._lrs) if st < inc.onset_step),
                            next((v for st, v in self._lrs if st <= inc.onset_step), None))
            if onset_lr is not None and "lr_cap" in params:
                params["onset_lr"] = onset_lr  # the cap is a fraction of the LR at which the trouble began
            if params.get("screen") and (bar := judging.screen_bar(inc.baseline, inc.noise)) is not None:
                params["screen_bar"] = bar  # a batch stands out above the losses before the onset
        reason = f"{inc.trigger}; rung {inc.rung + 1}/{len(rule.ladder)} of rule {rule.name}"
        if passed:
            spent = "/".join(sorted(self._spent[rule.name]))
            reason += f" ({', '.join(passed)} passed over: {spent} did not keep this trouble away earlier in this run)"
        if rung.repeat > 1:
            reason += f" (attempt {inc.attempt} of {rung.repeat})"
        return [self._propose_or_apply(rung.action, params, step, reason)]

    def _has_next(self, rule: Rule, index: int) -> bool:
        """Whether a rung after ``index`` of ``rule`` can act in this loop."""
        return any((rule.name, i) not in self._unfit for i in range(index + 1, len(rule.ladder)))

    def _passes(self, rule: Rule, index: int) -> bool:
        """Whether rung ``index`` of ``rule`` pulls only levers spent for the rule in this run (and some)."""
        spent = self._spent.get(rule.name)
        if not spent:
            return False
        rung: Any = rule.ladder[index]
        levers = levers_of(rung.action, rung.params.model_dump())
        return bool(levers) and levers <= spent

    def _spent_ladder(self, step: int, passed: list[str]) -> list[Decision | Outcome]:
        """The rest of the ladder pulls only what did not keep this trouble away: tell a human, change nothing
        (no stop either: a run that survives its trouble is not ended for it), and close."""
        inc = self._incident
        assert inc is not None
        spent = "/".join(sorted(self._spent.get(inc.rule, ())))
        return self._alert_and_close(step, f"{inc.trigger}; {', '.join(passed)} of rule {inc.rule} passed over: "
                                     f"{spent} did not keep this trouble away earlier in this run; nothing more is "
                                     "tried")

    def _alert_and_close(self, step: int, reason: str) -> list[Decision | Outcome]:
        """End the incident with an alert that says why nothing more is changed."""
        alert = self._decision(AlertOnly.name, {"message": reason}, DecisionStatus.APPLY, step, reason)
        self._close()
        return [alert]

    def _issue_stop(self, step: int) -> list[Decision | Outcome]:
        inc = self._incident
        assert inc is not None
        reason = f"{inc.trigger}; rung {inc.rung + 1} failed and its runbook says stop"
        inc.stop = True
        return [self._propose_or_apply(CheckpointAndStop.name, {"reason": reason}, step, reason)]

    def _propose_or_apply(self, action: str, params: dict[str, Any], step: int, reason: str) -> Decision:
        inc = self._incident
        assert inc is not None
        status = DecisionStatus.PROPOSED if self.mode == "propose" else DecisionStatus.APPLY
        decision = self._decision(action, params, status, step, reason)
        if status == DecisionStatus.PROPOSED:
            inc.phase, inc.decision, inc.decision_tick = "proposed", _kept(decision), self._tick
            inc.decision_time = self._now
        else:
            self._start(decision)
        return decision

    def _revert_in_force(self, step: int, *, why: str = "did not resolve the incident") -> list[Decision]:
        """Undo, newest first, every change of the incident still in force: the rungs that did not resolve it."""
        inc = self._incident
        assert inc is not None
        out = []
        for change in reversed(inc.in_force):
            if not change.revertible:
                continue
            params = {"intervention_id": change.intervention_id, "decision_id": change.decision_id}
            reason = f"rung {change.rung + 1} ({change.action}) {why}: revert it"
            out.append(dataclasses.replace(self._decision(REVERT, params, DecisionStatus.APPLY, step, reason),
                                           rung=change.rung))
        return out

    # -- giving back what resolved it --
    def _release(self, step: int) -> list[Decision | Outcome]:
        """The incident is resolved: give back the changes still in force (none: nothing to do) and observe the
        run without them (:class:`~stabmon.runbook.schema.Release`)."""
        inc = self._incident
        assert inc is not None
        held = [c for c in reversed(inc.in_force) if c.revertible]
        if not held:
            return []
        steps = self.runbook.release.steps
        names = ", ".join(f"rung {c.rung + 1} ({c.action})" for c in held)
        warm = f", the learning rate back to the schedule over {steps} steps" if steps else ""
        reason = f"{inc.trigger}; resolved: release {names}{warm}, then observe"
        params = {"intervention_ids": [c.intervention_id for c in held], "steps": steps}
        decision = self._decision(RELEASE, params, DecisionStatus.APPLY, step, reason)
        inc.releasing = True
        inc.phase, inc.decision, inc.window, inc.others = "observing", _kept(decision), [], []
        inc.intervention_id = inc.error = inc.skipped = inc.effective_step = inc.await_step = inc.until_step = None
        inc.rewound_by = 0
        return [decision]

    def _judge_release(self, step: int, ok: bool, outcome: Any) -> list[Decision | Outcome]:
        """Quiet without the changes: ``released``. The trouble back: put them back, ``kept``."""
        inc = self._incident
        assert inc is not None
        if ok or inc.error is not None:  # a release that failed gave nothing back: nothing to put back either
            self._close()
            return [outcome(Verdict.RELEASED if ok else Verdict.KEPT)]
        reason = (f"{inc.trigger}; the trouble came back while the changes were given back: put them back "
                  f"(they stay in force)")
        params = {"intervention_id": inc.intervention_id, "decision_id": inc.current.id}
        back = self._decision(REAPPLY, params, DecisionStatus.APPLY, step, reason)
        self._close()
        return [outcome(Verdict.KEPT), back]

    def _start(self, decision: Decision) -> None:
        """The decision is being applied now: observe it (or, for a stop, end the incident)."""
        inc = self._incident
        assert inc is not None
        traits = traits_of(decision.action)
        if traits.stops_run and inc.stop:
            self._close()
            return
        if traits.changes_training:
            self._budget.append(self._tick)
        inc.phase, inc.decision, inc.window, inc.releasing, inc.others = "observing", _kept(decision), [], False, []
        inc.intervention_id = inc.error = inc.skipped = inc.effective_step = inc.await_step = inc.until_step = None
        inc.rewound_by = 0

    def _decision(self, action: str, params: dict[str, Any], status: DecisionStatus, step: int,
                  reason: str) -> Decision:
        inc = self._incident
        assert inc is not None
        return Decision(step=step, action=action, params=params, status=status, runbook=self.runbook.name,
                        rule=inc.rule, rung=inc.rung, reason=reason, anomaly_id=inc.anomaly_id,
                        incident_id=inc.id, id=self._next_id())

    # -- bookkeeping --
    def _rung(self, inc: Incident) -> Any:
        return self.runbook.rule(inc.rule).ladder[inc.rung]

    def _judged(self, inc: Incident) -> Any:
        """What the current decision is observed and judged by: its rung, or for a release the rung that
        resolved the incident over the release's window (every record of it judged)."""
        rung = self._rung(inc)
        if not inc.releasing:
            return rung
        release = self.runbook.release
        return _Judged(observe=release.steps + release.observe,
                       success=Success(loss_within=rung.success.loss_within,
                                       signal_below=rung.success.signal_below))

    def _budget_left(self) -> int:
        b = self.runbook.budget
        self._budget = [t for t in self._budget if t > self._tick - b.per_steps]
        return b.max_interventions - len(self._budget)

    def _close(self) -> None:
        # The cooldown lets the run settle after a change; an incident that only alerted changed nothing, so
        # it must not hold back the rule that acts when the same signal turns out to persist (warning -> error).
        inc = self._incident
        if inc is None or not inc.alerted or inc.changed:
            self._cooldown_until = self._tick + self.runbook.cooldown
        self._incident = None
        self._history = {}

    def reseed(self) -> None:
        """Start a new line of identifiers (the counter carries on): for a run continued from a saved state,
        which another continuation of the same state may share."""
        self._salt = f"{self._salt}/{new_id()}"

    def _next_id(self) -> str:
        self._counter += 1
        return hashlib.sha1(f"{self._salt}:{self._counter}".encode()).hexdigest()[:12]

    # -- state --
    def state_dict(self) -> dict[str, Any]:
        """Plain Python values only (safe for ``torch.load(weights_only=True)`` and JSON)."""
        return {
            "version": _STATE_VERSION, "runbook": self.runbook.name, "salt": self._salt,
            "counter": self._counter, "tick": self._tick, "losses": [list(x) for x in self._losses],
            "lrs": [list(x) for x in self._lrs],
            "history": {rule: [dataclasses.asdict(h) for h in hist] for rule, hist in self._history.items()},
            "signs": list(self._signs),
            "cooldown_until": self._cooldown_until, "budget": list(self._budget),
            "spent": {rule: sorted(levers) for rule, levers in self._spent.items()},
            "incident": None if self._incident is None else incident_state(self._incident),
            "stopped": self.stopped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, also one saved in version 1 (history and window rows as lists)."""
        version = state.get("version")
        if version not in (1, _STATE_VERSION):
            raise ValueError(f"engine.state.version must be 1 or {_STATE_VERSION}, got {version!r}")
        if state.get("runbook") != self.runbook.name:
            raise ValueError(f"engine.state.runbook is {state.get('runbook')!r}, not {self.runbook.name!r}")
        self._salt, self._counter, self._tick = state["salt"], state["counter"], state["tick"]
        self._losses = deque(((int(s), float(v)) for s, v in state["losses"]), maxlen=self._losses.maxlen)
        self._lrs = deque(((int(s), float(v)) for s, v in state["lrs"]), maxlen=self._lrs.maxlen)
        sighting = (lambda h: Sighting(*h)) if version == 1 else (lambda h: Sighting(**h))
        self._history = {rule: [sighting(h) for h in hist] for rule, hist in state["history"].items()}
        self._signs = deque((int(s) for s in state.get("signs", ())), maxlen=_SIGNS_KEPT)
        self._cooldown_until, self._budget = state["cooldown_until"], list(state["budget"])
        self._spent = {rule: set(levers) for rule, levers in state.get("spent", {}).items()}
        incident = state["incident"]
        self._incident = None if incident is None else incident_from_state(incident, version=version)
        self.stopped = bool(state["stopped"])


@dataclasses.dataclass(frozen=True)
class _Judged:
    """A release's observation window and success tests, in a rung's shape (see :meth:`Engine._judged`)."""

    observe: int
    success: Success


def _num(value: float | None) -> float | None:
    return None if value is None else float(value)


def _lag(record: InterventionRecord) -> int:
    """How far a live rollback's restored training lags the step count: 0 when the count went back with it (a
    loop the monitor counts); the steps it went back when a framework's count went on."""
    after = record.after
    restored, checkpoint = after.get("restored_step"), after.get("checkpoint_step")
    if not isinstance(restored, int) or not isinstance(checkpoint, int):
        return 0
    return max(0, restored - checkpoint)


def _kept(decision: Decision) -> Decision:
    """The engine's own copy of a decision it hands out (its params are not shared with the consumers)."""
    return dataclasses.replace(decision, params=dict(decision.params))

