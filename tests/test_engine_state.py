"""The engine's saved state: states written in version 1 (the incident a dict, sightings and window rows lists)
still load and continue exactly as the engine that saved them would have, and today's states round-trip."""

from __future__ import annotations

import json

import pytest
from test_engine import runbook, spike

from stabmon.events import Decision, DecisionStatus, InterventionRecord, Outcome, StepRecord, Verdict
from stabmon.runbook import Engine
from stabmon.runbook.state import Incident, Sighting, WindowRow

# Saved by the version-1 engine after 14 records (spikes at 9 and 11, `seen: 2`): a set_clip observed for 3
# records, with a loss baseline and an LR history.
REASON = "spike on grad_norm at step 11 (score 10, error); seen on 2 of the last 5 steps"
OBSERVING_V1 = {
    "version": 1, "runbook": "test", "salt": "legacy", "counter": 2, "tick": 14,
    "losses": [[1, 2.25], [2, 2.5], [3, 2.75], [4, 2.0], [5, 2.25], [6, 2.5], [7, 2.75], [8, 2.0], [9, 2.25], [10, 2.5],
               [11, 2.75], [12, 2.0], [13, 2.25], [14, 2.5]],
    "lrs": [[1, 0.001], [2, 0.002], [3, 0.003], [4, 0.004], [5, 0.005], [6, 0.006], [7, 0.007], [8, 0.008],
            [9, 0.009000000000000001], [10, 0.01], [11, 0.011], [12, 0.012], [13, 0.013000000000000001],
            [14, 0.014]],
    "history": {"spikes": [[9, 9, 7], [11, 11, 9]], "collapse": []}, "cooldown_until": 0, "budget": [11],
    "incident": {
        "id": "daaa917c524c", "rule": "spikes", "rung": 0, "phase": "observing", "anomaly_id": "a11",
        "metric": "grad_norm", "onset_step": 7, "baseline": 2.5, "trigger": REASON,
        "decision": {"step": 11, "action": "set_clip", "params": {"max_norm": 1.5}, "status": "apply",
                     "runbook": "test", "rule": "spikes", "rung": 0, "reason": f"{REASON}; rung 1/3 of rule spikes",
                     "anomaly_id": "a11", "incident_id": "daaa917c524c", "id": "a45d42d56b8b"},
        "window": [[12, 2.0, None, 0], [13, 2.25, None, 0], [14, 2.5, None, 0]],
        "intervention_id": "i-a45d42d56b8b", "error": None, "effective_step": 11, "await_step": None,
        "changed": True, "alerted": False,
    },
    "stopped": False,
}

# Saved by the version-1 engine in propose mode, a proposal waiting since tick 3 (no window, no attempt yet).
TRIGGER = "spike on grad_norm at step 3 (score 10, error); seen on 1 of the last 5 steps"
PROPOSED_V1 = {
    "version": 1, "runbook": "test", "salt": "x", "counter": 2, "tick": 6,
    "losses": [[1, 2.0], [2, 2.0], [3, 2.0], [4, 2.0], [5, 2.0], [6, 2.0]], "lrs": [],
    "history": {"spikes": [[3, 3, 1]], "collapse": []},
    "cooldown_until": 0, "budget": [],
    "incident": {
        "id": "825b938e1bf0", "rule": "spikes", "rung": 0, "phase": "proposed", "anomaly_id": "a3",
        "metric": "grad_norm", "onset_step": 1, "baseline": None, "trigger": TRIGGER,
        "decision": {"step": 3, "action": "set_clip", "params": {"max_norm": 1.5}, "status": "proposed",
                     "runbook": "test", "rule": "spikes", "rung": 0, "reason": f"{TRIGGER}; rung 1/3 of rule spikes",
                     "anomaly_id": "a3", "incident_id": "825b938e1bf0", "id": "12f8c83dbba3"},
        "decision_tick": 3,
    },
    "stopped": False,
}


def _continue(eng: Engine, steps: range, spikes: set[int]) -> list[Decision | Outcome]:
    out: list[Decision | Outcome] = []
    for s in steps:
        record = StepRecord(s, {"loss": 2.0 + 0.25 * (s % 4), "lr": 1e-3 * s})
        for ev in eng.process(record, [spike(s)] if s in spikes else []):
            if isinstance(ev, Decision) and ev.status == DecisionStatus.APPLY:
                eng.applied(ev, InterventionRecord(decision_id=ev.id, step=ev.step, action=ev.action, before={},
                                                   after={}, id=f"i-{ev.id}"))
            out.append(ev)
    return out


