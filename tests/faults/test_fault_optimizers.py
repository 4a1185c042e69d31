"""Faults on the optimizer side of the live monitor: sparse gradients (``nn.Embedding(sparse=True)`` under SGD,
SGD with momentum and SparseAdam), ``reset_moments`` on an amsgrad AdamW, learning rates held as tensors, and an
``optimizer.step()`` that raises while an LR override is in force.

Every fault is built by construction, so each claim holds for any data seed (``STABMON_TEST_SEED``, default 0)
and any thread count: gradients with repeated embedding rows (an uncoalesced sparse gradient), a NaN loss on a
chosen step, a phase of 100x gradients before a reset, a step pre-hook that raises on a chosen step. Expected
values are hand computations from the dense gradients and the optimizer state, never a pinned number.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import pytest
import torch
from fault_support import report
from torch import nn

from stabmon.collect.config import MomentConfig, MonitorConfig, UpdateConfig
from stabmon.collect.step.optim import OptimizerHooks
from stabmon.events import Decision, DecisionStatus
from stabmon.interventions import Executor
from stabmon.monitor import Monitor
from stabmon.overrides import Overrides

SEED = int(os.environ.get("STABMON_TEST_SEED", "0"))
ROWS = 12


class Bag(nn.Module):
    """A sparse embedding and a dense head: the embedding's gradient is a sparse COO tensor."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(SEED)
        self.emb = nn.Embedding(ROWS, 4, sparse=True)
        self.head = nn.Linear(4, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx)).pow(2).mean()


def batches(n: int) -> list[torch.Tensor]:
    """Index batches that repeat rows (1 and 3 in every batch, twice each): the sparse gradient holds duplicate
    entries, so a norm of its raw values would be wrong."""
    gen = torch.Generator().manual_seed(SEED + 1)
    return [torch.cat([torch.tensor([1, 3, 1, 3]), torch.randint(0, ROWS, (4,), generator=gen)]) for _ in range(n)]


def dense_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each gradient as a dense tensor (duplicates summed): the hand computation's input."""
    return {n: p.grad.to_dense().clone() for n, p in model.named_parameters() if p.grad is not None}


def norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def sparse_optimizer(kind: str, model: Bag) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    if kind == "sgd-momentum":  # SGD keeps a sparse momentum buffer for the embedding
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if kind == "sparseadam":  # the embedding only; the head has gradients the optimizer does not step
        return torch.optim.SparseAdam([model.emb.weight], lr=0.01)
    raise AssertionError(kind)


SPARSE_KINDS = ["sgd", "sgd-momentum", "sparseadam"]


# -- sparse gradients --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", SPARSE_KINDS)
def test_sparse_gradients_are_measured_exactly_with_the_defaults(kind: str) -> None:
    model = Bag()
    opt = sparse_optimizer(kind, model)
    expected: list[dict[str, float]] = []
    with Monitor(model, opt, store=None) as mon:  # the defaults: grad norms, per layer, embedding drift
        for _, idx in mon.steps(batches(12)):
            loss = model(idx)
            loss.backward()
            mon.observe(loss=loss)
            grads = dense_grads(model)
            expected.append({"grad_norm": norm(list(grads.values())), "grad_norm/emb": norm([grads["emb.weight"]]),
                             "grad_norm/head": norm([grads["head.weight"], grads["head.bias"]])})
            opt.step()  # before the fix: NotImplementedError from the grad-norm collector, at step 0
            model.zero_grad()
    assert len(mon.records) == 12
    for rec, want in zip(mon.records, expected, strict=True):
        for name, value in want.items():
            assert rec.metrics[name] == pytest.approx(value, rel=1e-5), (kind, rec.step, name)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    report("sparse grad norm", optimizer=kind, steps=len(mon.records), grad_norm=mon.records[-1].metrics["grad_norm"])


