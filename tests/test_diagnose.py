"""``diagnose`` on the tiny GPT: a corrupted shard is ``data``, a learning rate far too high is ``state``, a fault
in one execution of one step is ``hardware_suspect``, and the diagnose-first runbook acts on each verdict.

Every instability here is there by construction: batches 150-249 are random characters (bad-shard), the peak
learning rate is 100x the stable one where every seed of the sweep fails (lr-too-high), or a forward hook puts an
inf in the first block's output the first time step 110 runs (flaky-gpu). Runs are cut short after the verdict.
Another seed or thread count: ``STABMON_TEST_SEED=7 STABMON_TEST_THREADS=2 pytest tests/test_diagnose.py``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from scenario_support import scenarios
from typer.testing import CliRunner

from stabmon.collect.batches import BatchLog
from stabmon.collect.config import SnapshotConfig, UpdateConfig
from stabmon.collect.signals.updates import UpdateNorms
from stabmon.diagnose.experiments import FIRST_HALF, REPLAY_NOT_NEEDED, Plan, _halves, _peak, _settled
from stabmon.diagnose.verdict import incident_steps, replay_recurs, verdict_of
from stabmon.events import InterventionRecord, Metric, StepRecord
from stabmon.monitor import Monitor, MonitorConfig
from stabmon.runbook.trace import diagnosis_lines

SEED = int(os.environ.get("STABMON_TEST_SEED", "5"))
THREADS = int(os.environ.get("STABMON_TEST_THREADS", "1"))




def train(scenario: str, steps: int, tmp_path: Path, snapshots: SnapshotConfig | None = None,
          runbook: str = "diagnose-first", **monitor: Any) -> Any:
    sc = scenarios()
    config = sc.scenario(scenario).config(SEED, steps=steps, threads=THREADS)

    def factory(model: Any, opt: Any, sched: Any) -> Monitor:
        return Monitor(model, opt, scheduler=sched, store=None, runbook=runbook, mode="apply",
                       config=MonitorConfig(clip=config.clip, checkpoint_every=25, checkpoint_keep=40,
                                            snapshots=snapshots or SnapshotConfig()),
                       checkpoint_dir=str(tmp_path / "ckpt"), **monitor)

    return sc.tiny_gpt.train(config, monitor=factory)


def diagnoses(result: Any) -> list[InterventionRecord]:
    return [e for e in result.monitor.events if isinstance(e, InterventionRecord) and e.action == "diagnose"]


def actions_after(result: Any, record: InterventionRecord) -> list[str]:
    events = result.monitor.events
    later = events[events.index(record) + 1:]
    return [e.action for e in later if isinstance(e, InterventionRecord)]


def test_the_default_runbook_keeps_a_batch_log_only_with_checkpoints_to_diagnose_from(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters())
    without = Monitor(model, opt, store=None, runbook="default", mode="apply")
    assert without.batches is None  # every diagnosis would be inconclusive: nothing is kept
    without.close()
    with Monitor(model, opt, store=None, runbook="default", mode="apply", checkpoint_dir=str(tmp_path)) as monitor:
        assert isinstance(monitor.batches, BatchLog) and monitor.batches.max_bytes == 1 << 30
        for _, batch in monitor.steps([torch.ones(4, 2)] * 3):
            loss = model(batch).sum()
            loss.backward()
            monitor.observe(loss=loss)
            opt.step()
            opt.zero_grad()
        assert sorted(monitor.batches.entries) == [0, 1, 2] and monitor.batches.bytes == 3 * 4 * 2 * 4


def test_a_batch_log_bounded_below_the_incident_falls_through_to_the_restart(tmp_path: Path) -> None:
    """The default runbook on a corrupted shard with a batch log of one batch's bytes: the diagnosis cannot reach
    back to its checkpoint, says why, and the restart that screens 200 batches follows (as before diagnosing)."""
    from stabmon.collect.config import DiagnoseConfig

    sc = scenarios()
    config = sc.scenario("bad-shard").config(SEED, steps=175, threads=THREADS)

    def factory(model: Any, opt: Any, sched: Any) -> Monitor:
        tight = DiagnoseConfig(max_bytes=1)  # the newest batch only
        return Monitor(model, opt, scheduler=sched, store=None, runbook="default", mode="apply",
                       config=MonitorConfig(clip=config.clip, checkpoint_every=25, diagnose=tight),
                       checkpoint_dir=str(tmp_path / "ckpt"))

    result = sc.tiny_gpt.train(config, monitor=factory)
    (d,) = diagnoses(result)
    assert d.after["verdict"] == "inconclusive"
    assert "in the batch log (it keeps 256 batches, at most 1 bytes" in d.after["summary"]
    rollback = actions_after(result, d)
    assert rollback and rollback[0] == "rollback"
    restart = next(e for e in result.monitor.events if isinstance(e, InterventionRecord) and e.action == "rollback")
    # the default's restart screens the 200 batches past the onset (skipping none blind) where the loop observes its
    # loss before the step, as this one does
    start, stop = restart.after["screened"]
    assert restart.after["skipped"] == [start, start]
    assert stop - max(start, restart.before["onset_step"]) == 200


def test_a_corrupted_shard_is_data_and_its_batches_are_skipped(tmp_path: Path) -> None:
    result = train("bad-shard", 175, tmp_path, sample_ids=lambda batch: [f"row{i}" for i in range(len(batch[0]))])
    (d,) = diagnoses(result)
    ev = d.after
    assert ev["verdict"] == "data", ev["summary"]
    assert ev["rerun"]["reproduced"] is True  # a deterministic re-run reproduces the recorded steps
    incident = [b for b in ev["batches"] if b["role"] == "incident"]
    assert incident and all(150 <= b["batch_index"] < 250 for b in incident)  # exactly the corrupted batches
    assert all(b["sample_ids"][:2] == ["row0", "row1"] for b in ev["batches"])
    assert ev["replay"]["recurs"] is True and ev["checkpoint_step"] <= min(ev["incident_steps"])
    # random characters stand out by far more than twice the bar: half the batches decided it, the rest were
    # not replayed (and say so in the trace)
    replayed = [b for b in ev["batches"] if b["at_checkpoint"] is not None]
    assert ev["replay"]["settled"] == FIRST_HALF and ev["replay"]["replayed"] == len(replayed) < len(ev["batches"])
    assert float(ev["replay"]["excess"]) >= 2 * float(ev["replay"]["needed"])
    lines = diagnosis_lines({"step": d.step, "after": ev})
    assert any(f"{len(replayed)} replayed ({FIRST_HALF})" in line for line in lines), lines
    assert actions_after(result, d)[0] == "rollback"
    rollback = next(e for e in result.monitor.events if isinstance(e, InterventionRecord) and e.action == "rollback")
    start, stop = rollback.after["skipped"]
    assert start <= 150 and stop >= 250  # the whole shard is skipped
    # the data is to blame, not the state the diagnosis judged at: the restart lands there (checkpoint 150, the
    # state before the first bad batch), not at the one before the onset (the update before the spike, step 149)
    assert rollback.after["checkpoint_step"] == ev["checkpoint_step"] == 150


def test_a_learning_rate_far_too_high_is_state_and_the_lr_is_capped(tmp_path: Path) -> None:
    result = train("lr-too-high", 125, tmp_path)
    (d,) = diagnoses(result)
    assert d.after["verdict"] == "state", d.after["summary"]
    assert d.after["rerun"]["reproduced"] is True and d.after["replay"]["recurs"] is False
    decision = next(e for e in result.monitor.events if getattr(e, "rule", None) == "bad_state")
    assert decision.action == "rollback" and decision.params["lr_cap"] == 0.5


def test_a_fault_in_one_execution_of_a_step_is_hardware_suspect_and_stops_for_a_move(tmp_path: Path) -> None:
    result = train("flaky-gpu", 125, tmp_path)
    (d,) = diagnoses(result)
    ev = d.after
    assert ev["verdict"] == "hardware_suspect", ev["summary"]
    assert ev["rerun"]["mismatch"]["step"] == 110 and ev["rerun"]["mismatch"]["recorded"] == "nan"
    assert ev["rerun"]["from_step"] < 110  # steps before the fault were re-run and reproduced exactly
    assert ev["host"] and ev["rank"] == 0
    # one process: the re-run decided it, so no batch was replayed (each would be a forward and backward pass)
    assert ev["replay"]["recurs"] is None and ev["replay"]["skipped"] == REPLAY_NOT_NEEDED
    assert ev["batches"] and all(b["at_checkpoint"] is None for b in ev["batches"])
    lines = diagnosis_lines({"step": d.step, "after": ev})
    assert any(f"replay of the batches: not run ({REPLAY_NOT_NEEDED})" in line for line in lines), lines
    assert not any("at the checkpoint of step" in line for line in lines), lines
    assert actions_after(result, d) == ["checkpoint_and_stop"]
    assert result.exit_code == 88


def test_with_snapshots_the_diagnosis_starts_from_the_newest_one_before_the_fault(tmp_path: Path) -> None:
    """Host snapshots every 5 steps, disk checkpoints every 25: the re-run starts from the snapshot just before the
    faulted step, not from the disk checkpoint of step 100, and comes to the same verdict."""
    result = train("flaky-gpu", 125, tmp_path, snapshots=SnapshotConfig(every=5, keep=4), runbook="default")
    (d,) = diagnoses(result)
    ev = d.after
    assert ev["verdict"] == "hardware_suspect", ev["summary"]
    assert ev["checkpoint_path"].startswith("memory://snapshot-"), ev["checkpoint_path"]
    assert 100 < ev["rerun"]["from_step"] <= 110 == ev["rerun"]["mismatch"]["step"]
    rollback = next(e for e in result.monitor.events if isinstance(e, InterventionRecord) and e.action == "rollback")
    assert rollback.after["checkpoint_step"] == ev["checkpoint_step"]  # the state the verdict cleared


def test_a_gradient_spike_before_the_incidents_steps_is_re_run_with_snapshots_as_without(tmp_path: Path) -> None:
    """second-moment-spike: one execution of step 60 brings a 10^4x gradient; the loss regresses 10-20 steps
    later, so the incident's steps (chosen on the loss) all come after it. With a snapshot between the two, the
    diagnosis still starts before the spike, re-runs it and calls it a transient fault, as from the disk alone."""
    fault = scenarios().scenario("second-moment-spike").config(SEED).fault_step
    verdicts = []
    for snapshots in (None, SnapshotConfig(every=5, keep=10)):
        result = train("second-moment-spike", 110, tmp_path / str(snapshots is None), snapshots=snapshots)
        (d,) = diagnoses(result)
        ev = d.after
        assert min(ev["incident_steps"]) > fault, ev["incident_steps"]  # the loss rose after the spike
        assert ev["checkpoint_step"] <= fault and ev["rerun"]["mismatch"]["step"] == fault, ev["rerun"]
        # one process: the re-run stopped at the step that did not reproduce, the later ones were not trained again
        assert ev["rerun"]["to_step"] == fault < min(ev["incident_steps"]), ev["rerun"]
        verdicts.append((ev["verdict"], ev["checkpoint_path"].startswith("memory://")))
    assert verdicts == [("hardware_suspect", False), ("hardware_suspect", True)]


def test_the_diagnosis_starts_before_the_first_step_whose_gradient_stands_far_out() -> None:
    def rec(step: int, grad_norm: float) -> StepRecord:
        return StepRecord(step=step, metrics={Metric.GRAD_NORM: grad_norm})

    calm = {s: rec(s, 1.0 + 0.01 * (s % 3)) for s in range(0, 40)}
    assert _peak(calm, 30, 39, k=4) == 39  # nothing stands out: the incident's own steps decide
    drift = {**calm, **{s: rec(s, 1.0 + s - 30) for s in range(30, 40)}}
    assert _peak(drift, 30, 39, k=4) == 39  # a drift up to 10x is not a spike of 50x
    spike = {**calm, 33: rec(33, 60.0)}
    assert _peak(spike, 30, 39, k=4) == 33
    nan = {**calm, 35: rec(35, math.nan), 36: rec(36, 500.0)}
    assert _peak(nan, 30, 39, k=4) == 35
    assert _peak({30: rec(30, 60.0)}, 30, 39, k=4) == 39  # no baseline before the onset: no bar


def test_one_process_replays_the_second_half_only_when_the_first_is_close_to_the_bar() -> None:
    """The first half: the earlier half of the incident's steps and the reference steps nearest them. It settles
    the answer only a factor of two away from the bar, either side; in between, every batch is replayed."""
    incident, reference = [20, 21, 22, 23], [12, 13, 14, 15, 16, 17, 18, 19]
    recorded = {s: StepRecord(step=s, metrics={Metric.LOSS: 3.0 if s in incident else 2.0}) for s in range(8, 24)}
    plan = Plan(signal=Metric.LOSS, incident=incident, reference=reference, baseline=[2.0] * 8, entries={},
                recorded=recorded, checkpoint=None, state={}, rerun_skipped=None)
    first, rest = _halves(plan)
    assert first == [20, 21, 16, 17, 18, 19] and sorted(first + rest) == sorted(incident + reference)

    def settled(inc: float, spread: float = 0.01) -> bool:
        refs = {s: 2.0 + spread * (i % 3) for i, s in enumerate(reference)}
        return _settled(plan, {**{s: refs[s] for s in first if s in refs}, **{s: inc for s in first if s in incident}},
                        recur=0.5)

    # the bar here is half the recorded excess (1.0 x recur 0.5): 0.5 above the reference batches
    assert settled(3.2)        # 1.2 above them: over twice the bar, the data
    assert settled(2.2)        # 0.2 above: under half of it, not the data
    assert not settled(2.6)    # 0.6: past the bar, but not by a factor of two
    assert not settled(2.4)    # 0.4: under it, but not by a factor of two
    assert _settled(plan, {s: 2.6 for s in incident + reference}, recur=0.5)  # every batch replayed: decided


def test_diagnose_restores_the_run_exactly(tmp_path: Path) -> None:
    """The experiments run on the live model: afterwards parameters, optimizer state and RNG are as before."""
    sc = scenarios()
    config = sc.scenario("lr-too-high").config(SEED, steps=60, threads=THREADS)
    made: list[Monitor] = []

    def factory(model: Any, opt: Any, sched: Any) -> Monitor:
        # observe mode has no engine: a sample_ids hook keeps the batch log on anyway
        made.append(Monitor(model, opt, scheduler=sched, store=None, runbook="diagnose-first", mode="observe",
                            config=MonitorConfig(clip=1.0, checkpoint_every=25), checkpoint_dir=str(tmp_path),
                            sample_ids=lambda batch: list(range(len(batch[0])))))
        return made[0]

    sc.tiny_gpt.train(config, monitor=factory)
    mon = made[0]
    before = [p.detach().clone() for p in mon.model.parameters()]
    opt_before = {k: v.clone() for k, v in mon.optimizer.state[mon.optimizer.param_groups[0]["params"][0]].items()}
    rng = torch.get_rng_state()
    ev = mon.diagnose(onset_step=40, step=55, metric="loss", max_batches=4, rtol=1e-4, recur=0.5).as_after()
    assert ev["rerun"]["reproduced"] is True, ev
    assert all(torch.equal(a, b) for a, b in zip(before, mon.model.parameters(), strict=True))
    state = mon.optimizer.state[mon.optimizer.param_groups[0]["params"][0]]
    assert all(torch.equal(v, state[k]) for k, v in opt_before.items())
    assert torch.equal(rng, torch.get_rng_state())


def test_without_checkpoints_the_verdict_is_inconclusive_and_the_ladder_goes_on() -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(8, 4, generator=torch.Generator().manual_seed(i)),) for i in range(30)]
    with Monitor(model, opt, store=None, runbook="diagnose-first", mode="observe",
                 loss_fn=lambda m, b: m(b[0]).pow(2).mean(), sample_ids=lambda b: list(range(len(b[0])))) as mon:
        for _step, (x,) in mon.steps(data):
            loss = model(x).pow(2).mean()
            loss.backward()
            mon.observe(loss=loss)
            opt.step()
            opt.zero_grad()
        ev = mon.diagnose(onset_step=5, step=15, metric="loss", max_batches=4, rtol=1e-4, recur=0.5).as_after()
    assert ev["verdict"] == "inconclusive" and "checkpoint" in ev["summary"]


def test_a_loop_that_hands_no_batch_is_told_so_and_its_diagnose_rungs_are_dropped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="stabmon"):
        mon = Monitor(model, opt, store=None, runbook="diagnose-first", mode="apply", checkpoint_dir=str(tmp_path),
                      config=MonitorConfig(checkpoint_every=10, hang_timeout=None),
                      loss_fn=lambda m, b: m(b[0]).pow(2).mean())
        for step in range(30):  # a hand-written loop: it samples its own batches and hands none over
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            mon.begin_step()
            loss = model(x).pow(2).mean()
            loss.backward()
            mon.observe(loss=loss)
            opt.step()
            opt.zero_grad()
            mon.end_step()
        ev = mon.diagnose(onset_step=15, step=25, metric="loss", max_batches=4, rtol=1e-4, recur=0.5).as_after()
        mon.close()
    # the verdict says what is missing (before: "no loss recorded for the incident", though the losses were)
    assert ev["verdict"] == "inconclusive" and ev["summary"].startswith("no batch was handed to the monitor"), ev
    dropped = [r.getMessage() for r in caplog.records if "dropped from the ladder" in r.getMessage()]
    # said once, at the first step, one line per reason: the diagnoses, and the restarts that could only skip
    # batches (a capped restart follows them in the ladder)
    assert len(dropped) == 2 and "diagnose needs the batches" in dropped[0], dropped
    assert "it would be a plain restart" in dropped[1], dropped


# -- the verdict logic, pure ------------------------------------------------------------------------------------
def test_incident_steps_are_the_ones_that_rose_else_the_last_ones() -> None:
    window = [(1, 2.0), (2, 2.1), (3, math.nan), (4, math.inf)]
    assert incident_steps(window, baseline=[2.0, 2.0], limit=8) == [3, 4]
    flat = [(s, 2.4) for s in range(20)]
    assert incident_steps(flat, baseline=[], limit=3) == [17, 18, 19]


def test_replay_needs_a_clear_excess_and_a_rerun_mismatch_wins() -> None:
    ordinary = replay_recurs(incident=[2.45, 2.5], reference=[2.44, 2.47, 2.5], recorded_excess=0.02, recur=0.5)
    assert ordinary["recurs"] is False  # noise never counts as a recurrence
    assert verdict_of(None, {**ordinary, "checkpoint_step": 0})[0] == "state"
    mismatch = {"reproduced": False, "from_step": 0, "mismatch": {"step": 3, "metric": "loss"}}
    assert verdict_of(mismatch, {"recurs": True, "excess": 1, "needed": 0})[0] == "hardware_suspect"
    assert verdict_of(None, None)[0] == "inconclusive"


# -- the update norm ------------------------------------------------------------------------------------------
def test_update_norm_is_the_step_applied_per_layer_and_zero_when_skipped() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [torch.randn(16, 4, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    expected = []
    with Monitor(model, opt, store=None, config=MonitorConfig(clip=0.5, flush_every=2,
                                                              updates=UpdateConfig(every=2))) as mon:
        for _step, x in mon.steps(data):
            loss = model(x).pow(2).mean()
            loss.backward()
            mon.observe(loss=loss)
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before, strict=True)])
            theta = torch.cat([b.flatten() for b in before])  # the weights the step was taken from
            expected.append(float(delta.norm() / theta.norm()))
            opt.zero_grad()
    for r in mon.records:
        if r.step % 2 == 0:
            assert r.get(Metric.UPDATE_RATIO) == pytest.approx(expected[r.step], rel=1e-5)
            assert {"update_ratio/0", "update_ratio/1"} <= set(r.metrics)
        else:
            assert Metric.UPDATE_RATIO not in r.metrics
    from stabmon.collect.signals.grads import GradNorms

    p = torch.nn.Parameter(torch.ones(3))
    upd = UpdateNorms(GradNorms(torch.nn.ParameterList([p])))
    p.grad = torch.ones(3)
    upd.before_update()  # a skipped update (the optimizer left the parameters as they were): nothing applied
    assert float(upd.after_update()[1][0]) == 0.0


# -- bad input --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("when", "message"), [
    ("{verdict: flaky}", "when.verdict"),
    ("{verdict: data}", "needs a rule with a diagnose rung"),
])
def test_a_bad_verdict_condition_is_one_line_naming_file_and_line(tmp_path: Path, when: str, message: str) -> None:
    from stabmon.runbook import load_runbook

    path = tmp_path / "bad.yaml"
    path.write_text(f"name: bad\nrules:\n  - name: r\n    when: {when}\n    ladder: [{{action: alert_only}}]\n")
    with pytest.raises(ValueError) as err:
        load_runbook(str(path))
    text = str(err.value)
    assert text.startswith(f"{path}:") and message in text and "\n" not in text


def test_sample_ids_must_be_host_values() -> None:
    log = BatchLog(4, sample_ids=lambda batch: torch.arange(3))
    log.remember(step=0, batch_index=0, batch=[torch.zeros(3)])
    assert log.get(0) is not None and log.get(0).sample_ids is None and log.errors == 1
    log.remember(step=1, batch_index=1, batch=None)  # the step began without its batch: not handed (yet)
    assert log.get(1) is None and not log.handed(1) and log.errors == 1
    log.complete(step=1, batch=[torch.zeros(2)])  # handed after begin_step (a framework's forward)
    assert log.handed(1) and log.steps() == [0, 1] and log.errors == 2
    with pytest.raises(ValueError, match="sample_ids"):
        BatchLog(4, sample_ids="ids")  # type: ignore[arg-type]


# -- the CLI ----------------------------------------------------------------------------------------------------
def test_demo_with_diagnose_first_then_trace_shows_the_data_verdict(tmp_path: Path) -> None:
    from stabmon.cli import app

    url = f"sqlite:///{tmp_path / 'demo.db'}"
    demo = CliRunner().invoke(app, ["demo", "--scenario", "bad-shard", "--runbook", "diagnose-first", "--steps",
                                    "175", "--seed", str(SEED), "--db", url])
    assert demo.exit_code == 0, demo.output
    assert "verdict data" in demo.output
    run_id = next(line.split()[1] for line in demo.output.splitlines() if line.startswith("run: "))
    trace = CliRunner().invoke(app, ["trace", run_id, "--db", url, "--json"])
    assert trace.exit_code == 0, trace.output
    assert '"verdict": "data"' in trace.output
    incidents = json.loads(trace.output)["incidents"]
    incident = next(i for i in incidents if i["steps"][0]["decision"]["action"] == "diagnose")
    evidence = incident["steps"][0]["intervention"]["after"]
    assert evidence["incident_steps"] and evidence["batches"] and incident["batches"]
    assert incident["steps"][1]["decision"]["rule"] == "bad_data"
    text = CliRunner().invoke(app, ["trace", run_id, "--db", url]).output
    assert "verdict data" in text and "re-run steps" in text


# -- the engine follows the verdict -----------------------------------------------------------------------------
@pytest.mark.parametrize(("verdict", "rule", "action"), [
    ("data", "bad_data", "rollback"), ("state", "bad_state", "rollback"),
    ("hardware_suspect", "bad_hardware", "checkpoint_and_stop"), ("inconclusive", "instability", "rollback"),
])
def test_the_engine_continues_the_incident_with_the_verdicts_rule(verdict: str, rule: str, action: str) -> None:
    from stabmon.events import Anomaly, Decision, Outcome, Severity, StepRecord
    from stabmon.runbook import Engine, load_runbook

    engine = Engine(load_runbook("diagnose-first"), id_seed="t")
    spike = Anomaly(kind="spike", metric="loss", step=10, score=9.0, severity=Severity.ERROR, detector="z",
                    evidence=((8, 1.0), (9, 1.0), (10, 5.0)))
    (first,) = engine.process(StepRecord(10, {"loss": 5.0}), [spike])
    assert isinstance(first, Decision) and first.action == "diagnose"
    # a lone spike: its onset is the update before it (step 9), not the first step of its evidence
    assert (first.params["onset_step"], first.params["step"], first.params["metric"]) == (9, 10, "loss")
    engine.applied(first, InterventionRecord(decision_id=first.id, step=11, action="diagnose", before={},
                                             after={"verdict": verdict, "summary": "why"}))
    out = engine.process(StepRecord(11, {"loss": 5.0}), [])
    outcome = next(e for e in out if isinstance(e, Outcome))
    nxt = next(e for e in out if isinstance(e, Decision))
    assert (nxt.rule, nxt.action, nxt.incident_id) == (rule, action, first.incident_id)
    if verdict == "inconclusive":  # no verdict: the diagnose rung failed, its own next rung follows
        assert outcome.evidence["error"].startswith("no verdict")
    else:
        assert outcome.evidence == {"diagnosis": verdict, "next_rule": rule}
    if verdict == "hardware_suspect":
        assert nxt.params["exit_code"] == 88


@pytest.mark.parametrize(("verdict", "cleared"), [("data", 25), ("hardware_suspect", 25), ("state", None),
                                                  ("inconclusive", None)])
def test_a_restart_lands_at_the_checkpoint_a_diagnosis_cleared_unless_it_blamed_the_state(
        verdict: str, cleared: int | None) -> None:
    """A diagnosis that blames the data or the execution found its checkpoint's state good: a restart goes back no
    further than that (here the checkpoint of step 25 for a trend whose evidence starts at step 9). A ``state``
    verdict clears nothing (that state is on its way to the trouble), nor does no verdict; the LR cap is still a
    fraction of the LR at the incident's onset."""
    from stabmon.events import Anomaly, Decision, Severity, StepRecord
    from stabmon.runbook import Engine, load_runbook

    engine = Engine(load_runbook("default"), id_seed="t")
    for s in range(30):
        engine.process(StepRecord(s, {"loss": 2.0, "lr": 0.001 * (s + 1)}), [])
    trend = Anomaly(kind="regression", metric="loss", step=30, score=9.0, severity=Severity.ERROR, detector="r",
                    evidence=tuple((s, 2.0 + s / 10) for s in range(9, 31)))
    out = engine.process(StepRecord(30, {"loss": 5.0, "lr": 0.031}), [trend])
    first = next(e for e in out if isinstance(e, Decision))
    if first.action == "scale_layer_lr":  # no layer is out of line: not applicable, the diagnosis follows
        engine.applied(first, InterventionRecord(decision_id=first.id, step=30, action="scale_layer_lr", before={},
                                                 after={}, not_applied="no layer is flagged"))
        first = next(e for e in engine.settle(StepRecord(30, {"loss": 5.0})) if isinstance(e, Decision))
    assert first.action == "diagnose" and first.params["onset_step"] == 9
    engine.applied(first, InterventionRecord(decision_id=first.id, step=30, action="diagnose", before={},
                                             after={"verdict": verdict, "summary": "why", "checkpoint_step": 25}))
    restart = next(e for e in engine.process(StepRecord(31, {"loss": 5.0}), []) if isinstance(e, Decision))
    assert restart.action == "rollback" and restart.params["onset_step"] == 9  # the incident's onset, as it was
    assert restart.params.get("cleared_step") == cleared
    if cleared is not None:  # the rollback goes back to the cleared checkpoint, not to the one before the onset
        from stabmon.interventions.handle import Handle
        from stabmon.interventions.rollback import Rollback
        from stabmon.overrides import Overrides

        asked = []
        handle = Handle(Overrides(), clock=lambda: 31, hparams=lambda: {},
                        rollback=lambda **kw: asked.append(kw) or {"restored_step": 25, "from_step": 31})
        Rollback(handle, restart.params, decision_id=restart.id).apply()
        assert asked[0]["onset_step"] == 25 and asked[0]["lookback"] == 0
    if "lr_cap" in restart.params:
        assert restart.params["onset_lr"] == pytest.approx(0.009)  # the LR in force before the onset's update


