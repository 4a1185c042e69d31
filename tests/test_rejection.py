"""Rejecting a proposal: the incident closes and what it changed so far is reverted (``approval.on_reject:
revert``, the default) or kept (``keep``), and the trace says which. A failed rung is undone before the next rung
anyway, so what is in force when a proposal is rejected are the earlier attempts of a repeated rung. The engine
with the real executor, then a
live Monitor in propose mode answered through ``stabmon approve`` / ``stabmon reject`` on a real SQLite file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_monitor import SpikeDetectors, Tiny, batches, loss_of
from test_trace import ScriptedDetectors, Target
from typer.testing import CliRunner

from stabmon.cli import app
from stabmon.collect.config import MonitorConfig
from stabmon.events import Decision, DecisionStatus, InterventionRecord, StepRecord
from stabmon.interventions import Executor
from stabmon.monitor import Monitor
from stabmon.pipeline import Pipeline
from stabmon.runbook import Engine, loads_runbook
from stabmon.runbook.state import incident_from_state, incident_state
from stabmon.runbook.trace import build_trace, format_trace

RUNBOOK = """
name: reject-test
mode: propose
cooldown: 5
approval: {{timeout: 500{on_reject}}}
rules:
  - name: spikes
    when: {{kind: spike, metric: {metric}}}
    ladder:
      - {{action: set_clip, params: {{max_norm: 0.5}}, observe: 3, repeat: 2}}
      - {{action: {second}, observe: 3}}