@pytest.mark.parametrize("kind", ["sgd", "sgd-momentum"])
def test_clipping_scales_sparse_gradients_by_the_same_coefficient(kind: str) -> None:
    model = Bag()
    opt = sparse_optimizer(kind, model)
    clip = 1e-3  # far below every gradient norm of this model: every step clips
    with Monitor(model, opt, store=None, config=MonitorConfig(clip=clip)) as mon:
        for _, idx in mon.steps(batches(5)):
            loss = model(idx)
            loss.backward()
            mon.observe(loss=loss)
            before = dense_grads(model)
            weight = model.emb.weight.detach().clone()
            opt.step()
            coef = clip / (norm(list(before.values())) + 1e-6)
            after = dense_grads(model)
            for name, g in before.items():
                torch.testing.assert_close(after[name], g * coef, rtol=1e-5, atol=1e-9)
            assert norm(list(after.values())) == pytest.approx(clip, rel=1e-4)
            if kind == "sgd":  # the step took the clipped sparse gradient
                torch.testing.assert_close(model.emb.weight.detach(), weight - 0.1 * after["emb.weight"])
            model.zero_grad()
    report("sparse clip", optimizer=kind, clip=clip)


@pytest.mark.parametrize("kind", SPARSE_KINDS)
def test_skip_guard_discards_a_nan_step_with_sparse_gradients(kind: str) -> None:
    model = Bag()
    opt = sparse_optimizer(kind, model)
    nan_at = 6
    params: dict[int, list[torch.Tensor]] = {}
    with Monitor(model, opt, store=None, config=MonitorConfig(flush_every=4, hang_timeout=None)) as mon:
        mon.overrides.skip_factor = 100.0  # only the NaN step is flagged, whatever the data
        for step, idx in mon.steps(batches(10)):
            loss = model(idx) * (float("nan") if step == nan_at else 1.0)  # NaN gradients on one step, by construction
            loss.backward()
            mon.observe(loss=loss)
            params[step] = [p.detach().clone() for p in opt.param_groups[0]["params"]]
            opt.step()
            if step == nan_at:  # the flagged update never happened: bit for bit
                for old, p in zip(params[step], opt.param_groups[0]["params"], strict=True):
                    assert torch.equal(old, p.detach()), kind
            model.zero_grad()
    skipped = [r.step for r in mon.records if r.metrics.get("skipped")]
    assert skipped == [nan_at], (kind, skipped)
    assert all(torch.isfinite(p).all() for p in model.parameters()), kind
    for state in opt.state.values():  # nothing of the NaN step lives on in the optimizer state
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                assert torch.isfinite(v.to_dense() if v.is_sparse else v).all(), kind
    moved = [not torch.equal(a, b) for a, b in zip(params[nan_at + 1], params[9], strict=True)]
    assert any(moved), kind  # training went on after the skipped step
    report("sparse skip guard", optimizer=kind, skipped=skipped)


def test_sparse_adam_moment_ratio_element_skip_and_update_ratio() -> None:
    model = Bag()
    opt = sparse_optimizer("sparseadam", model)
    cfg = MonitorConfig(moments=MomentConfig(every=1), updates=UpdateConfig(every=1), hang_timeout=None)
    expected: list[float] = []

    def moment_ratio(o: torch.optim.Optimizer, *_: Any) -> None:  # after the monitor's pre-hook: the same state
        p = model.emb.weight
        state = o.state.get(p)
        if not state:
            expected.append(0.0)
            return
        beta2, eps = o.param_groups[0]["betas"][1], o.param_groups[0]["eps"]
        v = state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))
        g = p.grad.to_dense()
        expected.append(math.sqrt(float((g.square() / v.clamp(min=eps * eps)).sum()) / p.numel()))

    with Monitor(model, opt, store=None, config=cfg) as mon:
        mon.overrides.skip_theta, mon.overrides.adaptive_clip = 5.0, 2.0  # element skip, AdaGC: on sparse too
        hook = opt.register_step_pre_hook(moment_ratio)
        for _, idx in mon.steps(batches(8)):
            loss = model(idx)
            loss.backward()
            mon.observe(loss=loss)
            opt.step()
            model.zero_grad()
        hook.remove()
    got = [r.metrics.get("moment_ratio/emb.weight", 0.0) for r in mon.records]  # step 0: no state yet
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-12)
    assert all(r.metrics["update_ratio/emb"] > 0 for r in mon.records)
    report("sparse adam signals", moment_ratio=got[-1], update_ratio=mon.records[-1].metrics["update_ratio/emb"])


