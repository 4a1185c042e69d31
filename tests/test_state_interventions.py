"""State-level interventions on a real tiny model and a real AdamW (fused and foreach): reset_moments,
adaptive_clip, clip_update, qk_clip and skip_step by element, applied through the executor to a live monitor."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from pipeline_support import PlannedReports
from torch import nn

from stabmon.collect.config import UpdateConfig
from stabmon.events import Anomaly, Decision, DecisionStatus, Severity
from stabmon.interventions import Executor, RunFacts, not_applicable, run_facts
from stabmon.interventions.adaptive_clip import AdaptiveClip
from stabmon.interventions.qk_clip import QkClip
from stabmon.monitor import Monitor, MonitorConfig
from stabmon.replay.simulate import Simulation
from stabmon.runbook import load_runbook
from stabmon.runbook.fit import fit_warnings

KINDS = [{"fused": True}, {"foreach": True}]


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, num_heads=4, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        a, _ = self.attn(h, h, h)
        return self.head(a).mean()


def build(kind: dict[str, bool], **cfg: Any) -> tuple[Tiny, torch.optim.Optimizer, Monitor]:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **kind)
    mon = Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(hang_timeout=None, **cfg))
    return model, opt, mon


def train(model: Tiny, opt: torch.optim.Optimizer, mon: Monitor, steps: int, *, spike: float = 1.0,
          scaler: Any = None) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        mon.begin_step()
        loss = model(torch.randn(4, 3, 8, generator=gen) * spike)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        mon.end_step()


def apply(mon: Monitor, action: str, params: dict[str, Any], anomaly: Anomaly | None = None) -> Any:
    ex = Executor(mon.handle)
    d = Decision(step=mon.step, action=action, params=params, status=DecisionStatus.APPLY, runbook="rb",
                 rule="r", rung=0, reason="test", anomaly_id=anomaly.id if anomaly else None)
    if anomaly is not None:
        d = ex.with_evidence(d, anomaly)
    return ex, ex.execute(d)


def spike(metric: str, value: float) -> Anomaly:
    return Anomaly(kind="spike", metric=metric, step=5, score=9.0, severity=Severity.ERROR, detector="t",
                   evidence=((4, 1.0), (5, value)))


@pytest.mark.parametrize("kind", KINDS)
def test_reset_moments_zeroes_the_flagged_layer_from_the_evidence_and_rewarms_the_lr(kind: dict[str, bool]) -> None:
    model, opt, mon = build(kind)
    train(model, opt, mon, 3)
    _, rec = apply(mon, "reset_moments", {"rewarm_steps": 4}, spike("grad_norm/attn", 50.0))
    assert rec.after["reset"] == 4 and all(n.startswith("attn.") for n in rec.after["tensors"])
    assert not opt.state[model.attn.in_proj_weight]["exp_avg"].any()
    assert opt.state[model.attn.in_proj_weight]["exp_avg_sq"].any()  # second moment kept by default
    assert opt.state[model.head.weight]["exp_avg"].any()  # other tensors untouched
    lrs = []
    for _ in range(5):
        lrs.append(mon.hparams()["lr"])
        train(model, opt, mon, 1)
    assert lrs == pytest.approx([0.002, 0.004, 0.006, 0.008, 0.01])
    assert opt.param_groups[0]["lr"] == 1e-2  # the scheduler-visible LR never changed
    mon.close()


def test_reset_moments_of_a_tensor_that_does_not_exist_is_skipped_not_raised() -> None:
    model, opt, mon = build({"foreach": True})
    train(model, opt, mon, 2)
    _, rec = apply(mon, "reset_moments", {"tensors": ["nope"]})
    assert "not applicable: tensor 'nope'" in rec.not_applied
    assert opt.state[model.head.weight]["exp_avg"].any()
    mon.close()


def test_rungs_whose_evidence_is_not_sampled_are_reported_at_start_in_one_line_per_section(
        caplog: pytest.LogCaptureFixture) -> None:
    # the default runbook's layer-LR cut acts on the per-layer update ratios: sampled by default with Adam/AdamW
    # (no copy), off by default with SGD (a copy of the parameters on a sampled step). Off, a learning rate wrong
    # for one layer goes to the restarts, and the user is told so before the run starts
    def unsampled(opt: torch.optim.Optimizer, config: MonitorConfig) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="stabmon.monitor"):
            Monitor(model, opt, store=None, runbook="default", config=config).close()
        return [r.getMessage() for r in caplog.records if "samples nothing" in r.getMessage()]
    # the rungs are dropped from the ladder at start (never tried, escalated or paged), one line per reason

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    (line,) = unsampled(sgd, MonitorConfig(hang_timeout=None))
    assert line == ("stabmon: runbook default: rule not_learning rung 1, rule instability rung 1 dropped from the "
                    "ladder: scale_layer_lr acts on what MonitorConfig.updates samples, and it samples nothing "
                    "(every=0; set e.g. MonitorConfig.updates.every=10)")
    assert unsampled(sgd, MonitorConfig(hang_timeout=None, updates=UpdateConfig(every=10))) == []
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert unsampled(adamw, MonitorConfig(hang_timeout=None)) == []
    assert len(unsampled(adamw, MonitorConfig(hang_timeout=None, updates=UpdateConfig(every=0)))) == 1


def test_state_rungs_that_cannot_act_are_reported_at_start_and_skipped_when_they_come() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mon = Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(hang_timeout=None))
    facts = run_facts(mon.handle.training)
    lines = fit_warnings(load_runbook("in-place-first"), mon.hparams(), facts=facts)
    assert any("reset_moments is not applicable (SGD keeps no exp_avg_sq)" in line for line in lines)
    assert any("qk_clip is not applicable (the model has no recognised attention module" in line for line in lines)
    _, rec = apply(mon, "clip_update", {})
    assert rec.not_applied == "not applicable: SGD is not Adam/AdamW"
    assert mon.overrides.update_rms_cap is None
    mon.close()


@pytest.mark.parametrize("kind", KINDS)
def test_adaptive_clip_clips_only_the_spiking_tensor_and_reverts_to_off(kind: dict[str, bool]) -> None:
    model, opt, mon = build(kind)
    train(model, opt, mon, 3)
    ex, rec = apply(mon, "adaptive_clip", {})
    train(model, opt, mon, 3)  # seeds and learns each tensor's running norm
    ema = mon.signals.hooks.adaptive._ema
    assert ema is not None and ema.shape[0] == len(list(model.parameters()))
    seen: list[torch.Tensor] = []
    handle = opt.register_step_pre_hook(lambda o, a, k: seen.append(model.head.weight.grad.norm().clone()))
    raw_model = Tiny()
    raw_model.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(3))
    raw_model.head.weight.register_hook(lambda g: g * 1000)
    model.head.weight.register_hook(lambda g: g * 1000)  # one tensor's gradient spikes x1000
    mon.begin_step()
    model(x).backward()
    raw_model(x).backward()
    opt.step()
    opt.zero_grad()
    mon.end_step()
    handle.remove()
    # the monitor's pre-hook ran first: the spiking tensor is clipped to ~1.05x its running norm
    assert float(seen[0]) < float(raw_model.head.weight.grad.norm()) / 100
    rev = ex.execute(Decision(step=9, action="revert", params={"intervention_id": rec.id},
                              status=DecisionStatus.APPLY, runbook="rb", rule="r", rung=0, reason="t"))
    assert rev.after == {"adaptive_clip": None, "adaptive_clip_beta": 0.98} and mon.overrides.adaptive_clip is None
    train(model, opt, mon, 1)
    assert mon.signals.hooks.adaptive._ema is None  # off: its running norms are dropped
    mon.close()


@pytest.mark.parametrize("kind", KINDS)
def test_clip_update_caps_the_update_rms_of_a_tensor_whose_second_moment_is_far_too_low(
        kind: dict[str, bool]) -> None:
    model, opt, mon = build(kind)
    train(model, opt, mon, 20)
    apply(mon, "clip_update", {"max_rms": 0.5})
    p = model.head.weight
    before = p.detach().clone()
    model.head.weight.register_hook(lambda g: g * 1e4)  # g^2 >> v: Adam's update jumps to ~3x its usual size
    train(model, opt, mon, 1)
    step_rms = float(((p.detach() - before) / 1e-2).square().mean().sqrt())
    assert step_rms == pytest.approx(0.5, rel=0.02)  # lr x 0.5, weight decay's share included
    mon.close()


def test_skip_step_theta_zeroes_only_the_spiking_elements() -> None:
    model, opt, mon = build({"foreach": True})
    train(model, opt, mon, 5)
    _, rec = apply(mon, "skip_step", {"theta": 5000.0})
    assert rec.after == {"skip_theta": 5000.0}
    w = model.head.weight
    mask = torch.zeros_like(w)
    mask[0, 3] = 1e6
    raw: list[torch.Tensor] = []
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    w.register_hook(lambda g: g + mask * g.abs().max().clamp(min=1e-3))
    w.register_hook(lambda g: raw.append(g.clone()))
    # the monitor's pre-hook was registered first: this one sees the gradient it left, and the state before the step
    handle = opt.register_step_pre_hook(
        lambda o, a, k: seen.append((w.grad.clone(), opt.state[w]["exp_avg_sq"].clone())))
    train(model, opt, mon, 1)
    handle.remove()
    (got, v), g = seen[0], raw[0]
    assert float(got[0, 3]) == 0.0 and float(g[0, 3]) != 0.0
    assert torch.equal(got, torch.where((g.square() > 5000.0 * v) & (v > 0), torch.zeros_like(g), g))
    assert int((got == 0).sum()) < got.numel() // 4  # only the spiking elements
    mon.close()


@pytest.mark.parametrize("kind", KINDS)
def test_skip_guard_with_default_and_fused_adamw_under_a_grad_scaler_copies_nothing(kind: dict[str, bool]) -> None:
    model, opt, mon = build(kind)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    mon.close()
    mon = Monitor(model, opt, scaler=scaler, store=None, detectors=False, config=MonitorConfig(hang_timeout=None))
    train(model, opt, mon, 4, scaler=scaler)
    mon.signals.hooks.guard.learn_host(1e-3, False)
    apply(mon, "skip_step", {"factor": 5.0})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {k: v.clone() for k, v in opt.state[model.head.weight].items()}
    train(model, opt, mon, 1, spike=1e3)  # far above 5x the running mean: skipped
    assert all(torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
    assert all(torch.equal(state[k], opt.state[model.head.weight][k]) for k in state)
    assert mon.signals.hooks.guard.nbytes() == 0 and opt.param_groups[0]["fused"] == kind.get("fused")
    mon.close()


def test_qk_clip_scales_only_the_offending_head_so_its_logits_shrink_to_tau() -> None:
    model, opt, mon = build({"foreach": True})
    w = model.attn.in_proj_weight.detach().clone()
    h = torch.randn(1, 3, 16)
    q, k = (h @ w[:16].T + model.attn.in_proj_bias[:16]), (h @ w[16:32].T + model.attn.in_proj_bias[16:32])
    _, rec = apply(mon, "qk_clip", {"standing": False}, spike("attn_logit/attn/2", 400.0))
    assert rec.after == {"layer": "attn", "heads": [2], "factor": 0.25}
    w2, b2 = model.attn.in_proj_weight.detach(), model.attn.in_proj_bias.detach()
    q2, k2 = h @ w2[:16].T + b2[:16], h @ w2[16:32].T + b2[16:32]
    head = slice(8, 12)
    assert torch.allclose(q2[..., head] @ k2[..., head].mT, 0.25 * (q[..., head] @ k[..., head].mT), atol=1e-5)
    assert torch.equal(q2[..., :8], q[..., :8]) and torch.equal(w2[32:], w[32:])  # other heads, values untouched
    mon.close()


def test_qk_clip_with_separate_q_k_projections_and_bad_inputs() -> None:
    class Attn(nn.Module):
        num_heads = 2

        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    model = nn.ModuleDict({"layers": nn.ModuleList([Attn()])})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(hang_timeout=None))
    wq = model.layers[0].q_proj.weight.detach().clone()
    once = {"standing": False}
    _, rec = apply(mon, "qk_clip", {**once, "layer": "layers.0", "heads": [0], "max_logit": 200.0, "tau": 50.0})
    assert rec.after["factor"] == 0.25
    assert torch.allclose(model.layers[0].q_proj.weight[:4], wq[:4] * 0.5)
    assert torch.equal(model.layers[0].q_proj.weight[4:], wq[4:])
    _, rec = apply(mon, "qk_clip", {**once, "layer": "layers.0", "max_logit": 20.0})
    assert rec.not_applied == "max logit 20 is not above tau 100"
    _, rec = apply(mon, "qk_clip", {**once, "layer": "layers.0.q_proj", "max_logit": 200.0})
    assert "not applicable: layer 'layers.0.q_proj' is no recognised attention module" in rec.not_applied
    _, rec = apply(mon, "qk_clip", {**once, "layer": "layers.0", "heads": [7], "max_logit": 200.0})
    assert rec.error.startswith("ValueError: heads: [7] out of range")
    mon.close()


@pytest.mark.parametrize("params", [{"lambda_rel": 1.0}, {"beta": 1.0}, {"lambda_rel": "1.05"}, {"what": 1}])
def test_bad_params_are_refused_at_build(params: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        AdaptiveClip(Simulation().handle, params, decision_id="d")


def test_replay_simulates_every_state_level_rung() -> None:
    t = Simulation()
    ex = Executor(t.handle, simulated=True)
    for action, params in (("reset_moments", {"tensors": ["blocks.1"]}), ("adaptive_clip", {}),
                           ("clip_update", {}), ("qk_clip", {"max_logit": 300.0, "standing": False}), ("qk_clip", {}),
                           ("skip_step", {"theta": 5e3})):
        rec = ex.execute(Decision(step=1, action=action, params=params, status=DecisionStatus.APPLY, runbook="rb",
                                  rule="r", rung=0, reason="t"))
        assert rec.simulated and "error" not in rec.after and "not_applied" not in rec.after, (action, rec.after)
    assert [c["action"] for c in t.summary()["state_changes"]] == ["reset_moments", "qk_clip"]
    assert t.overrides.adaptive_clip == 1.05 and t.overrides.update_rms_cap == 1.0 and t.overrides.skip_theta == 5e3
    assert t.overrides.qk_tau == 100.0  # the standing clip: an override


def test_facts_name_what_is_missing() -> None:
    facts = RunFacts(tensors=frozenset({"a.weight"}), second_moment=None, adam_update=None, attention=())
    assert not_applicable(QkClip, {"layer": None}, facts) == (
        "the model has no recognised attention module (see stabmon.collect.step.qk)")


def test_a_failed_state_change_logs_one_line(caplog: pytest.LogCaptureFixture) -> None:
    model, opt, mon = build({"foreach": True})
    with caplog.at_level(logging.ERROR):
        apply(mon, "qk_clip", {"standing": False, "layer": "attn", "heads": [9], "max_logit": 500.0})
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1
    mon.close()


def test_qk_clip_on_a_nanogpt_packed_projection() -> None:
    class Block(nn.Module):
        n_head = 2

        def __init__(self) -> None:
            super().__init__()
            self.c_attn, self.c_proj = nn.Linear(8, 24), nn.Linear(8, 8)

    model = nn.ModuleDict({"h": nn.ModuleList([Block(), Block()])})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(hang_timeout=None))
    assert run_facts(mon.handle.training).attention == ("h.0", "h.1")
    w = model.h[1].c_attn.weight.detach().clone()
    _, rec = apply(mon, "qk_clip", {"standing": False}, spike("attn_logit/h.1/1", 400.0))
    assert rec.after == {"layer": "h.1", "heads": [1], "factor": 0.25}
    scaled = model.h[1].c_attn.weight.detach()
    assert torch.allclose(scaled[4:8], w[4:8] * 0.5) and torch.allclose(scaled[12:16], w[12:16] * 0.5)
    assert torch.equal(scaled[:4], w[:4]) and torch.equal(scaled[16:], w[16:])  # head 0 and the values untouched
    mon.close()


def test_qk_clip_on_hugging_face_gpt2s_conv1d_projection() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(hang_timeout=None))
    assert run_facts(mon.handle.training).attention == ("transformer.h.0.attn", "transformer.h.1.attn")
    conv = model.transformer.h[1].attn.c_attn  # weight (16, 48): query, key and value columns side by side
    w, b = conv.weight.detach().clone(), conv.bias.detach().clone()
    _, rec = apply(mon, "qk_clip", {"standing": False}, spike("attn_logit/transformer.h.1.attn/1", 400.0))
    assert rec.after == {"layer": "transformer.h.1.attn", "heads": [1], "factor": 0.25}
    scaled, bias = conv.weight.detach(), conv.bias.detach()
    for cols in (slice(8, 16), slice(24, 32)):  # head 1 of the queries and of the keys: sqrt(0.25) each
        assert torch.allclose(scaled[:, cols], w[:, cols] * 0.5) and torch.allclose(bias[cols], b[cols] * 0.5)
    for cols in (slice(0, 8), slice(16, 24), slice(32, 48)):  # head 0 and the values untouched
        assert torch.equal(scaled[:, cols], w[:, cols]) and torch.equal(bias[cols], b[cols])
    mon.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_skipped_step_stays_skipped_with_every_state_level_fix_on(kind: dict[str, bool]) -> None:
    model, opt, mon = build(kind)
    train(model, opt, mon, 5)
    mon.signals.hooks.guard.learn_host(1e-3, False)
    for action, params in (("skip_step", {"factor": 5.0, "theta": 5000.0}), ("adaptive_clip", {}),
                           ("clip_update", {"max_rms": 0.5})):
        _, rec = apply(mon, action, params)
        assert "error" not in rec.after and "not_applied" not in rec.after
    before = [p.detach().clone() for p in model.parameters()]
    state = [v.clone() for p in model.parameters() for v in opt.state[p].values()]
    train(model, opt, mon, 1, spike=1e4)  # non-finite or far above the guard's mean: skipped
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(state, [v for p in model.parameters()
                                                         for v in opt.state[p].values()], strict=True))
    mon.close()


def _flags(metric: str, steps: set[int], value: float, kind: str = "spike") -> PlannedReports:
    """A detector suite that reports a given error-severity anomaly at given steps."""
    return PlannedReports({s: [Anomaly(kind=kind, metric=metric, step=s, score=9.0, severity=Severity.ERROR,
                                       detector="t", evidence=((s - 1, 1.0), (s, value)))] for s in steps})


@pytest.mark.parametrize(("metric", "kind", "action", "want"), [
    ("grad_norm/blocks.1", "spike", "reset_moments", {"tensors": ["blocks.1"]}),
    ("attn_logit/blocks.0.attn/3", "level", "qk_clip", {"qk_tau": 50.0}),
])
def test_in_place_first_acts_on_what_the_anomaly_names(metric: str, kind: str, action: str,
                                                       want: dict[str, Any]) -> None:
    from stabmon.events import InterventionRecord, StepRecord
    from stabmon.factory import resolve_engine
    from stabmon.pipeline import Pipeline

    target = Simulation()
    pipe = Pipeline(_flags(metric, {30}, 400.0, kind), resolve_engine("in-place-first", None),
                    Executor(target.handle, simulated=True))
    events = []
    for step in range(40):
        record = StepRecord(step=step, metrics={"loss": 2.0, "lr": 1e-3})
        target.begin_block([record])
        events += pipe.process(record)
    # on a spike a layer-LR cut comes first, not applicable without an out_of_line report: nothing changed
    skipped = [e for e in events if isinstance(e, InterventionRecord) and e.not_applied]
    assert [(e.action, e.not_applied[:31]) for e in skipped] == (
        [("scale_layer_lr", "not applicable: no layer is fla")] if kind == "spike" else [])
    decision = next(e for e in events if isinstance(e, Decision) and e.action == action)
    record = next(e for e in events if isinstance(e, InterventionRecord) and not e.not_applied)
    assert decision.params["metric"] == metric and decision.params["value"] == 400.0
    assert record.decision_id == decision.id and want.items() <= {**record.after}.items()


@pytest.mark.parametrize("kind", KINDS)
def test_a_standing_qk_clip_holds_each_head_under_tau_until_it_is_given_back(kind: dict[str, bool]) -> None:
    from stabmon.collect.signals.attention import AttentionLogits

    model, opt, mon = build(kind)
    with torch.no_grad():
        model.attn.in_proj_weight[8:12].mul_(60.0)  # head 2's queries: its logits 20x the others'
    probe = AttentionLogits(model)

    def heads() -> list[float]:
        probe.arm()
        with torch.no_grad():
            model(torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(1)))
        probe.collect()
        return probe.last[0].tolist()

    before = heads()
    w = model.attn.in_proj_weight.detach().clone()
    ex, rec = apply(mon, "qk_clip", {"tau": 2.0})
    assert rec.before == {"qk_tau": None} and rec.after == {"qk_tau": 2.0} and mon.overrides.qk_tau == 2.0
    train(model, opt, mon, 3)
    after = heads()
    assert before[2] > 5 * 2.0 and max(before[:2] + before[3:]) < 2.0
    assert after[2] <= 2.0 * 1.5  # the offending head, back near tau (the steps in between grow it a little)
    moved = (model.attn.in_proj_weight.detach() - w).abs().amax(dim=1)
    assert moved[8:12].max() > 10 * moved[:8].max()  # the query rows of head 2 shrank; the others only trained
    # released: the bound rises 8x over the release's steps, then the clip is off
    release = Decision(step=mon.step, action="release", params={"intervention_ids": [rec.id], "steps": 4},
                       status=DecisionStatus.APPLY, runbook="rb", rule="r", rung=0, reason="test")
    released = ex.execute(release)
    assert released.after == {"qk_tau": 2.0, "release_steps": 4, "rise": 8.0}
    train(model, opt, mon, 4)
    assert mon.overrides.qk_tau == 2.0 and mon.overrides.qk_release_done == 4
    train(model, opt, mon, 1)
    assert mon.overrides.qk_tau is None and mon.signals.recorder.standing_qk is not None
    assert not mon.signals.recorder.standing_qk.attention.armed  # nothing hooked once it is off
    mon.close()


def test_a_standing_qk_clip_on_attention_the_monitor_cannot_measure_says_so(caplog: pytest.LogCaptureFixture) -> None:
    class Packed(nn.Module):  # a QK layout qk_clip knows, in a forward the attention collector cannot see into
        n_head = 2

        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(8, 24)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).split(8, dim=-1)
            return (torch.tanh(q * k) * v).sum()

    model = Packed()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(hang_timeout=None))
    _, rec = apply(mon, "qk_clip", {})
    assert rec.after == {"qk_tau": 100.0}
    with caplog.at_level(logging.WARNING):
        mon.begin_step()
        model(torch.randn(2, 8)).backward()
        opt.step()
        mon.end_step()
    assert any("cannot measure this model's attention logits" in r.message for r in caplog.records)
    mon.close()


def test_a_standing_qk_clip_records_attention_logits_only_on_sampled_steps() -> None:
    from stabmon.collect.config import AttentionConfig

    model, opt, mon = build({"foreach": True}, attention=AttentionConfig(every=4))
    apply(mon, "qk_clip", {"tau": 2.0})  # the sampled collector is armed on every step while the clip stands
    train(model, opt, mon, 9)
    mon.close()
    steps = [r.step for r in mon.records if "attn_logit" in r.metrics]
    assert steps == [s for s in range(9) if s % 4 == 0], steps


@pytest.mark.parametrize(("params", "message"), [
    ({"tau": 0.0}, r"tau"), ({"standing": "sometimes"}, r"standing"), ({"heads": ["h2"]}, r"heads")])
def test_bad_qk_clip_params_are_refused_at_build(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        QkClip(Simulation().handle, params, decision_id="d")


def test_a_bad_standing_bound_is_a_one_line_error() -> None:
    from stabmon.overrides import Overrides

    with pytest.raises(ValueError, match=r"^overrides\.qk_tau must be > 0, got -1\.0$"):
        Overrides(qk_tau=-1.0)
    with pytest.raises(ValueError, match=r"^overrides\.qk_release_done must be in \[0, qk_release_steps=2\], got 3$"):
        Overrides(qk_tau=50.0, qk_release_steps=2, qk_release_done=3)
