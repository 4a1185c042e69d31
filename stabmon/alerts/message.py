"""Turning the events of one flush into alerts a person can act on.

Events that belong together are folded into one message: a Decision carries the Anomaly it answers and the
InterventionRecord of what applying it changed. Each alert names its incident: the engine's ``incident_id``
when the event has one, else ``<kind>:<metric>`` of the anomaly; an incident first seen as a bare anomaly
keeps that key when the engine later opens an incident for it, so PagerDuty's ``dedup_key`` stays the same
from trigger to resolve.

>>> from stabmon.events import Anomaly, Severity
>>> c = Composer()
>>> a = Anomaly(kind="spike", metric="loss", step=120, score=9.1, severity=Severity.WARNING,
...             detector="zscore", evidence=((118, 2.1), (119, 2.0), (120, 7.9)), threshold=6.0, id="a1")
>>> [alert] = c.compose(run_id="r1", run_name="demo", events=[a])
>>> alert.kind, alert.severity.value, alert.dedup_key
('anomaly', 'warning', 'stabmon-r1-spike:loss')
>>> print(alert.body.splitlines()[2])
anomaly: spike in loss (detector zscore) score=9.1 threshold=6
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stabmon.events import (
    Anomaly,
    Decision,
    DecisionStatus,
    Event,
    InterventionRecord,
    Outcome,
    Severity,
    Verdict,
)
from stabmon.interventions.traits import recorded_traits

_EVIDENCE_SHOWN = 8
_REMEMBERED = 256  # recent anomalies / decisions kept to link events that arrive in later flushes
_OUTCOME_SEVERITY = {
    Verdict.RESOLVED: Severity.INFO,
    Verdict.ESCALATED: Severity.WARNING,
    Verdict.REVERTED: Severity.WARNING,
    Verdict.EXHAUSTED: Severity.ERROR,
    Verdict.SUPERSEDED: Severity.INFO,
    Verdict.RELEASED: Severity.INFO,
    Verdict.KEPT: Severity.WARNING,
    Verdict.STOPPED: Severity.CRITICAL,
}


@dataclass(frozen=True)
class Alert:
    """One message about one incident.

    ``fingerprint`` identifies "the same alert again" within an incident (for deduplication); ``resolves``
    marks the engine's judgement that the incident is resolved (PagerDuty ``resolve``); ``priority`` alerts
    (stops and resolutions) are exempt from rate limits.
    """

    run_id: str
    run_name: str
    kind: str
    severity: Severity
    incident_key: str
    fingerprint: str
    step: int | None
    title: str
    body: str
    incident_id: str | None = None
    resolves: bool = False
    priority: bool = False
    event_id: str | None = None  # the anomaly, decision or outcome the alert is about

    @property
    def dedup_key(self) -> str:
        """PagerDuty Events v2 ``dedup_key``: stable for the whole incident."""
        return f"stabmon-{self.run_id}-{self.incident_key}"[:255]


def fmt(value: Any) -> str:
    """Numbers compactly (4 significant digits), everything else as ``str``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.4g}"


def _max(a: Severity, b: Severity) -> Severity:
    return a if a >= b else b


def _min(a: Severity, b: Severity) -> Severity:
    return a if a <= b else b


