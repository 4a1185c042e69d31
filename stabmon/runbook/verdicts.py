"""How a runbook branches on a ``diagnose`` verdict (kept apart from the engine's state machine).

A rule with ``when: {verdict: data}`` (or ``state``, ``hardware_suspect``) never opens an incident itself: it
answers an incident whose ``diagnose`` rung returned that verdict. When the diagnose intervention is applied,
:func:`note_verdict` keeps its verdict in the incident; at the next record the engine closes the diagnose rung
with an ``escalated`` outcome (evidence: the diagnosis and the rule that follows) and continues the same incident
with the first rung of :func:`rule_for_verdict`'s rule. No verdict (``inconclusive``), or no rule for it, counts
as a failed rung: the diagnose rule's own next rung follows. A ``data`` or ``hardware_suspect`` verdict also clears
the state at the diagnosis' checkpoint (``Incident.cleared``): the incident's restarts land no further back than it.

>>> from stabmon.runbook import loads_runbook
>>> rb = loads_runbook('''
... name: v
... rules:
...   - name: why
...     when: {kind: spike, severity: error}
...     ladder: [{action: diagnose, observe: 1}]
...   - name: skip_data
...     when: {verdict: data}
...     ladder: [{action: rollback, params: {lookback: 0, skip_batches: 200}}]
... ''')
>>> [r.name for r in rb.rules if opens_incidents(r)], rule_for_verdict(rb, "loss", "data").name
(['why'], 'skip_data')
"""

from __future__ import annotations

import fnmatch
from typing import Any

from stabmon.diagnose.verdict import VERDICTS
from stabmon.events import Decision, InterventionRecord
from stabmon.interventions.traits import Traits, traits_of
from stabmon.runbook.schema import Rule, Runbook
from stabmon.runbook.state import Incident


def opens_incidents(rule: Rule) -> bool:
    """Rules without a ``verdict`` condition answer anomalies; the others answer diagnoses."""
    return rule.when.verdict is None


def rule_for_verdict(runbook: Runbook, metric: str, verdict: str) -> Rule | None:
    """The first rule for ``verdict`` whose ``metric`` glob matches the incident's metric."""
    return next((r for r in runbook.rules
                 if r.when.verdict == verdict and fnmatch.fnmatchcase(metric, r.when.metric)), None)


def diagnose_params(traits: Traits, incident: Incident, step: int) -> dict[str, Any]:
    """What a ``diagnose`` rung is told about the incident (nothing for actions that do not diagnose)."""
    if not traits.diagnoses:
        return {}
    if incident.changed_at is not None:  # only steps trained as the run is trained now (see Incident.changed_at)
        step = min(step, incident.changed_at - 1)
    return {"onset_step": incident.onset_step, "step": step, "metric": incident.metric}


def note_verdict(incident: Incident, decision: Decision, record: InterventionRecord) -> None:
    """Keep an applied diagnosis' verdict in the incident; no verdict makes the rung a failed one."""
    if not traits_of(decision.action).diagnoses or not record.ok:
        return
    verdict = record.after.get("verdict")
    if verdict in VERDICTS:
        incident.diagnosis = verdict
        # the state is not to blame: the one it was judged at (or, after a step that did not reproduce, the one
        # before that step: every step up to it did) is a good landing
        checkpoint = record.after.get("cleared_step", record.after.get("checkpoint_step"))
        if verdict != "state" and isinstance(checkpoint, int) and not isinstance(checkpoint, bool):
            incident.cleared = checkpoint
    else:
        incident.error = f"no verdict ({verdict}): {record.after.get('summary', 'no evidence')}"
