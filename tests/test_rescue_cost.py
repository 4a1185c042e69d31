"""What a rescue costs (issue: roll back steps, not hundreds; act at the first sign; never meet the same fault
twice), on real loops driven through the ``default`` runbook:

- the first sign: a gradient norm 100x its running median (an injected fault) is answered at once with the
  reversible skip guard (rule ``first_sign``), and the healthy twin of the run gets nothing;
- a fault met before: once a capped rollback remembered the steps that broke down, the cap is in force from the
  first of those steps whenever the run is there again (after a later rollback, after a resume) and lifted after
  them;
- a loop that hands no batches: the restart that could only skip them is dropped, so the first restart that runs
  changes something.
"""

from __future__ import annotations

import os
import sqlite3
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from stabmon.collect.config import MonitorConfig, SnapshotConfig
from stabmon.interventions.rollback import Rollback
from stabmon.monitor import Monitor
from stabmon.runbook import load_runbook
from stabmon.runbook.fit import unfit_rungs

SEED = int(os.environ.get("STABMON_TEST_SEED", "0"))
THREADS = int(os.environ.get("STABMON_TEST_THREADS", "0"))


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    if THREADS:
        torch.set_num_threads(THREADS)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed + 1)
    data = [torch.randn(32, 8, generator=g) for _ in range(400)]
    return model, opt, data


def decisions(db: Path) -> list[tuple[str, str, str]]:
    with sqlite3.connect(db) as conn:
        return conn.execute("select rule, action, status from decisions order by step").fetchall()


def run_with_grad_spike(tmp_path: Path, *, spike_at: int | None, steps: int = 240) -> Path:
    """A regression loop on the default runbook; at ``spike_at`` the gradients are scaled after backward so that
    their norm is 100x the median of the last 16 steps' (a bad batch's gradient, by construction, whatever the
    seed's own noise). Returns the store's file."""
    model, opt, data = _model(SEED)
    target = torch.nn.Linear(8, 1)
    db = tmp_path / "run.db"
    mon = Monitor(model, opt, store=f"sqlite:///{db}", runbook="default", mode="apply",
                  checkpoint_dir=str(tmp_path / "ckpt"),
                  config=MonitorConfig(flush_every=10, clip=1.0, hang_timeout=None, checkpoint_every=50))
    norms: list[float] = []
    try:
        for step, x in mon.steps(data[:steps]):
            with torch.no_grad():
                y = target(x)
            loss = torch.nn.functional.mse_loss(model(x), y)
            mon.observe(loss=loss)
            loss.backward()
            norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
            if step == spike_at:
                factor = 100.0 * statistics.median(norms[-16:]) / norm
                for p in model.parameters():
                    p.grad.mul_(factor)
            norms.append(norm)
            opt.step()
            opt.zero_grad()
    finally:
        mon.close()
    return db


def test_the_first_sign_a_100x_gradient_is_answered_at_once_and_the_healthy_twin_is_left_alone(tmp_path: Path
                                                                                              ) -> None:
    healthy = run_with_grad_spike(tmp_path / "healthy", spike_at=None)
    assert [d for d in decisions(healthy) if d[1] not in ("alert_only",)] == []  # no change on the healthy twin
    faulty = run_with_grad_spike(tmp_path / "spike", spike_at=150)
    made = decisions(faulty)
    first = [d for d in made if d[0] == "first_sign"]
    assert first and first[0][1:] == ("skip_step", "apply"), made
    with sqlite3.connect(faulty) as conn:
        done = [a for (a,) in conn.execute("select action from interventions order by step")]
    assert done[0] == "skip_step", done  # applied: the guard was on from the next step
    # it was given back: by its own release after a quiet window, or by a rule that acted on damage
    assert any(d[1] in ("release", "revert") for d in made if d[0] == "first_sign"), made


