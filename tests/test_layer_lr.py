"""One layer's learning rate, wrong for it: the ``out_of_line`` detector (update ratios across layers), the
``scale_layer_lr`` rung (cut the LR of that layer's param groups only, in place), per-group overrides and a cap
that keeps each group's ratio. The real-process case trains the ``output-logit-divergence`` scenario under the
shipped runbooks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from pipeline_support import PlannedReports
from torch import nn

from stabmon.cli.demo import load_example
from stabmon.detect import OutOfLine
from stabmon.detect.rules import OutOfLineConfig
from stabmon.events import Anomaly, Decision, DecisionStatus, Severity, StepRecord
from stabmon.factory import resolve_engine
from stabmon.interventions import Executor
from stabmon.interventions.scale_layer_lr import ScaleLayerLr
from stabmon.monitor import Monitor, MonitorConfig
from stabmon.overrides import Overrides
from stabmon.pipeline import Pipeline
from stabmon.replay.simulate import Simulation
from stabmon.runbook.trace import build_trace, format_trace

LAYERS = {"update_ratio/h.0": 0.003, "update_ratio/h.1": 0.004, "update_ratio/ln_f": 0.005, "update_ratio/wte": 0.002}


class Head(nn.Module):
    """A body and an output layer, the output layer in a param group of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def build(head_lr: float = 1.0, **cfg: Any) -> tuple[Head, torch.optim.Optimizer, Monitor]:
    torch.manual_seed(0)
    model = Head()
    opt = torch.optim.AdamW([{"params": model.body.parameters()},
                             {"params": model.head.parameters(), "lr": 1e-3 * head_lr}], lr=1e-3)
    mon = Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(hang_timeout=None, **cfg))
    return model, opt, mon


def train(model: Head, opt: torch.optim.Optimizer, mon: Monitor, steps: int) -> list[list[float]]:
    """Train ``steps`` steps; the learning rate each param group stepped with."""
    gen = torch.Generator().manual_seed(1)
    used: list[list[float]] = []
    hook = opt.register_step_pre_hook(lambda o, *_: used.append([g["lr"] for g in o.param_groups]))
    for _ in range(steps):
        mon.begin_step()
        loss = nn.functional.cross_entropy(model(torch.randn(16, 8, generator=gen)),
                                           torch.randint(0, 4, (16,), generator=gen))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.end_step()
    hook.remove()
    return used


def decide(action: str, params: dict[str, Any], step: int = 10, anomaly_id: str | None = None) -> Decision:
    return Decision(step=step, action=action, params=params, status=DecisionStatus.APPLY, runbook="rb", rule="r",
                    rung=0, reason="test", anomaly_id=anomaly_id)


def out_of_line(metric: str, step: int) -> Anomaly:
    return Anomaly(kind="out_of_line", metric=metric, step=step, score=5.0, severity=Severity.WARNING,
                   detector="out_of_line", evidence=((step, 0.5),))


# -- the detector -------------------------------------------------------------------------------------------
def test_out_of_line_flags_the_one_layer_far_above_the_median_as_a_warning_only() -> None:
    d = OutOfLine("update_ratio/lm_head")
    quiet = [d.update(s, {**LAYERS, "update_ratio/lm_head": 0.006}) for s in range(5)]
    assert quiet == [None] * 5
    found = [d.update(s, {**LAYERS, "update_ratio/lm_head": 0.5}) for s in range(5, 15)]
    assert all(a is not None and a.severity is Severity.WARNING for a in found)  # never an error, however long
    assert "lm_head is 0.5, 125x the median of its family" in found[0].message
    # every layer moving 100x faster together is not one layer out of line
    assert d.update(20, {k: v * 100 for k, v in {**LAYERS, "update_ratio/lm_head": 0.006}.items()}) is None


