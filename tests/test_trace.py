"""``stabmon trace`` and ``stabmon approve / reject`` against a real SQLite store, fed by the real engine and
executor through the shared Pipeline (the detectors are a scripted test double)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from stabmon.cli import app
from stabmon.events import Anomaly, Decision, DecisionStatus, Severity, StepRecord, Verdict
from stabmon.interventions import Executor
from stabmon.overrides import Overrides
from stabmon.pipeline import Pipeline
from stabmon.runbook import Engine, loads_runbook
from stabmon.runbook.trace import build_trace
from stabmon.store import open_store

RUNBOOK = """
name: trace-test
mode: {mode}
cooldown: 5
baseline_steps: 5
release: {{steps: 4, observe: 3}}
rules:
  - name: spikes
    when: {{kind: spike, metric: grad_norm}}
    ladder:
      - {{action: set_clip, params: {{max_norm: 1.5}}, observe: 3, on_failure: revert}}
      - {{action: scale_lr, params: {{factor: 0.5}}, observe: 3, success: {{loss_within: 0.2}}}}
"""


class ScriptedDetectors:
    """DetectorSuiteLike double: flags grad_norm above 5 as a spike with a short evidence window."""

    def __init__(self) -> None:
        self.graces = 0
        self.window: list[tuple[int, float]] = []

    def update(self, record: StepRecord) -> list[Anomaly]:
        g = record.metrics["grad_norm"]
        self.window = (self.window + [(record.step, g)])[-4:]
        if g <= 5:
            return []
        return [Anomaly(kind="spike", metric="grad_norm", step=record.step, score=g, severity=Severity.ERROR,
                        detector="scripted", evidence=tuple(self.window), threshold=5.0)]

    def enter_grace(self, steps: int | None = None) -> None:
        self.graces += 1

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Target:
    training = follow_ups = None  # a replay-like handle: no model, no follow-ups
    def __init__(self) -> None:
        self.overrides = Overrides()
        self.step = 0

    def hparams(self) -> dict[str, float]:
        return {"lr": 0.01 * self.overrides.lr_scale, "clip": self.overrides.max_norm or 2.5}


def run_incident(store: Any, mode: str) -> tuple[str, Pipeline, Target, list[Any]]:
    target = Target()
    pipe = Pipeline(ScriptedDetectors(), Engine(loads_runbook(RUNBOOK.format(mode=mode)), id_seed="t"),
                    Executor(target))
    run_id = store.start_run(name=f"trace-{mode}")
    events: list[Any] = []
    grads = [1.0] * 6 + [9.0, 8.0, 7.0] + [1.0] * 14
    for step, g in enumerate(grads, start=1):
        target.step = step
        produced = pipe.process(StepRecord(step, {"loss": 2.0, "grad_norm": g}))
        events.extend(produced)
        store.write_events(run_id=run_id, events=[e for e in produced if not isinstance(e, StepRecord)])
    assert store.flush(timeout=10)
    return run_id, pipe, target, events


@pytest.fixture
def store(sqlite_url: str):
    s = open_store(sqlite_url)
    yield s
    s.close()


def test_trace_shows_the_chain_per_incident(store: Any, sqlite_url: str) -> None:
    run_id, pipe, target, events = run_incident(store, "apply")
    # set_clip failed (spikes continued) and was reverted; scale_lr resolved it, and was given back: the LR
    # climbed back to the schedule over 4 steps and the run stayed quiet for 3 more
    assert target.overrides.max_norm is None and target.overrides.lr_scale == 1.0
    assert target.overrides.ramp_from == 0.5  # this target takes no optimizer steps to move the re-warm-up on
    assert pipe.detectors.graces == 4  # set_clip, its revert, scale_lr, its release
    result = CliRunner().invoke(app, ["trace", run_id, "--db", sqlite_url, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["run_id"] == run_id and data["unhandled_anomalies"] == 2  # spikes seen while observing
    (inc,) = data["incidents"]
    assert inc["rule"] == "spikes" and inc["runbook"] == "trace-test"
    assert inc["anomaly"]["step"] == 7
    assert inc["anomaly"]["evidence"] == [[4, 1.0], [5, 1.0], [6, 1.0], [7, 9.0]]
    chain = [(s["decision"]["action"], s["intervention"] and s["intervention"]["reverted"],
              s["outcome"] and s["outcome"]["verdict"]) for s in inc["steps"]]
    assert chain == [("set_clip", False, Verdict.REVERTED.value), ("revert", True, None),
                     ("scale_lr", False, Verdict.RESOLVED.value), ("release", False, Verdict.RELEASED.value)]
    release = inc["steps"][3]["intervention"]
    assert release["before"] == {"lr_scale": 0.5, "lr": 0.005}
    assert release["after"] == {"lr_scale": 1.0, "lr": 0.01, "ramp_from": 0.5, "ramp_steps": 4}
    clip = inc["steps"][0]
    assert clip["intervention"]["before"] == {"max_norm": None, "clip": 2.5}
    assert clip["intervention"]["after"] == {"max_norm": 1.5, "clip": 1.5}
    assert clip["outcome"]["evidence"]["matching_anomalies"] == 2
    assert inc["steps"][2]["outcome"]["evidence"]["loss_baseline"] == 2.0
    assert build_trace(events) == {k: v for k, v in data.items() if k not in ("run_id", "run_name")}

    text = CliRunner().invoke(app, ["trace", run_id, "--db", sqlite_url])
    assert text.exit_code == 0
    out = text.output
    assert "evidence     grad_norm steps 4-7: baseline 1, peak 9 at step 7; values 1, 1, 1, 9" in out
    assert "intervention step 7: max_norm None -> 1.5; clip 2.5 -> 1.5" in out
    assert "outcome      reverted at step 10" in out and "outcome      resolved at step 13" in out
    assert "outcome      released at step 20" in out
    assert "1 incident(s); 2 anomaly(ies) without an incident" in out


def test_trace_of_an_unknown_run_is_one_clear_line(store: Any, sqlite_url: str) -> None:
    run_incident(store, "apply")
    result = CliRunner().invoke(app, ["trace", "nope-nope", "--db", sqlite_url])
    assert result.exit_code == 1 and "no run matches 'nope-nope'" in result.output


def test_approve_through_the_cli_reaches_the_engine(store: Any, sqlite_url: str) -> None:
    run_id, pipe, target, events = run_incident(store, "propose")
    proposals = [e for e in events if isinstance(e, Decision)]
    assert [(d.action, d.status) for d in proposals] == [("set_clip", DecisionStatus.PROPOSED)]
    assert target.overrides.max_norm is None  # nothing applied without a human
    args = ["approve", run_id, proposals[0].id[:6], "--db", sqlite_url, "--by", "ann"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"approved {proposals[0].id}: set_clip {{'max_norm': 1.5}}")
    again = CliRunner().invoke(app, ["reject", run_id, proposals[0].id, "--db", sqlite_url])
    assert again.exit_code == 1 and "already approved by ann" in again.output
    # the monitor's flush: poll the store, feed the pipeline
    assert store.refresh_answers(run_id=run_id, timeout=10.0)
    answers = store.poll_answers(run_id=run_id)
    assert answers == [(proposals[0].id, True)]
    produced = [ev for a in answers for ev in pipe.answer(*a, step=16)]
    assert [type(e).__name__ for e in produced] == ["Decision", "InterventionRecord"]
    assert produced[0].status == DecisionStatus.APPROVED and target.overrides.max_norm == 1.5
    assert store.poll_answers(run_id=run_id) == []


def test_reject_through_the_cli(store: Any, sqlite_url: str) -> None:
    run_id, pipe, target, events = run_incident(store, "propose")
    (prop,) = [e for e in events if isinstance(e, Decision)]
    result = CliRunner().invoke(app, ["reject", run_id, prop.id, "--db", sqlite_url, "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["status"] == "rejected"
    assert store.refresh_answers(run_id=run_id, timeout=10.0)
    (rejected,) = pipe.answer(*store.poll_answers(run_id=run_id)[0], step=16)
    assert rejected.status == DecisionStatus.REJECTED and target.overrides.max_norm is None
    bad = CliRunner().invoke(app, ["approve", run_id, "zzzz", "--db", sqlite_url])
    assert bad.exit_code == 1 and "no decisions matching 'zzzz'" in bad.output


def test_missing_database_is_one_clear_line(tmp_path: Any) -> None:
    result = CliRunner().invoke(app, ["trace", "latest", "--db", f"sqlite:///{tmp_path / 'none.db'}"])
    assert result.exit_code == 1 and "no stabmon database at" in result.output


def test_detectors_re_enter_grace_only_after_a_real_change() -> None:
    rb = loads_runbook("""
name: grace
rules:
  - name: spikes
    when: {kind: spike}
    ladder:
      - {action: alert_only, observe: 1}
      - {action: rollback, observe: 1}
      - {action: set_clip, params: {max_norm: 1.0}, observe: 1}
""")
    target = Target()  # no rollback(): the rollback fails and is recorded
    detectors = ScriptedDetectors()
    pipe = Pipeline(detectors, Engine(rb, id_seed="g"), Executor(target))
    actions = []
    for step, g in enumerate([9.0, 9.0, 9.0, 9.0], start=1):
        target.step = step
        actions += [(e.action, detectors.graces) for e in pipe.process(StepRecord(step, {"grad_norm": g}))
                    if isinstance(e, Decision)]
    # the failed rollback hands over to set_clip on its own record (Engine.settle): one grace for that record, the
    # set_clip's, none for the rollback that changed nothing; the spent ladder's last change is undone: a change
    # too, so the detectors re-enter grace after it
    assert actions == [("alert_only", 0), ("rollback", 1), ("set_clip", 1), ("revert", 2)]