def test_a_first_sign_needs_a_large_gradient_not_any_warning() -> None:
    from stabmon.events import Anomaly, Severity

    rule = load_runbook("default").rule("first_sign")
    calm = tuple((s, 1.0 + 0.05 * (s % 3)) for s in range(15))
    big = Anomaly("spike", "grad_norm", 15, 30.0, Severity.WARNING, "spike", evidence=(*calm, (15, 100.0)))
    small = Anomaly("spike", "grad_norm", 15, 30.0, Severity.WARNING, "spike", evidence=(*calm, (15, 20.0)))
    loss = Anomaly("spike", "loss", 15, 30.0, Severity.WARNING, "spike", evidence=(*calm, (15, 100.0)))
    short = Anomaly("spike", "grad_norm", 3, 30.0, Severity.WARNING, "spike", evidence=(*calm[:3], (3, 100.0)))
    assert rule.when.matches(big)
    assert not rule.when.matches(small) and not rule.when.matches(loss) and not rule.when.matches(short)


class Schedule:
    """Constant LR with a fault in the schedule: x100 at steps [40, 50), every time the run gets there."""

    def __init__(self, opt: torch.optim.Optimizer, base: float) -> None:
        self.opt, self.base, self.last_used = opt, base, float("nan")

    def watch(self) -> None:
        """Read the LR each update uses: a pre-step hook registered after the monitor's, which writes the
        effective values (overrides applied) into the param groups."""
        self.opt.register_step_pre_hook(lambda o, a, k: setattr(self, "last_used", float(o.param_groups[0]["lr"])))

    def set(self, step: int) -> float:
        lr = self.base * (100.0 if 40 <= step < 50 else 1.0)
        for group in self.opt.param_groups:
            group["lr"] = lr
        return lr