def test_element_skip_judges_a_sparse_gradient_row_by_its_summed_entries() -> None:
    """SPAM's element skip on SparseAdam: a row whose gradient, split over two duplicate entries, is 1000x the
    usual is zeroed; the other row is left as it was."""
    model = Bag()
    opt = sparse_optimizer("sparseadam", model)
    seen: dict[str, torch.Tensor] = {}
    with Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(hang_timeout=None)) as mon:
        for step, idx in mon.steps(batches(6)):
            loss = model(idx)
            loss.backward()
            mon.observe(loss=loss)
            if step == 5:  # rows 1 and 3 had a gradient on every step: both have a second moment
                mon.overrides.skip_theta = 5000.0  # SPAM's default
                usual = model.emb.weight.grad.coalesce().to_dense()
                half = usual[1] * 1e3 / 2  # the spike, split over two entries of row 1
                model.emb.weight.grad = torch.sparse_coo_tensor(
                    torch.tensor([[1, 1, 3]]), torch.stack([half, half, usual[3]]), usual.shape,
                    check_invariants=True)
                seen["usual"] = usual
            opt.step()
            if step == 5:
                seen["after"] = model.emb.weight.grad.to_dense()
            model.zero_grad()
    assert torch.equal(seen["after"][1], torch.zeros(4))
    assert torch.equal(seen["after"][3], seen["usual"][3])
    report("sparse element skip", zeroed_row=1, kept_row=3)


# -- amsgrad -----------------------------------------------------------------------------------------------
def _reset_moments(mon: Monitor) -> Any:
    ex = Executor(mon.handle)
    d = Decision(step=mon.step, action="reset_moments", params={"second_moment": True, "rewarm_steps": 0},
                 status=DecisionStatus.APPLY, runbook="rb", rule="r", rung=0, reason="test")
    return ex.execute(d)


def _update_sizes_after_reset(amsgrad: bool) -> tuple[list[float], list[str]]:
    """30 steps of 100x gradients, a reset of both moments, then 3 steps of ordinary ones: each of those steps'
    ||Δθ||, and the state entries the reset left non-zero."""
    torch.manual_seed(SEED)
    model = nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=amsgrad)
    gen = torch.Generator().manual_seed(SEED)
    data = [torch.randn(16, 8, generator=gen) for _ in range(33)]
    sizes: list[float] = []
    left: list[str] = []
    with Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(hang_timeout=None)) as mon:
        for step, x in enumerate(data):
            if step == 30:
                rec = _reset_moments(mon)
                assert rec.after.get("reset") == 2, rec
                left = sorted({k for st in opt.state.values() for k, v in st.items() if k != "step" and v.any()})
            mon.begin_step()
            loss = model(x).pow(2).mean() * (100.0 if step < 30 else 1.0)
            loss.backward()
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            model.zero_grad()
            mon.end_step()
            if step >= 30:
                sizes.append(norm([p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]))
    return sizes, left


def test_reset_moments_on_amsgrad_resets_the_running_max_too() -> None:
    plain, left_plain = _update_sizes_after_reset(amsgrad=False)
    ams, left_ams = _update_sizes_after_reset(amsgrad=True)
    ratios = [a / p for a, p in zip(ams, plain, strict=True)]
    # before the fix the stale running max divided every step by ~100x the gradient: ratio ~0.002
    assert all(0.5 < r < 2.0 for r in ratios), ratios
    assert left_plain == left_ams == []  # before the fix: ['max_exp_avg_sq']
    report("amsgrad reset", plain=plain[0], amsgrad=ams[0], ratio=ratios[0])


