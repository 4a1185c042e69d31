"""A rollback is judged over the steps that caused it: after rolling back from step S, its outcome waits until
the run has re-trained past S (plus its observation window), and trouble that comes back on the way fails it
within the same incident. The scenario is built so by construction: the learning-rate schedule peaks at steps
40-44 and the gradient norm spikes whenever the LR in force passes 0.05, whatever the seed."""

from __future__ import annotations

from typing import Any

from test_trace import ScriptedDetectors

from stabmon.events import Decision, InterventionRecord, Outcome, StepRecord, Verdict
from stabmon.interventions import Executor
from stabmon.overrides import Overrides
from stabmon.pipeline import Pipeline
from stabmon.runbook import Engine, loads_runbook

PEAK = range(40, 45)

RUNBOOK = """
name: rollback-window
mode: apply
cooldown: 0
baseline_steps: 5
rules:
  - name: spikes
    when: {{kind: spike, metric: grad_norm}}
    ladder:
      - {{action: rollback, params: {{lookback: 5{lr_factor}}}, observe: 5}}
      - {{action: scale_lr, params: {{factor: 0.25}}, observe: 5}}
"""


class ScheduledRun:
    """A handle that trains by a fixed LR schedule and really rewinds on a rollback (checkpoints
    every 10 steps). As in the live monitor, ``step`` is the step to train next while a record is judged."""
    training = follow_ups = None  # a replay-like handle: no model, no follow-ups

    def __init__(self) -> None:
        self.overrides = Overrides()
        self.step = 1
        self.rewound_to: int | None = None

    def lr_at(self, step: int) -> float:
        return (0.1 if step in PEAK else 0.01) * self.overrides.lr_scale

    def hparams(self) -> dict[str, float]:
        return {"lr": self.lr_at(self.step), "clip": 1.0}

    def rollback(self, *, onset_step: int, lookback: int, skip_batches: int, **_: Any) -> dict[str, Any]:
        checkpoint = (onset_step - lookback) // 10 * 10
        self.step = self.rewound_to = checkpoint
        return {"checkpoint_step": checkpoint, "restored_step": checkpoint, "skipped": []}


def run(lr_factor: str = "", steps: int = 90) -> tuple[list[Any], list[tuple[int, int]]]:
    """Every event, and each (step, record number) processed; after a rollback the run re-trains from the
    restored step."""
    target = ScheduledRun()
    pipe = Pipeline(ScriptedDetectors(), Engine(loads_runbook(RUNBOOK.format(lr_factor=lr_factor)), id_seed="w"),
                    Executor(target))
    events: list[Any] = []
    processed: list[tuple[int, int]] = []
    step = 1
    while len(processed) < steps:
        lr = target.lr_at(step)
        record = StepRecord(step, {"loss": 2.0, "lr": lr, "grad_norm": 9.0 if lr > 0.05 else 1.0})
        processed.append((step, len(processed)))
        target.step = step + 1  # the step is trained; its record is judged
        events.extend(pipe.process(record))
        if target.rewound_to is not None:
            step, target.rewound_to = target.rewound_to, None  # the restored step is trained next
        else:
            step += 1
    return events, processed


def test_a_rollback_that_meets_the_same_peak_again_escalates_the_same_incident() -> None:
    events, processed = run()
    (rollback,) = [e for e in events if isinstance(e, InterventionRecord) and e.action == "rollback"]
    assert rollback.before["step"] == 41 and rollback.after["restored_step"] == 30  # trained to 40, back to 30
    outcomes = [e for e in events if isinstance(e, Outcome)]
    first = outcomes[0]
    assert first.verdict == Verdict.ESCALATED  # not "resolved" a few quiet steps after the restore ...
    assert first.step == 40 and first.evidence["rolled_back_from"] == 41  # ... the peak came back at step 40
    assert first.evidence["matching_anomalies"] == 1 and first.evidence["observed_steps"] == 11  # steps 30-40
    second_time = [n for s, n in processed if s == 40][1]
    assert second_time > [n for s, n in processed if s == 40][0]  # judged when the run reached S again
    decisions = [e for e in events if isinstance(e, Decision)]
    assert [d.action for d in decisions] == ["rollback", "scale_lr", "release"]  # resolved: the LR given back
    assert len({e.incident_id for e in [*decisions, *outcomes]}) == 1  # one incident, not a second one
    assert [o.verdict for o in outcomes] == [Verdict.ESCALATED, Verdict.RESOLVED]


def test_a_rollback_that_holds_is_resolved_only_past_the_step_it_rolled_back_from() -> None:
    events, processed = run(lr_factor=", lr_factor: 0.25")  # restart at a quarter of the LR: the peak is 0.025
    (outcome,) = [e for e in events if isinstance(e, Outcome)]
    assert outcome.verdict == Verdict.RESOLVED
    assert outcome.step == 45  # the window ran through steps 30-40 again, then 5 new steps (41-45)
    assert outcome.evidence["observed_steps"] == 16 and outcome.evidence["matching_anomalies"] == 0
    # resolved, then the rollback's LR factor is given back (re-warmed), observed after the run leaves the test
    assert [e.action for e in events if isinstance(e, Decision)] == ["rollback", "release"]


def test_replay_keeps_the_usual_window_for_a_simulated_rollback() -> None:
    """In replay the steps do not rewind, so a simulated rollback's window is the next ``observe`` records."""
    from stabmon.replay.simulate import Simulation

    target = Simulation(checkpoint_interval=10)
    pipe = Pipeline(ScriptedDetectors(), Engine(loads_runbook(RUNBOOK.format(lr_factor="")), id_seed="w"),
                    Executor(target.handle, simulated=True))
    events: list[Any] = []
    for step in range(1, 60):
        record = StepRecord(step, {"loss": 2.0, "grad_norm": 9.0 if step == 40 else 1.0})
        target.begin_block([record])
        events.extend(pipe.process(record))
    (outcome,) = [e for e in events if isinstance(e, Outcome)]
    assert outcome.verdict == Verdict.RESOLVED and outcome.step == 45  # records 41-45, as before this rule


SETTLE = """
name: settle
mode: apply
cooldown: 0
rules:
  - name: spikes
    when: {kind: spike, metric: grad_norm}
    ladder:
      - {action: scale_layer_lr, params: {factor: 0.01}, observe: 5}
      - {action: rollback, params: {lookback: 5}, observe: 5}
"""


def test_a_rung_that_cannot_act_hands_over_on_the_same_record() -> None:
    """The first rung (a layer cut, with no layer flagged) changes nothing: the rollback follows on the record
    that opened the incident, not on the next one (which, live, may be a flush later)."""
    target = ScheduledRun()
    pipe = Pipeline(ScriptedDetectors(), Engine(loads_runbook(SETTLE), id_seed="s"), Executor(target))
    for step in range(1, 30):
        target.step = step + 1
        pipe.process(StepRecord(step, {"loss": 2.0, "lr": 0.01, "grad_norm": 1.0}))
    target.step = 31
    events = pipe.process(StepRecord(30, {"loss": 2.0, "lr": 0.01, "grad_norm": 9.0}))
    records = [e for e in events if isinstance(e, InterventionRecord)]
    assert [(r.action, r.not_applied is not None) for r in records] == [("scale_layer_lr", True), ("rollback", False)]
    assert target.rewound_to == 20  # the checkpoint 5 steps before the onset (29), on the opening record