def test_a_version_1_state_mid_observation_loads_into_dataclasses() -> None:
    eng = Engine(runbook(seen=2), id_seed="other")
    eng.load_state_dict(json.loads(json.dumps(OBSERVING_V1)))
    inc = eng._incident
    assert isinstance(inc, Incident) and inc.phase == "observing" and inc.baseline == 2.5 and inc.attempt == 1
    assert inc.window[0] == WindowRow(step=12, loss=2.0, signal=None, matched=0)
    assert inc.current.status == DecisionStatus.APPLY and inc.current.params == {"max_norm": 1.5}
    assert eng._history["spikes"] == [Sighting(9, 9, 7), Sighting(11, 11, 9)]


def test_a_version_1_state_continues_as_the_engine_that_saved_it_did() -> None:
    """What the version-1 engine produced after saving OBSERVING_V1, given these records; since then a failed
    rung is undone before the next and a resolved incident's change is given back (the release)."""
    eng = Engine(runbook(seen=2), id_seed="other")
    eng.load_state_dict(OBSERVING_V1)
    # a version-1 state did not track the changes in force: rung 1's is not reverted before rung 2
    judged, rung2, resolved, release = _continue(eng, range(15, 22), spikes={15})
    assert isinstance(release, Decision) and release.action == "release"
    assert release.params["intervention_ids"] == [resolved.intervention_id]
    assert isinstance(judged, Outcome) and judged.verdict == Verdict.ESCALATED and judged.id == "81a4434cb67b"
    assert judged.evidence == {"observed_steps": 4, "judged_steps": 3, "matching_anomalies": 1,
                               "metric": "grad_norm", "loss_baseline": 2.5, "loss_now": 2.5, "loss_within": 0.1,
                               "loss_ratio": 1.0}
    assert isinstance(rung2, Decision) and (rung2.action, rung2.rung) == ("set_beta2", 1)
    assert rung2.reason == f"{REASON}; rung 2/3 of rule spikes" and rung2.incident_id == "daaa917c524c"
    assert isinstance(resolved, Outcome) and (resolved.step, resolved.verdict) == (19, Verdict.RESOLVED)
    assert resolved.intervention_id == f"i-{rung2.id}" and resolved.decision_id == rung2.id


def test_a_version_1_proposal_can_still_be_answered() -> None:
    eng = Engine(runbook(mode="propose", on_timeout="auto_apply"), id_seed="other")
    eng.load_state_dict(PROPOSED_V1)
    assert eng.answer("another", True, 7) == []
    (approved,) = eng.answer("12f8c83dbba3", True, 7)
    assert (approved.status, approved.step, approved.action) == (DecisionStatus.APPROVED, 7, "set_clip")
    assert approved.reason == f"{TRIGGER}; rung 1/3 of rule spikes" and eng._incident is not None
    assert eng._incident.phase == "observing" and eng._incident.window == []


def test_todays_state_is_plain_values_and_continues_identically() -> None:
    a = Engine(runbook(seen=2), id_seed="other")
    a.load_state_dict(OBSERVING_V1)
    state = a.state_dict()
    assert state["version"] == 2 and state["history"]["spikes"][0] == {"tick": 9, "step": 9, "onset": 7}
    assert state["incident"]["window"][0] == {"step": 12, "loss": 2.0, "signal": None, "matched": 0}
    assert state["incident"]["decision"]["status"] == "apply"
    b = Engine(runbook(seen=2), id_seed="else")
    b.load_state_dict(json.loads(json.dumps(state)))
    assert b.state_dict() == state
    assert _continue(a, range(15, 40), {15, 30}) == _continue(b, range(15, 40), {15, 30})


def test_a_state_of_an_unknown_version_or_shape_is_a_one_line_error() -> None:
    eng = Engine(runbook())
    with pytest.raises(ValueError, match=r"^engine\.state\.version must be 1 or 2, got 7$"):
        eng.load_state_dict({**OBSERVING_V1, "version": 7})
    bad = {**OBSERVING_V1, "incident": {**OBSERVING_V1["incident"], "colour": "red"}}  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"^engine\.state\.incident\.colour is not a field of an incident$"):
        eng.load_state_dict(bad)