def test_moment_ratio_of_amsgrad_is_against_the_running_max() -> None:
    """amsgrad divides by the running max of the second moment: the ratio is measured against what the update
    divides by (a phase of 100x gradients leaves the max far above today's gradients: no under-estimation)."""
    torch.manual_seed(SEED)
    model = nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.5), amsgrad=True)
    gen = torch.Generator().manual_seed(SEED)
    expected: list[float] = []

    def by_hand(o: torch.optim.Optimizer, *_: Any) -> None:
        state = o.state.get(model.weight)
        if not state:
            expected.append(0.0)
            return
        v = state["max_exp_avg_sq"] / (1 - 0.5 ** float(state["step"]))
        g = model.weight.grad
        expected.append(math.sqrt(float((g.square() / v.clamp(min=1e-16)).sum()) / g.numel()))

    cfg = MonitorConfig(moments=MomentConfig(every=1), hang_timeout=None)
    with Monitor(model, opt, store=None, detectors=False, config=cfg) as mon:
        hook = opt.register_step_pre_hook(by_hand)
        for step in range(30):
            mon.begin_step()
            (model(torch.randn(16, 8, generator=gen)).pow(2).mean() * (100.0 if step < 10 else 1.0)).backward()
            opt.step()
            model.zero_grad()
            mon.end_step()
        hook.remove()
    got = [r.metrics.get("moment_ratio/weight", 0.0) for r in mon.records]  # step 0: no state yet
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-12)
    assert got[-1] < 0.1  # against exp_avg_sq (decayed in ~10 steps at beta2 = 0.5) it would read ~1
    report("amsgrad moment ratio", last=got[-1])


# -- tensor learning rates -----------------------------------------------------------------------------------
def _tensor_lr_run(overrides: Overrides, lrs: list[float], steps: int, *, scheduler: bool = False
                   ) -> tuple[Monitor, list[list[float]], list[list[float]], torch.optim.Optimizer, list[torch.Tensor]]:
    """A model with one param group per entry of ``lrs`` (each a CPU tensor); returns the monitor, the LR each
    group stepped with, the LR each group held between steps, the optimizer and the groups' original tensors."""
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    layers = [model[0], model[2]][: len(lrs)]
    opt = torch.optim.Adam([{"params": m.parameters(), "lr": torch.tensor(lr)} for m, lr in zip(layers, lrs,
                                                                                                strict=True)],
                           lr=torch.tensor(lrs[0]), foreach=False)
    tensors = [g["lr"] for g in opt.param_groups]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s)) if scheduler else None
    used: list[list[float]] = []
    held: list[list[float]] = []
    gen = torch.Generator().manual_seed(SEED)
    mon = Monitor(model, opt, store=None, detectors=False, scheduler=sched, config=MonitorConfig(hang_timeout=None))
    mon.overrides.load_state_dict(overrides.state_dict())
    hook = opt.register_step_pre_hook(lambda o, *_: used.append([float(g["lr"]) for g in o.param_groups]))
    for _, x in mon.steps([torch.randn(8, 4, generator=gen) for _ in range(steps)]):
        loss = model(x).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        if sched is not None:
            sched.step()
        model.zero_grad()
        held.append([float(g["lr"]) for g in opt.param_groups])
        assert all(g["lr"] is t for g, t in zip(opt.param_groups, tensors, strict=True))  # the same tensors
    hook.remove()
    mon.close()
    return mon, used, held, opt, tensors


def test_a_released_lr_cap_lifts_under_a_tensor_lr() -> None:
    o = Overrides(lr_cap=0.001)
    o.release_cap(below=0.02, steps=0)  # the schedule (0.01) is already below where the trouble began
    mon, used, held, _, _ = _tensor_lr_run(o, [0.01], 4)
    assert mon.overrides.lr_cap is None and mon.overrides.cap_until is None  # before the fix: held forever
    assert used[0][0] == pytest.approx(0.01) and used[-1][0] == pytest.approx(0.01)
    assert held == [[pytest.approx(0.01)]] * 4
    report("tensor lr cap release", used=used[-1][0])


