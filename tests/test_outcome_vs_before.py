"""An outcome compares the run with its own pre-incident trajectory, and "resolved" needs the run back near it:
escalation goes on while the loss stays clearly worse than before the incident (issue 26: LR-cap rollbacks
"resolved" with the loss far above where it was). Only an open incident is judged: a healthy run has none."""

from __future__ import annotations

from stabmon.events import Anomaly, Decision, InterventionRecord, Outcome, Severity, StepRecord, Verdict
from stabmon.runbook import Engine, loads_runbook

RUNBOOK = """
name: before
mode: apply
cooldown: 0
baseline_steps: 10
rules:
  - name: spikes
    when: {kind: spike, metric: loss, severity: error}
    ladder:
      - action: set_clip
        params: {max_norm: 1.0}
        observe: 4
      - action: scale_lr
        params: {factor: 0.5}
        observe: 4
"""


def loss_before(step: int) -> float:
    return 2.0 + 0.01 * ((step * 7) % 5 - 2)  # 1.98 .. 2.02: the run's own noise


def run(after: float) -> list[Decision | Outcome]:
    """20 healthy steps, a loss spike at step 20, then the loss at ``after`` (no anomaly: the detectors have
    re-baselined on it) while the changes are observed."""
    engine = Engine(loads_runbook(RUNBOOK), id_seed="s")
    out: list[Decision | Outcome] = []
    for step in range(40):
        loss = loss_before(step) if step < 20 else (9.0 if step == 20 else after)
        spike = Anomaly("spike", "loss", step, 12.0, Severity.ERROR, "test", ((step, loss),))
        anomalies = [spike] if step == 20 else []
        produced = engine.process(StepRecord(step, {"loss": loss}), anomalies)
        for ev in produced:
            if isinstance(ev, Decision):
                engine.applied(ev, InterventionRecord(ev.id, ev.step, ev.action, {}, {}, id=f"i-{ev.id}"))
        out += produced
    return out


def test_a_run_that_stays_clearly_worse_is_not_resolved_and_escalates() -> None:
    events = run(after=3.0)
    outcomes = [e for e in events if isinstance(e, Outcome)]
    # each rung that did not resolve it is undone before the next, and the spent ladder leaves nothing in force
    assert [e.action for e in events if isinstance(e, Decision)] == ["set_clip", "revert", "scale_lr", "revert"]
    assert [o.verdict for o in outcomes] == [Verdict.ESCALATED, Verdict.EXHAUSTED]
    pre = outcomes[0].evidence["pre_incident"]
    assert pre["clearly_worse"] is True and pre["loss_now"] == 3.0
    assert pre["loss_median"] == 2.0 and pre["loss_reached"] == 1.98 and pre["worse_by"] == 1.0


def test_a_run_back_where_it_was_is_resolved_and_says_how_it_compares() -> None:
    events = run(after=2.03)
    outcomes = [e for e in events if isinstance(e, Outcome)]
    assert [o.verdict for o in outcomes] == [Verdict.RESOLVED]
    pre = outcomes[0].evidence["pre_incident"]
    assert pre["clearly_worse"] is False and pre["loss_now"] == 2.03 and pre["loss_median"] == 2.0


def test_a_healthy_run_whose_loss_rises_is_never_changed() -> None:
    """No anomaly, no incident, nothing judged: a rising loss alone (an over-fitting fine-tune) changes nothing."""
    engine = Engine(loads_runbook(RUNBOOK), id_seed="s")
    produced = [e for step in range(60) for e in engine.process(StepRecord(step, {"loss": 2.0 + 0.05 * step}), [])]
    assert produced == []