class Composer:
    """Builds :class:`Alert` objects from events; remembers recent events to link later ones.

    >>> Composer().compose(run_id="r", run_name="demo", events=[])
    []
    """

    def __init__(self) -> None:
        self._anomalies: OrderedDict[str, Anomaly] = OrderedDict()
        self._decisions: OrderedDict[str, Decision] = OrderedDict()
        self._orphan_keys: dict[str, str] = {}  # "run|kind:metric" -> incident key in use
        self._aliases: dict[str, str] = {}  # "run|incident_id" -> incident key in use

    # -- linking -----------------------------------------------------------------------------------------
    def _remember(self, store: OrderedDict[str, Any], key: str, value: Any) -> None:
        store[key] = value
        store.move_to_end(key)
        while len(store) > _REMEMBERED:
            store.popitem(last=False)

    def _incident_key(self, run_id: str, incident_id: str | None, anomaly: Anomaly | None) -> str:
        if incident_id is None:
            if anomaly is None:
                return "unknown"
            return self._orphan_keys.setdefault(
                f"{run_id}|{anomaly.kind}:{anomaly.metric}", f"{anomaly.kind}:{anomaly.metric}"
            )
        alias = self._aliases.get(f"{run_id}|{incident_id}")
        if alias is not None:
            return alias
        key = incident_id
        if anomaly is not None:
            # An incident first alerted as a bare anomaly keeps that key; later bare anomalies of that signal
            # belong to this incident until it is resolved.
            key = self._orphan_keys.setdefault(f"{run_id}|{anomaly.kind}:{anomaly.metric}", incident_id)
        self._aliases[f"{run_id}|{incident_id}"] = key
        return key

    def _close(self, run_id: str, incident_key: str) -> None:
        for k in [
            k for k, v in self._orphan_keys.items() if k.startswith(f"{run_id}|") and v == incident_key
        ]:
            del self._orphan_keys[k]

    # -- composing ---------------------------------------------------------------------------------------
    def compose(self, *, run_id: str, run_name: str, events: Sequence[Event]) -> list[Alert]:
        """Alerts for one flush's events, in causal order."""
        records = {e.decision_id: e for e in events if isinstance(e, InterventionRecord)}
        decided = {e.anomaly_id for e in events if isinstance(e, Decision) and e.anomaly_id}
        done_records: set[str] = set()
        alerts: list[Alert] = []
        for ev in events:
            if isinstance(ev, Anomaly):
                self._remember(self._anomalies, ev.id, ev)
                if ev.id not in decided:
                    alerts.append(self._anomaly_alert(run_id, run_name, ev))
            elif isinstance(ev, Decision):
                self._remember(self._decisions, ev.id, ev)
                record = records.get(ev.id)
                if record is not None:
                    done_records.add(record.id)
                alerts.append(self._decision_alert(run_id, run_name, ev, record))
            elif isinstance(ev, InterventionRecord) and ev.id not in done_records:
                decision = self._decisions.get(ev.decision_id)
                if decision is not None:
                    alerts.append(self._decision_alert(run_id, run_name, decision, ev))
            elif isinstance(ev, Outcome):
                alerts.append(self._outcome_alert(run_id, run_name, ev))
        return alerts

    def _anomaly_alert(self, run_id: str, run_name: str, a: Anomaly) -> Alert:
        key = self._incident_key(run_id, None, a)
        lines = self._header(run_id, run_name, a.step, key) + self._anomaly_lines(a)
        lines.append(f"trace: stabmon trace {run_id}")
        title = self._anomaly_title(a, run_name)
        return Alert(
            run_id,
            run_name,
            "anomaly",
            a.severity,
            key,
            f"anomaly:{a.kind}:{a.metric}",
            a.step,
            title,
            "\n".join(lines),
            event_id=a.id,
        )

    def _decision_alert(
        self, run_id: str, run_name: str, d: Decision, record: InterventionRecord | None
    ) -> Alert:
        anomaly = self._anomalies.get(d.anomaly_id) if d.anomaly_id else None
        key = self._incident_key(run_id, d.incident_id, anomaly)
        base = anomaly.severity if anomaly is not None else Severity.WARNING
        traits = recorded_traits(d.action)
        if traits.stops_run:
            kind, severity, verb = "stop", Severity.CRITICAL, "stopping the run"
        elif d.status is DecisionStatus.PROPOSED:
            kind, severity, verb = "proposal", _max(base, Severity.ERROR), "awaiting approval"
        elif traits.releases:  # the resolved incident's changes given back to the recipe: news, not a page
            kind, severity, verb = "intervention", Severity.INFO, "released"
        elif traits.reapplies:  # the trouble came back without them: put back, and said so
            kind, severity, verb = "intervention", Severity.WARNING, "put back"
        elif record is not None and record.not_applied is not None:  # nothing changed: said, never paged
            kind, severity, verb = "intervention", Severity.INFO, "skipped (not applicable)"
        elif record is not None and record.error is not None:  # nothing changed: the next rung (which pages when
            kind, severity, verb = "intervention", Severity.WARNING, "failed"  # it changes something) follows
        elif record is not None and traits.diagnoses:  # a verdict, nothing changed in the run: said, not paged
            kind, severity, verb = "intervention", _min(base, Severity.WARNING), "diagnosed"
        elif record is not None:
            kind = "intervention"
            severity = Severity.WARNING if record.reverted else _max(base, Severity.ERROR)
            verb = "reverted" if record.reverted else "applied"
        else:
            kind, severity, verb = "decision", base, d.status.value
        if not traits.changes_training and d.status is not DecisionStatus.PROPOSED:
            kind, severity = "anomaly", base  # the runbook's answer is "tell people": an anomaly alert
        lines = self._header(run_id, run_name, d.step, key)
        if anomaly is not None:
            lines += self._anomaly_lines(anomaly)
        params = ", ".join(f"{k}={fmt(v)}" for k, v in sorted(d.params.items()))
        lines.append(
            f"decision: {d.action}({params}) [{d.status.value}] — runbook {d.runbook}, rule {d.rule}, "
            f"rung {d.rung}: {d.reason}"
        )
        if record is not None and (record.before or record.stored_after()):
            lines += self._change_lines(record)
        if d.status is DecisionStatus.PROPOSED:
            lines.append(f"approve: stabmon approve {run_id} {d.id}")
            lines.append(f"reject: stabmon reject {run_id} {d.id}")
        lines.append(f"trace: stabmon trace {run_id}")
        title = f"[stabmon] {severity.value.upper()}: {d.action} {verb} at step {d.step} ({run_name})"
        if kind == "anomaly" and anomaly is not None:
            title = self._anomaly_title(anomaly, run_name)
        return Alert(
            run_id,
            run_name,
            kind,
            severity,
            key,
            f"{kind}:{d.id}:{d.status.value}",
            d.step,
            title,
            "\n".join(lines),
            incident_id=d.incident_id,
            priority=kind == "stop",
            event_id=d.id,
        )

    def _outcome_alert(self, run_id: str, run_name: str, o: Outcome) -> Alert:
        decision = self._decisions.get(o.decision_id)
        anomaly = self._anomalies.get(decision.anomaly_id) if decision and decision.anomaly_id else None
        key = self._incident_key(
            run_id, o.incident_id or (decision.incident_id if decision else None), anomaly
        )
        resolved = o.verdict is Verdict.RESOLVED
        lines = self._header(run_id, run_name, o.step, key)
        what = (
            f"{decision.action} (rule {decision.rule}, rung {decision.rung})" if decision else o.decision_id
        )
        lines.append(f"outcome: {o.verdict.value} after {what}")
        if o.evidence:
            lines.append("judged on: " + ", ".join(f"{k}={fmt(v)}" for k, v in sorted(o.evidence.items())))
        lines.append(f"trace: stabmon trace {run_id}")
        severity = _OUTCOME_SEVERITY.get(o.verdict, Severity.WARNING)
        if decision is not None and not recorded_traits(decision.action).changes_training:  # no worse than what
            base = anomaly.severity if anomaly is not None else Severity.WARNING  # it already told people
            severity = min(severity, base, key=lambda s: s.rank)
        if resolved:
            self._close(run_id, key)
        title = f"[stabmon] {o.verdict.value.upper()}: incident {key} at step {o.step} ({run_name})"
        return Alert(
            run_id,
            run_name,
            "outcome",
            severity,
            key,
            f"outcome:{o.id}",
            o.step,
            title,
            "\n".join(lines),
            incident_id=o.incident_id,
            resolves=resolved,
            priority=resolved or o.verdict is Verdict.STOPPED,
            event_id=o.id,
        )

    @staticmethod
    def _anomaly_title(a: Anomaly, run_name: str) -> str:
        return f"[stabmon] {a.severity.value.upper()}: {a.kind} in {a.metric} at step {a.step} ({run_name})"

    @staticmethod
    def _header(run_id: str, run_name: str, step: int | None, key: str) -> list[str]:
        return [f"run: {run_name} (id {run_id})", f"step: {step} — incident {key}"]

    @staticmethod
    def _anomaly_lines(a: Anomaly) -> list[str]:
        thr = f" threshold={fmt(a.threshold)}" if a.threshold is not None else ""
        lines = [f"anomaly: {a.kind} in {a.metric} (detector {a.detector}) score={fmt(a.score)}{thr}"]
        if a.evidence:
            shown = a.evidence[-_EVIDENCE_SHOWN:]
            more = f" (last {len(shown)} of {len(a.evidence)})" if len(shown) < len(a.evidence) else ""
            lines.append("evidence: " + " ".join(f"{s}={fmt(v)}" for s, v in shown) + more)
        if a.message:
            lines.append(f"detail: {a.message}")
        return lines

    @staticmethod
    def _change_lines(r: InterventionRecord) -> list[str]:
        after = r.stored_after()
        keys = list(dict.fromkeys([*r.before, *after]))
        changes = ", ".join(f"{k} {fmt(r.before.get(k, '-'))} → {fmt(after.get(k, '-'))}" for k in keys)
        return [f"changed: {changes or 'nothing'}" + (" (simulated)" if r.simulated else "")]

    def state_dict(self) -> dict[str, Any]:
        return {"orphan_keys": dict(self._orphan_keys), "aliases": dict(self._aliases)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._orphan_keys = dict(state.get("orphan_keys", {}))
        self._aliases = dict(state.get("aliases", {}))