def test_a_released_lr_cap_holds_while_a_tensor_lr_is_above_the_bar() -> None:
    o = Overrides(lr_cap=0.001)
    o.release_cap(below=0.005, steps=0)  # the schedule (0.01) stays above it: the cap stays
    mon, used, _, _, _ = _tensor_lr_run(o, [0.01], 4)
    assert mon.overrides.lr_cap == 0.001 and [u[0] for u in used] == [pytest.approx(0.001)] * 4


def test_a_released_layer_cut_holds_while_its_tensor_lr_group_is_above_the_bar() -> None:
    cut = {"factor": 0.1, "lift_below": 0.005, "ramp": 2, "done": 0}  # group 1's LR (0.1) is 20x above the bar
    mon, used, held, _, _ = _tensor_lr_run(Overrides(layer_lr={"1": dict(cut)}), [0.01, 0.1], 6)
    assert mon.overrides.layer_lr == {"1": cut}  # before the fix: lifted within 3 steps
    assert [u[1] for u in used] == [pytest.approx(0.01)] * 6 and [u[0] for u in used] == [pytest.approx(0.01)] * 6
    assert held == [[pytest.approx(0.01), pytest.approx(0.1)]] * 6


def test_a_released_layer_cut_lifts_once_its_tensor_lr_group_is_below_the_bar() -> None:
    cut = {"factor": 0.1, "lift_below": 0.5, "ramp": 2, "done": 0}
    mon, used, _, _, _ = _tensor_lr_run(Overrides(layer_lr={"1": cut}), [0.01, 0.1], 4)
    assert mon.overrides.layer_lr == {}
    assert [round(u[1], 6) for u in used] == [round(0.1 * 0.1 ** 0.5, 6), 0.1, 0.1, 0.1]


def test_a_tensor_lr_is_recorded_and_comes_back_as_the_same_tensor() -> None:
    mon, used, held, opt, tensors = _tensor_lr_run(Overrides(lr_scale=0.5), [0.01, 0.02], 6, scheduler=True)
    schedule = [[lr / (1 + 0.1 * s) for lr in (0.01, 0.02)] for s in range(7)]
    assert used == [[pytest.approx(0.5 * v) for v in row] for row in schedule[:6]]
    assert held == [[pytest.approx(v) for v in row] for row in schedule[1:]]
    assert [r.metrics.get("lr") for r in mon.records] == [pytest.approx(0.5 * row[0]) for row in schedule[:6]]
    assert mon.hparams()["lr"] == pytest.approx(0.5 * schedule[6][0])
    assert all(isinstance(g["lr"], torch.Tensor) for g in opt.param_groups)
    report("tensor lr record", recorded=mon.records[-1].metrics["lr"])


def test_a_tensor_lr_on_another_device_is_never_read_and_holds_a_released_cap(caplog: pytest.LogCaptureFixture
                                                                              ) -> None:
    """A meta tensor stands for an accelerator's: reading its value raises, so this proves nothing reads it."""
    model = nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01), foreach=False)
    lr = opt.param_groups[0]["lr"] = torch.tensor(0.01, device="meta")  # Adam's constructor reads its lr
    o = Overrides(lr_cap=0.001, layer_lr={"0": {"factor": 0.5, "lift_below": 1.0, "ramp": 0, "done": 0}})
    o.release_cap(below=1.0, steps=0)
    from stabmon.collect.signals.buffer import StepBuffer
    from stabmon.collect.signals.grads import GradNorms

    hooks = OptimizerHooks(opt, GradNorms(model), buffer=StepBuffer(), overrides=o)
    with caplog.at_level(logging.INFO, logger="stabmon"):
        for _ in range(3):
            hooks.before_step()  # no gradients: the overrides only
            assert opt.param_groups[0]["lr"] is not lr and opt.param_groups[0]["lr"].device.type == "meta"
            hooks.after_step()
            assert opt.param_groups[0]["lr"] is lr
    assert o.lr_cap == 0.001 and o.cap_until == 1.0 and "0" in o.layer_lr  # held, never lifted on a guess
    assert "lr" not in hooks.hparams() and hooks.lr_on_device() is not None
    held = [r for r in caplog.records if "meta" in r.getMessage()]
    assert len(held) == 1, [r.getMessage() for r in caplog.records]  # one line, not one per step