def test_out_of_line_needs_enough_layers_and_ignores_zero_and_non_finite_values() -> None:
    d = OutOfLine("update_ratio/lm_head", OutOfLineConfig(min_layers=5))
    assert d.update(0, {"update_ratio/h.0": 0.001, "update_ratio/lm_head": 1.0}) is None
    d = OutOfLine("update_ratio/lm_head")
    assert d.update(0, {**LAYERS, "update_ratio/lm_head": float("nan")}) is None
    assert d.update(1, {**LAYERS, "update_ratio/lm_head": 0.0}) is None
    from stabmon.detect.config import build

    with pytest.raises(ValueError, match=r"^detector.out_of_line.factor must be > 1, got 1.0$"):
        build(OutOfLineConfig, {"factor": 1.0}, "detector.out_of_line")


def test_a_layer_that_moved_from_zero_is_judged_from_its_first_record_in_line() -> None:
    # LoRA's B, a zero-initialised head: inf on its first step (no ratio), then ~1/k whatever its LR
    d = OutOfLine("update_ratio/lm_head")
    median = 0.004  # the median of LAYERS with the head among them
    growing = [float("inf"), 250 * median, 40 * median, 21 * median]
    assert [d.update(s, {**LAYERS, "update_ratio/lm_head": v}) for s, v in enumerate(growing)] == [None] * 4
    assert d.update(4, {**LAYERS, "update_ratio/lm_head": 10 * median}) is None  # in line: judged from now on
    late = d.update(5, {**LAYERS, "update_ratio/lm_head": 30 * median})
    assert late is not None and late.severity is Severity.WARNING
    restored = OutOfLine("update_ratio/lm_head")  # the state survives a checkpoint of the suite
    d2 = OutOfLine("update_ratio/lm_head")
    d2.update(0, {**LAYERS, "update_ratio/lm_head": float("inf")})
    restored.load_state_dict(d2.state_dict())
    assert restored.update(1, {**LAYERS, "update_ratio/lm_head": 40 * median}) is None


def test_the_default_suite_watches_every_layers_update_ratio() -> None:
    from stabmon.detect.suite import DetectorSuite

    suite = DetectorSuite()
    found = suite.update(StepRecord(step=0, metrics={"loss": 2.7, **LAYERS, "update_ratio/lm_head": 1.0}))
    assert [(a.kind, a.metric) for a in found] == [("out_of_line", "update_ratio/lm_head")]


# -- overrides ----------------------------------------------------------------------------------------------
def test_a_cap_keeps_each_groups_ratio_and_a_layer_cut_scales_its_group_only() -> None:
    model, opt, mon = build(head_lr=10.0)
    mon.overrides.lr_cap = 5e-4
    used = train(model, opt, mon, 1)
    assert used[0] == pytest.approx([5e-4, 5e-3])  # the head keeps its 10x under the cap
    mon.overrides.lr_cap = None
    mon.overrides.layer_lr = {"1": {"factor": 0.01}}
    used = train(model, opt, mon, 1)
    assert used[0] == pytest.approx([1e-3, 1e-4])
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-3, 1e-2])  # the schedule's values restored
    mon.close()


def test_layer_cuts_survive_a_state_dict_round_trip_through_json_and_bad_ones_are_one_line_errors() -> None:
    o = Overrides(layer_lr={"1": {"factor": 0.1, "lift_below": 0.2, "ramp": 3, "done": 0}})
    back = Overrides()
    back.load_state_dict(json.loads(json.dumps(o.state_dict())))
    assert back == o and back.layer_lr is not o.layer_lr
    with pytest.raises(ValueError, match=r"^overrides.layer_lr\['x'\]: expected a param group index"):
        Overrides(layer_lr={"x": {"factor": 0.1}})
    with pytest.raises(ValueError, match="factor in"):
        Overrides(layer_lr={"0": {"factor": 2.0}})


def test_a_released_cut_holds_until_the_schedule_is_low_then_re_warms() -> None:
    o = Overrides(layer_lr={"1": {"factor": 0.1, "lift_below": 0.5, "ramp": 4, "done": 0}})
    factors = []
    for lr in (5.0, 2.0, 0.5, 0.4, 0.3, 0.2, 0.1):
        o.settle_layers([1e-3, lr])
        factors.append(round(o.layer_factor(1), 4))
    assert factors == [0.1, 0.1, 0.1778, 0.3162, 0.5623, 1.0, 1.0] and o.layer_lr == {}