def _loop(mon: Monitor, sched: Schedule, data: list[torch.Tensor], until: int, used: dict[int, float]) -> None:
    """Train until step ``until``, recording the LR each optimizer step really used."""
    model, opt = mon.model, mon.optimizer
    while mon.step < until:
        step = mon.step
        sched.set(step)
        mon.begin_step()
        model(data[step % len(data)]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        mon.observe(loss=torch.tensor(1.0))
        mon.end_step()
        used[step] = sched.last_used


def test_a_remembered_fault_has_its_cap_in_force_before_it_recurs_and_lifted_after(tmp_path: Path,
                                                                                   caplog: Any) -> None:
    model, opt, data = _model(SEED)
    sched = Schedule(opt, base=1e-2)
    config = MonitorConfig(flush_every=10, hang_timeout=None, checkpoint_every=100,
                           snapshots=SnapshotConfig(every=10, keep=10))
    mon = Monitor(model, opt, store=None, detectors=False, checkpoint_dir=str(tmp_path / "ckpt"), config=config)
    sched.watch()
    used: dict[int, float] = {}
    try:
        _loop(mon, sched, data, 50, used)
        assert used[45] == pytest.approx(1.0)  # the fault, met the first time
        # the runbook's capped restart, as the engine issues it (onset 40, the LR at the onset 1e-2)
        rb = Rollback(mon.handle, {"onset_step": 40, "lookback": 0, "lr_cap": 0.5, "onset_lr": 1e-2},
                      decision_id="d")
        record = rb.apply()
        assert record.after["remembered"] == [40, 50] and mon.step == 40
        rb.release(decision_id="r", steps=0)  # resolved, given back: the cap lifts once the schedule is <= 1e-2
        used.clear()
        _loop(mon, sched, data, 80, used)
        assert all(used[s] == pytest.approx(5e-3) for s in range(40, 50))  # the fault's steps: capped
        said = [r.getMessage() for r in caplog.records if "broke down before" in r.getMessage()]
        assert said == ["stabmon: steps 40-49 broke down before; the learning rate is capped at 0.005 until step 50"]
        assert mon.overrides.lr_cap is None  # the standing cap was lifted (the schedule fell back to 1e-2)
        assert all(used[s] == pytest.approx(1e-2) for s in range(50, 80))  # after the range: the schedule's own
        # a later rollback to before the range: the fix is in force again before the fault recurs
        mon.rollback(onset_step=30, lookback=0, skip_batches=0)
        assert mon.step == 30
        used.clear()
        _loop(mon, sched, data, 35, used)
        state = mon.state_dict()  # a checkpoint at step 35, before the range, on the new timeline
        _loop(mon, sched, data, 60, used)
        assert all(used[s] == pytest.approx(1e-2) for s in range(30, 40))
        assert all(used[s] == pytest.approx(5e-3) for s in range(40, 50))
        assert all(used[s] == pytest.approx(1e-2) for s in range(50, 60))
    finally:
        mon.close()
    # the process dies; the next one resumes from the checkpoint at 35 and caps the range too
    model2, opt2, _ = _model(SEED)
    sched2 = Schedule(opt2, base=1e-2)
    mon2 = Monitor(model2, opt2, store=None, detectors=False, checkpoint_dir=str(tmp_path / "ckpt2"),
                   config=MonitorConfig(flush_every=10, hang_timeout=None, checkpoint_every=0), resume=state)
    sched2.watch()
    try:
        assert mon2.step == 35
        assert mon2.overrides.remembered == [{"start": 40, "end": 50, "lr_cap": pytest.approx(5e-3)}]
        used2: dict[int, float] = {}
        _loop(mon2, sched2, data, 55, used2)
        assert [round(used2[s], 6) for s in (39, 40, 49, 50)] == [1e-2, 5e-3, 5e-3, 1e-2]
    finally:
        mon2.close()


def test_a_failed_capped_restart_forgets_its_range(tmp_path: Path) -> None:
    model, opt, data = _model(SEED)
    mon = Monitor(model, opt, store=None, detectors=False, checkpoint_dir=str(tmp_path / "ckpt"),
                  config=MonitorConfig(flush_every=10, hang_timeout=None, checkpoint_every=10))
    try:
        sched = Schedule(opt, base=1e-2)
        _loop(mon, sched, data, 50, {})
        rb = Rollback(mon.handle, {"onset_step": 40, "lookback": 0, "lr_cap": 0.5, "onset_lr": 1e-2},
                      decision_id="d")
        rb.apply()
        assert mon.overrides.remembered
        record = rb.revert(decision_id="r")
        assert record.after["forgot"] == [40, 50] and mon.overrides.remembered == []
        assert mon.overrides.lr_cap is None and mon.overrides.range_cap is None
    finally:
        mon.close()


def test_without_batches_the_restart_that_only_skips_them_is_dropped_and_the_capped_one_runs_first() -> None:
    rb = load_runbook("default")
    dropped = unfit_rungs(rb, batches=False)
    instability = rb.rule("instability")
    first_restart = next(i for i, rung in enumerate(instability.ladder)
                         if rung.action == "rollback" and ("instability", i) not in dropped)
    assert instability.ladder[first_restart].params.lr_cap == 0.5
    assert ("loss_scale", 0) not in dropped  # the ladder's only restart stays (a plain restart, without batches)
    assert not any(k for k in unfit_rungs(rb, batches=True) if "skips batches" in unfit_rungs(rb, batches=True)[k])


def _args(extra: list[str]) -> list[str]:
    return ["--max-iters", "360", "--eval-interval", "100", "--lr-jump-at", "300", "--lr-jump-iters", "20",
            "--lr-jump-factor", "100", "--lr-jump-in-schedule", "--no-step-time", "--threads", str(THREADS or 1),
            "--seed", str(1337 + SEED), *extra]


def test_nanogpt_shaped_a_fault_in_the_schedule_costs_one_rollback_to_a_snapshot(
        tmp_path: Path, capsys: Any, caplog: Any) -> None:
    """The issue's case, shortened: LR x100 for 20 iterations at 300, in the schedule (a rollback replays it),
    checkpoints every 100, snapshots every 10. One rollback, to a snapshot after the disk checkpoint at 300's
    predecessor, with the cap in force when the run gets to 300 again: no second meeting."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import nanogpt_style

    db = tmp_path / "s.db"
    assert nanogpt_style.main(_args(["--out-dir", str(tmp_path / "o"), "--db", f"sqlite:///{db}",
                                     "--snapshots", "10"])) == 0
    out = capsys.readouterr().out
    rollbacks = [r.getMessage() for r in caplog.records if "rolled back from step" in r.getMessage()]
    assert len(rollbacks) == 1 and "memory://snapshot-" in rollbacks[0], out
    trained = int(out.rsplit(" steps trained", 1)[0].rsplit(" ", 1)[1])
    assert trained - 360 <= 60, out  # steps wasted


@pytest.mark.parametrize(("rule", "expected"), [
    ("{name: r, when: {ratio: 0.5}, ladder: [{action: alert_only}]}", "rules[0].when.ratio"),
    ("{name: r, when: {ratio: big}, ladder: [{action: alert_only}]}", "rules[0].when.ratio"),
    ("{name: r, yields: maybe, ladder: [{action: alert_only}]}", "rules[0].yields"),
])
def test_a_bad_ratio_or_yields_is_one_line_naming_where(rule: str, expected: str) -> None:
    from stabmon.runbook import loads_runbook

    with pytest.raises(ValueError) as info:
        loads_runbook(f"name: bad\nrules:\n  - {rule}\n")
    assert expected in str(info.value) and "\n" not in str(info.value).strip()


@pytest.mark.parametrize("known", [{"start": 5, "end": 5, "lr_cap": 1e-3}, {"start": 0, "end": 9, "lr_cap": 0},
                                   {"start": "a", "end": 9, "lr_cap": 1e-3}])
def test_a_bad_remembered_range_in_a_saved_state_is_refused_in_one_line(known: dict[str, Any]) -> None:
    from stabmon.overrides import Overrides

    with pytest.raises(ValueError, match=r"^overrides\.remembered\[0\]: expected start < end"):
        Overrides().load_state_dict({"remembered": [known]})


def _engine_with_first_sign(damage: str = "{action: set_clip, params: {max_norm: 0.5}, observe: 5}",
                            observe: int = 5) -> Any:
    from stabmon.runbook import loads_runbook
    from stabmon.runbook.engine import Engine

    rb = loads_runbook(f"""
name: first-sign
cooldown: 0
rules:
  - name: damage
    when: {{kind: spike, metric: loss, severity: error}}
    ladder: [{damage}]
  - name: first_sign
    when: {{kind: spike, metric: grad_norm, severity: warning, ratio: 50}}
    yields: true
    ladder: [{{action: skip_step, params: {{factor: 5.0}}, observe: {observe}, success: {{quiet_steps: {observe}}}}}]
""")
    return Engine(rb, id_seed="t")


def _anomaly(metric: str, step: int, severity: Any) -> Any:
    from stabmon.events import Anomaly

    calm = tuple((s, 1.0) for s in range(step - 12, step))
    return Anomaly("spike", metric, step, 30.0, severity, "spike", evidence=(*calm, (step, 100.0)))


class _Applied:
    """What the executor tells the engine after applying a decision (a record with its id)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.n = engine, 0

    def __call__(self, produced: list[Any]) -> list[Any]:
        from stabmon.events import Decision, InterventionRecord

        for d in produced:
            if isinstance(d, Decision) and d.status.value == "apply" and d.action not in ("revert",):
                self.n += 1
                self.engine.applied(d, InterventionRecord(step=d.step, action=d.action, decision_id=d.id,
                                                          before={}, after={"ok": 1}, id=f"iv{self.n}"))
        return produced


def test_a_first_sign_gives_its_change_back_when_a_rule_that_acts_takes_over() -> None:
    from stabmon.events import Severity, StepRecord

    engine = _engine_with_first_sign()
    told = _Applied(engine)
    out = told(engine.process(StepRecord(20, {"loss": 1.0}), [_anomaly("grad_norm", 20, Severity.WARNING)]))
    assert [(d.rule, d.action) for d in out] == [("first_sign", "skip_step")]
    out = told(engine.process(StepRecord(21, {"loss": 5.0}), [_anomaly("loss", 21, Severity.ERROR)]))
    kinds = [(type(e).__name__, getattr(e, "action", getattr(e, "verdict", None))) for e in out]
    assert kinds[0][0] == "Outcome" and out[0].verdict.value == "superseded"
    assert [(d.rule, d.action) for d in out[1:]] == [("first_sign", "revert"), ("damage", "set_clip")]
    assert out[1].params["intervention_id"] == "iv1"


def test_a_released_first_sign_is_not_reverted_again() -> None:
    from stabmon.events import Severity, StepRecord

    engine = _engine_with_first_sign()
    told = _Applied(engine)
    told(engine.process(StepRecord(20, {"loss": 1.0}), [_anomaly("grad_norm", 20, Severity.WARNING)]))
    actions = []
    for step in range(21, 28):  # quiet: resolved, then released
        actions += [getattr(e, "action", None) for e in told(engine.process(StepRecord(step, {"loss": 1.0}), []))]
    assert "release" in actions
    out = told(engine.process(StepRecord(28, {"loss": 5.0}), [_anomaly("loss", 28, Severity.ERROR)]))
    assert [(d.rule, d.action) for d in out[1:]] == [("damage", "set_clip")]  # nothing left to revert


# -- the onset: where a rollback lands ---------------------------------------------------------------------------
_ROLLBACK_ON = """
name: onsets
cooldown: 0
rules:
  - name: r
    when: {{kind: {kind}, severity: error}}
    ladder: [{{action: rollback, params: {{lookback: 0, lr_cap: 0.5}}, observe: 5}}]
"""


def _onset_engine(kind: str) -> Any:
    from stabmon.runbook import loads_runbook
    from stabmon.runbook.engine import Engine

    return Engine(loads_runbook(_ROLLBACK_ON.format(kind=kind)), id_seed="o")


def _point(kind: str, step: int, severity: Any) -> Any:
    from stabmon.events import Anomaly

    window = tuple((s, 2.0) for s in range(step - 15, step + 1))
    return Anomaly(kind, "loss", step, 1.0, severity, kind, evidence=window)


def _feed(engine: Any, steps: range, anomalies: dict[int, Any], lr: Any = lambda s: 1e-3) -> list[Any]:
    from stabmon.events import Decision, StepRecord

    out = []
    for s in steps:
        found = anomalies.get(s)
        out += engine.process(StepRecord(s, {"loss": 2.0, "lr": lr(s)}), [found] if found else [])
    return [d for d in out if isinstance(d, Decision)]


def test_a_nan_rollback_lands_before_the_update_ahead_of_the_first_nan() -> None:
    """NaN warnings at 40 and 41, critical at 42: the trouble began with the update of step 39, not 16 records
    before the critical one (where the evidence window starts)."""
    from stabmon.events import Severity

    engine = _onset_engine("nonfinite")
    found = {40: _point("nonfinite", 40, Severity.WARNING), 41: _point("nonfinite", 41, Severity.WARNING),
             42: _point("nonfinite", 42, Severity.CRITICAL)}
    (rollback,) = _feed(engine, range(1, 45), found)
    assert rollback.step == 42 and rollback.params["onset_step"] == 39


def test_signs_further_apart_than_the_gap_are_two_episodes_and_a_trend_keeps_its_evidence() -> None:
    from stabmon.events import Severity

    engine = _onset_engine("spike")
    found = {10: _point("spike", 10, Severity.WARNING), 40: _point("spike", 40, Severity.ERROR)}
    (rollback,) = _feed(engine, range(1, 45), found)
    assert rollback.params["onset_step"] == 39  # the warning 30 steps earlier was another episode
    # a loss scale that fell to its floor is reported once it is there: its evidence reaches back to the fall
    engine = _onset_engine("loss_scale_collapse")
    (rollback,) = _feed(engine, range(1, 45), {40: _point("loss_scale_collapse", 40, Severity.CRITICAL)})
    assert rollback.params["onset_step"] == 25


def test_the_cap_is_half_the_lr_before_the_onsets_update_and_the_signs_survive_a_resume() -> None:
    """The learning rate jumps x100 at step 30 (its update is the trouble): the cap is half the LR before it."""
    from stabmon.events import Severity
    from stabmon.runbook.engine import Engine

    lr = lambda s: 1e-3 if s < 30 else 0.1  # noqa: E731
    engine = _onset_engine("spike")
    _feed(engine, range(1, 32), {31: _point("spike", 31, Severity.WARNING)}, lr)
    resumed = Engine(engine.runbook, id_seed="o")
    resumed.load_state_dict(engine.state_dict())  # a resume between the first sign and the error
    (rollback,) = _feed(resumed, range(32, 36), {33: _point("spike", 33, Severity.ERROR)}, lr)
    assert rollback.params["onset_step"] == 30
    assert rollback.params["onset_lr"] == pytest.approx(1e-3)


def test_a_superseded_first_sign_carries_its_onset_to_the_incident_that_acts() -> None:
    """The first sign at step 20 (a grad spike) and the damage 25 steps later, past the gap that links signs:
    the rollback still lands before the first sign, because the first sign's incident was still open."""
    from stabmon.events import Decision, Severity, StepRecord

    engine = _engine_with_first_sign("{action: rollback, params: {lookback: 0}, observe: 5}", observe=40)
    told = _Applied(engine)
    told(engine.process(StepRecord(20, {"loss": 1.0}), [_anomaly("grad_norm", 20, Severity.WARNING)]))
    for s in range(21, 45):
        told(engine.process(StepRecord(s, {"loss": 1.0}), []))
    out = told(engine.process(StepRecord(45, {"loss": 5.0}), [_anomaly("loss", 45, Severity.ERROR)]))
    (rollback,) = [d for d in out if isinstance(d, Decision) and d.rule == "damage"]
    assert rollback.action == "rollback" and rollback.params["onset_step"] == 19


@pytest.mark.parametrize(("first", "baseline"), [(4, None), (3, 2.0)])
def test_a_baseline_needs_five_losses_before_the_onset(first: int, baseline: float | None) -> None:
    """A loss logged every 10 steps, a spike at step 80: with four records before its onset (one, at step 10, in
    the real DPO record that showed it) a median is no baseline to judge "loss back within 10%" by; five are."""
    from stabmon.events import InterventionRecord, Outcome, Severity, StepRecord
    from stabmon.runbook import loads_runbook
    from stabmon.runbook.engine import Engine

    engine = Engine(loads_runbook("""
name: baseline
cooldown: 0
rules:
  - name: r
    when: {kind: spike, severity: error}
    ladder: [{action: scale_lr, params: {factor: 0.5}, observe: 3, success: {quiet_steps: 3, loss_within: 0.1}}]
"""), id_seed="b")
    out = []
    for s in range(first * 10, 200, 10):
        found = [_point("spike", s, Severity.ERROR)] if s == 80 else []
        produced = engine.process(StepRecord(s, {"loss": 2.0 if s < 80 else 2.1, "lr": 1e-3}), found)
        for d in produced:
            if type(d).__name__ == "Decision" and d.action == "scale_lr":
                engine.applied(d, InterventionRecord(decision_id=d.id, step=d.step, action=d.action, before={},
                                                     after={}, id="iv"))
        out += produced
    (judged,) = [o for o in out if isinstance(o, Outcome)]
    assert judged.evidence.get("loss_baseline") == baseline


_TREND_AFTER_SIGN = """
name: trend-after-sign
cooldown: 0
rules:
  - name: damage
    when: {{kind: regression, metric: loss, severity: error}}
    ladder: [{{action: rollback, params: {{lookback: 0}}, observe: 5}}]
  - name: {first}
    when: {{kind: spike, metric: grad_norm, severity: warning{ratio}}}
    {yields}
    ladder: [{ladder}]
"""


@pytest.mark.parametrize(("yields", "onset"), [(True, 59), (False, 35)])
def test_a_trend_that_shows_a_first_signs_damage_starts_at_the_sign(yields: bool, onset: int) -> None:
    """A 5,000x gradient norm at step 60 (the first sign), then a regression whose evidence window starts at 35:
    the rollback lands before the sign, not 25 steps further back where the window happens to begin. A superseded
    alert (no first-sign rule) says nothing of where the trend began: its evidence stands."""
    from stabmon.events import Anomaly, Decision, Severity, StepRecord
    from stabmon.runbook import loads_runbook
    from stabmon.runbook.engine import Engine

    text = _TREND_AFTER_SIGN.format(
        first="first_sign" if yields else "other", ratio=", ratio: 50" if yields else "",
        yields="yields: true" if yields else "",
        ladder="{action: skip_step, params: {factor: 5.0}, observe: 40, success: {quiet_steps: 40}}" if yields
        else "{action: alert_only, observe: 40}")
    engine = Engine(loads_runbook(text), id_seed="s")
    told = _Applied(engine)
    for s in range(1, 82):
        told(engine.process(StepRecord(s, {"loss": 2.0}), [_anomaly("grad_norm", 60, Severity.WARNING)]
                            if s == 60 else []))
    trend = Anomaly("regression", "loss", 82, 1.4, Severity.ERROR, "regression",
                    evidence=tuple((s, 2.0 if s < 60 else 2.5) for s in range(35, 83)))
    out = told(engine.process(StepRecord(82, {"loss": 2.5}), [trend]))
    (rollback,) = [d for d in out if isinstance(d, Decision) and d.action == "rollback"]
    assert rollback.params["onset_step"] == onset