# -- replay: no model, no verdict ---------------------------------------------------------------------------------
def test_a_replay_does_not_diagnose_and_says_so() -> None:
    """A replay cannot re-run steps: its diagnose rung records why, makes up no verdict, and the rule's next rung
    follows; the replay's summary lists the step."""
    from stabmon.events import Decision, StepRecord
    from stabmon.replay.replay import replay, simulated_pipeline

    records = []
    for s in range(400):
        loss = 3.0 + 2.0 * math.exp(-s / 80) + 0.01 * math.sin(s * 0.7) + (3.0 if 300 <= s < 304 else 0.0)
        grad = 0.5 * (20.0 if 299 <= s < 304 else 1.0)  # the grad norm leads, the loss follows and stays up
        records.append(StepRecord(step=s, metrics={"loss": loss, "grad_norm": grad, "lr": 3e-4}))
    pipeline, target = simulated_pipeline(runbook="diagnose-first", mode="apply", target=None)
    result = replay(records, pipeline=pipeline, target=target)
    (d,) = [e for e in result.events if isinstance(e, InterventionRecord) and e.action == "diagnose"]
    assert d.after["verdict"] == "inconclusive" and d.after["not_run"] == "replay"
    assert "no model" in d.after["summary"] and "rerun" not in d.after and "replay" not in d.after
    assert target.summary()["not_diagnosed"] == [d.step]
    later = [e for e in result.events[result.events.index(d):] if isinstance(e, Decision)]
    assert later and later[0].rule == "instability" and later[0].rung == 1  # the diagnose rule's next rung