"""


def pipeline(on_reject: str = "", second: str = "scale_lr, params: {factor: 0.5}") -> tuple[Pipeline, Target]:
    text = RUNBOOK.format(on_reject=f", on_reject: {on_reject}" if on_reject else "", metric="grad_norm",
                          second=second)
    target = Target()
    return Pipeline(ScriptedDetectors(), Engine(loads_runbook(text), id_seed="r"), Executor(target)), target


def climb_to_rung_2(pipe: Pipeline, target: Target) -> tuple[list[Any], Decision]:
    """Spikes from step 3 on: rung 1 proposed and approved, it fails, its second attempt is proposed (the first
    stays in force beneath it)."""
    events: list[Any] = []
    approved = False
    for step in range(1, 12):
        target.step = step
        produced = pipe.process(StepRecord(step, {"loss": 2.0, "grad_norm": 9.0 if step >= 3 else 1.0}))
        events.extend(produced)
        proposed = [e for e in produced if isinstance(e, Decision) and e.status == DecisionStatus.PROPOSED]
        if proposed and not approved:
            events.extend(pipe.answer(proposed[0].id, True, step))
            approved = True
        elif proposed:
            return events, proposed[0]
    raise AssertionError("no second proposal")


def test_rejecting_rung_2_reverts_rung_1() -> None:
    pipe, target = pipeline()
    _, second = climb_to_rung_2(pipe, target)
    assert target.overrides.max_norm == 0.5 and "attempt 2 of 2" in second.reason  # attempt 1 in force
    produced = pipe.answer(second.id, False, 12)
    rejected, revert, record = produced
    assert rejected.status == DecisionStatus.REJECTED and rejected.step == 12
    assert rejected.reason.endswith("rejected at step 12 (on_reject: revert): reverting rung 1 (set_clip)")
    assert (revert.action, revert.rung, revert.params["rejected"]) == ("revert", 0, second.id)
    assert revert.incident_id == second.incident_id
    assert isinstance(record, InterventionRecord) and record.reverted
    assert record.before == {"max_norm": 0.5, "clip": 0.5} and record.after == {"max_norm": None, "clip": 2.5}
    assert target.overrides.max_norm is None and target.overrides.lr_scale == 1.0
    assert not pipe.engine.busy  # the incident is closed


def test_rung_2_follows_a_reverted_rung_1_so_rejecting_it_has_nothing_to_revert() -> None:
    pipe, target = pipeline()
    events, second = climb_to_rung_2(pipe, target)
    events.extend(pipe.answer(second.id, True, 11))
    for step in range(12, 17):  # the second attempt fails too: both undone, then rung 2 is proposed
        target.step = step
        events.extend(pipe.process(StepRecord(step, {"loss": 2.0, "grad_norm": 9.0})))
    third = [e for e in events if isinstance(e, Decision) and e.status == DecisionStatus.PROPOSED][-1]
    assert third.action == "scale_lr" and target.overrides.max_norm is None
    (rejected,) = pipe.answer(third.id, False, 17)
    assert rejected.reason.endswith("the incident had changed nothing")


def test_on_reject_keep_leaves_the_change_in_force() -> None:
    pipe, target = pipeline("keep")
    events, second = climb_to_rung_2(pipe, target)
    (rejected,) = pipe.answer(second.id, False, 12)
    assert rejected.reason.endswith("rejected at step 12 (on_reject: keep): rung 1 (set_clip) stays in force")
    assert target.overrides.max_norm == 0.5 and not pipe.engine.busy
    lines = format_trace(build_trace([*events, rejected]))
    assert "  rejected     at step 12: kept in force set_clip max_norm None -> 0.5; clip 2.5 -> 0.5" in lines


def test_rejecting_the_first_proposal_has_nothing_to_revert() -> None:
    pipe, target = pipeline()
    for step in range(1, 4):
        target.step = step
        produced = pipe.process(StepRecord(step, {"loss": 2.0, "grad_norm": 9.0 if step == 3 else 1.0}))
    (first,) = [e for e in produced if isinstance(e, Decision)]
    (rejected,) = pipe.answer(first.id, False, 4)
    assert rejected.reason.endswith("rejected at step 4 (on_reject: revert): the incident had changed nothing")


def test_a_reverted_rung_is_not_reverted_again_and_a_rollback_cannot_be() -> None:
    """Rung 1 (on_failure: revert) is already undone when rung 2 is rejected: only what is in force counts."""
    text = RUNBOOK.format(on_reject="", metric="grad_norm", second="scale_lr, params: {factor: 0.5}").replace(
        "observe: 3, repeat: 2}", "observe: 3, on_failure: revert}")
    target = Target()
    pipe = Pipeline(ScriptedDetectors(), Engine(loads_runbook(text), id_seed="r"), Executor(target))
    _, second = climb_to_rung_2(pipe, target)
    assert target.overrides.max_norm is None  # reverted on failure
    (rejected,) = pipe.answer(second.id, False, 12)
    assert rejected.reason.endswith("the incident had changed nothing")

    from stabmon.runbook.rejection import plan
    from stabmon.runbook.state import Change, Incident

    inc = Incident(id="i", rule="r", anomaly_id=None, metric="loss", onset_step=0, baseline=None, trigger="t")
    inc.in_force = [Change("iv1", "d1", "rollback", 0, False)]
    assert plan(inc, step=9, policy="revert") == (
        "rejected at step 9 (on_reject: revert): rung 1 (rollback) cannot be undone", [])


def test_changes_in_force_survive_the_engine_state() -> None:
    pipe, target = pipeline()
    climb_to_rung_2(pipe, target)
    state = pipe.engine.state_dict()
    inc = state["incident"]
    assert [c["action"] for c in inc["in_force"]] == ["set_clip"]
    assert incident_state(incident_from_state(inc)) == inc


def test_on_reject_must_be_revert_or_keep() -> None:
    with pytest.raises(ValueError, match=r"approval\.on_reject"):
        loads_runbook(RUNBOOK.format(on_reject=", on_reject: undo", metric="loss", second="alert_only"))


def _cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("seed", [0, 1])
def test_reject_through_the_cli_reverts_a_live_runs_change(tmp_path: Path, seed: int) -> None:
    """A live run in propose mode: rung 1 (clip 1.0 -> 0.5) approved with ``stabmon approve``, rung 2
    rejected with ``stabmon reject``; the run goes back to clip 1.0 at its next flush and ``stabmon trace``
    says so. The spikes are injected into the observed loss from step 5 to 29 (by construction)."""
    from stabmon.store import open_store

    url = f"sqlite:///{tmp_path / 'reject.db'}"
    runbook = tmp_path / "rb.yaml"
    runbook.write_text(RUNBOOK.format(on_reject="", metric="loss", second="scale_lr, params: {factor: 0.5}"))
    torch.manual_seed(seed)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = Monitor(model, opt, store=url, detectors=SpikeDetectors(), runbook=str(runbook), mode="propose",
                  config=MonitorConfig(flush_every=2, clip=1.0, hang_timeout=None), run_name="reject-e2e")
    answered: dict[str, str] = {}  # proposal id -> the answer: the first approved, its second attempt rejected
    for step, idx in mon.steps(batches(60)):
        loss = loss_of(model, idx)
        loss.backward()
        mon.observe(loss=loss * (1e6 if 5 <= step < 30 else 1.0))
        opt.step()
        opt.zero_grad()
        for d in mon.events:
            if isinstance(d, Decision) and d.status == DecisionStatus.PROPOSED and d.id not in answered \
                    and len(answered) < 2:
                assert mon.store.flush(timeout=10)  # type: ignore[union-attr]
                verb = "reject" if answered else "approve"
                _cli(verb, mon.run_id, d.id, "--db", url, "--by", "ops")
                assert mon.store.refresh_answers(run_id=mon.run_id, timeout=10)  # type: ignore[union-attr]
                answered[d.id] = verb
    mon.close()
    assert list(answered.values()) == ["approve", "reject"]
    clips = [r.metrics["clip"] for r in mon.records]
    tightened, restored = clips.index(0.5), len(clips) - clips[::-1].index(0.5)
    assert clips[:tightened] == [1.0] * tightened and set(clips[tightened:restored]) == {0.5}
    assert clips[restored:] == [1.0] * (60 - restored) and restored < 60  # back to 1.0, to the end of the run
    assert mon.overrides.max_norm is None and mon.overrides.lr_scale == 1.0  # scale_lr never applied

    trace = _cli("trace", mon.run_id, "--db", url)
    reject_step = next(e.step for e in mon.events if isinstance(e, Decision) and e.status == DecisionStatus.REJECTED)
    assert f"rejected at step {reject_step} (on_reject: revert): reverting rung 1 (set_clip)" in trace
    assert (f"rejected     at step {reject_step}: reverted max_norm 0.5 -> None; clip 0.5 -> 1; nothing of this "
            "incident is left in force") in trace
    with open_store(url) as store, store.session() as session:
        from stabmon.store.repo import load_events

        stored = load_events(session=session, run_id=mon.run_id)
    reverts = [e for e in stored if isinstance(e, InterventionRecord) and e.reverted]
    assert len(reverts) == 1 and reverts[0].after == {"max_norm": None, "clip": 1.0}


@pytest.mark.parametrize(("in_force", "revertible", "tracked"), [
    (True, True, [("custom_for_test", True)]), (True, False, [("custom_for_test", False)]), (False, False, []),
])
def test_what_a_rejection_tracks_follows_the_interventions_declared_traits(
        in_force: bool, revertible: bool, tracked: list[tuple[str, bool]]) -> None:
    """A custom intervention (no name the engine knows) is tracked by what it declares, not by its name."""
    from stabmon.interventions import INTERVENTIONS, Intervention, register
    from stabmon.runbook.rejection import track
    from stabmon.runbook.state import Incident

    custom = type("Custom", (Intervention,), {"name": "custom_for_test", "stays_in_force": in_force,
                                              "revertible": revertible, "__doc__": "test"})
    inc = Incident(id="i", rule="r", anomaly_id=None, metric="loss", onset_step=0, baseline=None, trigger="t")
    decision = Decision(step=5, action="custom_for_test", params={}, status=DecisionStatus.APPLY, runbook="rb",
                        rule="r", rung=0, reason="test", incident_id="i")
    try:
        register(custom)
        track(inc, decision, InterventionRecord(decision.id, 5, "custom_for_test", {}, {}))
        track(inc, decision, InterventionRecord(decision.id, 5, "custom_for_test", {}, {}, error="boom"))
        track(inc, decision, InterventionRecord(decision.id, 5, "custom_for_test", {}, {}, not_applied="no"))
    finally:
        INTERVENTIONS.pop("custom_for_test", None)
    assert [(c.action, c.revertible) for c in inc.in_force] == tracked  # the failed and skipped ones: never