# -- a raising optimizer step ---------------------------------------------------------------------------------
class Boom(RuntimeError):
    pass


def _raise_at(step: int, mon: Monitor) -> Any:
    def hook(o: torch.optim.Optimizer, *_: Any) -> None:  # registered after the monitor's: its pre-hook has run
        if mon.step == step:
            raise Boom(f"injected at step {step}")
    return hook


@pytest.mark.parametrize("schedule", ["constant", "lambda", "tensor-lambda"])
def test_an_lr_override_is_not_compounded_when_optimizer_step_raises(schedule: str) -> None:
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    base: Any = torch.tensor(0.1) if schedule == "tensor-lambda" else 0.1
    opt = torch.optim.SGD(model.parameters(), lr=base)
    tensor = opt.param_groups[0]["lr"]
    factor = (lambda s: 1.0) if schedule == "constant" else (lambda s: 1.0 / (1 + 0.1 * s))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor) if schedule != "constant" else None
    used: dict[int, float] = {}
    held: dict[int, float] = {}
    fails = 0
    gen = torch.Generator().manual_seed(SEED)
    mon = Monitor(model, opt, store=None, detectors=False, scheduler=sched, config=MonitorConfig(hang_timeout=None))
    mon.overrides.lr_scale = 0.5
    boom = opt.register_step_pre_hook(_raise_at(3, mon))
    seen = opt.register_step_pre_hook(lambda o, *_: used.__setitem__(mon.step, float(o.param_groups[0]["lr"])))
    for step, x in mon.steps([torch.randn(8, 4, generator=gen) for _ in range(8)]):
        held[step] = float(opt.param_groups[0]["lr"])  # between steps: the schedule's value
        model(x).pow(2).mean().backward()
        try:
            opt.step()
        except Boom:
            fails += 1
        if sched is not None:
            sched.step()
        model.zero_grad()
    boom.remove()
    seen.remove()
    mon.close()
    assert fails == 1
    epoch = {s: s for s in range(8)}
    assert {s: held[s] for s in held} == {s: pytest.approx(0.1 * factor(epoch[s])) for s in held}, schedule
    assert {s: used[s] for s in used if s != 3} == {s: pytest.approx(0.05 * factor(epoch[s])) for s in used
                                                     if s != 3}, schedule
    if schedule == "tensor-lambda":  # the group's own tensor, never one the hooks wrote for a step
        assert opt.param_groups[0]["lr"] is tensor
    report("raising step", schedule=schedule, lr_after=used[7])


def test_a_raising_step_leaves_no_skip_guard_state_behind() -> None:
    """The guard flags a NaN step and hands the flag to torch's fused kernel (default AdamW, flipped to fused for
    the step); the step then raises. The next steps must train and the optimizer must be as it was."""
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(SEED)
    mon = Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(hang_timeout=None, flush_every=2))
    mon.overrides.skip_factor = 3.0
    boom = opt.register_step_pre_hook(_raise_at(4, mon))
    snapshots: dict[int, list[torch.Tensor]] = {}
    for step, x in mon.steps([torch.randn(8, 4, generator=gen) for _ in range(9)]):
        loss = model(x).pow(2).mean() * (float("nan") if step == 4 else 1.0)
        loss.backward()
        snapshots[step] = [p.detach().clone() for p in model.parameters()]
        try:
            opt.step()
        except Boom:
            pass
        model.zero_grad()
    boom.remove()
    mon.close()
    trained = [not all(torch.equal(a, b) for a, b in zip(snapshots[s], snapshots[s + 1], strict=True))
               for s in range(5, 8)]
    assert trained == [True, True, True]  # before the fix: the stale flag skipped every later step
    assert mon.signals.hooks.guard.zero_copy
    assert not hasattr(opt, "found_inf") and not opt.param_groups[0].get("fused")
    assert all(torch.isfinite(p).all() for p in model.parameters())