def test_the_effective_lr_a_framework_logs_is_each_groups_own() -> None:
    from stabmon.integrations._shared import EffectiveLR

    opt = torch.optim.SGD([{"params": [nn.Parameter(torch.ones(1))]},
                           {"params": [nn.Parameter(torch.ones(1))], "lr": 1.0}], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    o = Overrides(lr_cap=0.05, layer_lr={"1": {"factor": 0.1}})
    patch = EffectiveLR(sched, lambda: o)
    patch.install()
    assert sched.get_last_lr() == pytest.approx([0.05, 0.1])
    patch.remove()


# -- the rung ----------------------------------------------------------------------------------------------
def test_scale_layer_lr_cuts_the_flagged_layers_group_reverts_and_releases() -> None:
    model, opt, mon = build(head_lr=100.0)
    train(model, opt, mon, 2)
    ex = Executor(mon.handle)
    rec = ex.execute(ex.with_evidence(decide("scale_layer_lr", {}), out_of_line("update_ratio/head", 1)))
    assert rec.after["groups"] == {"1": 0.1} and rec.before["lr"] == {"1": pytest.approx(0.1)}
    assert train(model, opt, mon, 1)[0] == pytest.approx([1e-3, 1e-2])
    ex.execute(decide("revert", {"intervention_id": rec.id}))
    assert mon.overrides.layer_lr == {} and train(model, opt, mon, 1)[0] == pytest.approx([1e-3, 0.1])
    rec = ex.execute(decide("scale_layer_lr", {"tensors": ["head"]}))
    release = ex.execute(decide("release", {"intervention_ids": [rec.id], "steps": 10}))
    assert release.after["lifted_below_lr"] == {"1": pytest.approx(0.01)}  # what the cut gave the group
    assert train(model, opt, mon, 1)[0] == pytest.approx([1e-3, 1e-2])  # held: the schedule is still at 0.1
    for group in opt.param_groups:  # the schedule comes down to what the cut gave: lifted, re-warmed over 10
        group["lr"] = 1e-3 if group is opt.param_groups[0] else 0.01
    used = train(model, opt, mon, 11)
    assert used[0][1] == pytest.approx(0.01 * 0.1 ** 0.9) and used[-1][1] == pytest.approx(0.01)
    assert mon.overrides.layer_lr == {}
    rec = ex.execute(decide("scale_layer_lr", {"tensors": ["head"]}))
    release = ex.execute(decide("release", {"intervention_ids": [rec.id], "steps": 10}))
    ex.execute(decide("reapply", {"intervention_id": release.id}))  # the trouble came back: the cut is back
    assert mon.overrides.layer_lr == {"1": {"factor": pytest.approx(0.1)}}
    mon.close()


def test_scale_layer_lr_without_evidence_or_on_a_shared_group_is_not_applicable() -> None:
    model, opt, mon = build()
    train(model, opt, mon, 1)
    ex = Executor(mon.handle)
    # a spike on a layer is no evidence that the layer's learning rate is wrong
    spike = Anomaly(kind="spike", metric="grad_norm/head", step=1, score=9.0, severity=Severity.ERROR, detector="t")
    rec = ex.execute(ex.with_evidence(decide("scale_layer_lr", {}), spike))
    assert rec.not_applied.startswith("not applicable: no layer is flagged")
    rec = ex.execute(decide("scale_layer_lr", {"tensors": ["body"]}))
    assert rec.not_applied == ("not applicable: body share(s) param group(s) 0 with 91% of the model's parameters: "
                               "a cut there is a global one (scale_lr)")
    rec = ex.execute(decide("scale_layer_lr", {"tensors": ["nope"]}))
    assert rec.not_applied == "not applicable: tensor 'nope' names no parameter or layer of the model"
    assert mon.overrides.layer_lr == {}
    with pytest.raises(ValueError, match="factor"):
        ScaleLayerLr(Simulation().handle, {"factor": 1.5}, decision_id="d")
    mon.close()


def test_the_pipeline_takes_the_layer_from_a_recent_out_of_line_report_only() -> None:
    def first_cut(plan: dict[int, list[Anomaly]]) -> tuple[Decision, Any]:
        target = Simulation()
        pipe = Pipeline(PlannedReports(plan), resolve_engine("default", None), Executor(target.handle, simulated=True))
        events = []
        for step in range(260):
            record = StepRecord(step=step, metrics={"loss": 2.0, "lr": 1e-3})
            target.begin_block([record])
            events += pipe.process(record)
        decision = next(e for e in events if isinstance(e, Decision) and e.action == "scale_layer_lr")
        trail.extend(format_trace(build_trace(events)))
        return decision, next(e for e in events if getattr(e, "decision_id", None) == decision.id)

    trail: list[str] = []

    regression = Anomaly(kind="regression", metric="loss", step=250, score=2.0, severity=Severity.ERROR, detector="t")
    decision, record = first_cut({200: [out_of_line("update_ratio/head", 200)], 250: [regression]})
    assert decision.params["metric"] == "update_ratio/head" and record.after["tensors"] == ["head"]
    decision, record = first_cut({100: [out_of_line("update_ratio/head", 100)], 250: [regression]})  # too old
    assert "metric" not in decision.params and record.not_applied.startswith("not applicable: no layer")
    # the trail says it was skipped, and the next rung (the diagnosis before a restart) was decided on the same
    # record (Engine.settle: a rung that changed nothing costs no record)
    assert any(line.startswith("  skipped      step") and "not applicable: no layer" in line for line in trail)
    after_skip = trail[trail.index(next(x for x in trail if x.startswith("  skipped"))):]
    nxt = next(e for e in after_skip if e.startswith("  decision"))
    assert "rung 2: diagnose(" in nxt and "[apply@250]" in nxt, trail


# -- real training -------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("runbook", ["default", "in-place-first"])
def test_output_logit_divergence_is_rescued_in_place_by_cutting_the_output_layers_lr(
    runbook: str, tmp_path: Path
) -> None:
    """The output layer at 3000x the LR: the runbook cuts that param group's LR, in place, and nothing else; no
    restart. Unmonitored every seed ends 23%+ above its healthy loss (docs/recovery.md)."""
    from stabmon.collect.config import UpdateConfig

    sc = load_example("scenarios")
    seed = 11
    scenario = sc.scenario("output-logit-divergence")
    config = scenario.config(seed)
    alone = sc.tiny_gpt.train(config)

    def factory(model: Any, opt: Any, sched: Any) -> Monitor:
        return Monitor(model, opt, scheduler=sched, store=None, runbook=runbook, mode="apply",
                       checkpoint_dir=str(tmp_path), run_name="output-logit",
                       config=MonitorConfig(clip=config.clip, checkpoint_every=25, hang_timeout=None,
                                            updates=UpdateConfig(every=10)))

    monitored = sc.tiny_gpt.train(config, monitor=factory)
    mon = monitored.monitor
    changes = [(e.action, e.after) for e in mon.events if type(e).__name__ == "InterventionRecord"
               and e.action not in ("alert_only",) and not e.not_applied]
    summary = f"alone {alone.val_loss:.3f}, monitored {monitored.val_loss:.3f}, changes {changes}"
    assert changes and changes[0][0] == "scale_layer_lr" and changes[0][1]["tensors"] == ["lm_head"], summary
    assert changes[0][1]["groups"] == {"1": pytest.approx(0.01)}, summary  # the output layer's group alone
    assert "rollback" not in {a for a, _ in changes} and monitored.steps == config.steps, summary
    assert monitored.val_loss < 0.9 * alone.val_loss, summary
