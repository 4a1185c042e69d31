"""The skip_step guard: a skipped step (finite spike, NaN, inf) leaves parameters and optimizer state
bit-identical, with no copy on fused Adam/AdamW and preallocated buffers elsewhere; fused optimizers under a
GradScaler get their gradients unscaled exactly once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from stabmon.collect.config import MonitorConfig
from stabmon.events import Metric
from stabmon.monitor import Monitor

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adam-loop": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01),
}
ZERO_COPY = {"adamw-fused", "adam-fused", "adamw-foreach", "adam-loop"}  # default Adam/AdamW: through the fused kernel


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 11)).to(device)


def _batch(i: int, device: str) -> torch.Tensor:
    return torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(i)).to(device)


def _loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [v.clone() for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return out


def _inject(model: nn.Module, fault: str) -> None:
    grad = model[3].weight.grad
    assert grad is not None
    if fault == "nan":
        grad[0, 0] = float("nan")
    elif fault == "inf":
        grad[1, 2] = float("inf")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("fault", ["spike", "nan", "inf"])
def test_skipped_step_leaves_parameters_and_state_bit_identical(device: str, name: str, fault: str) -> None:
    model = _model(device)
    opt = OPTIMIZERS[name](model.parameters())
    mon = Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(flush_every=4, clip=1.0))
    mon.overrides.skip_factor = 3.0
    bad = 6
    for step, idx in mon.steps([_batch(i, device) for i in range(9)]):
        loss = _loss(model, idx) * (1000.0 if step == bad and fault == "spike" else 1.0)
        loss.backward()
        if step == bad:
            _inject(model, fault)
            before = _state(model, opt)
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
        if step == bad:
            after = _state(model, opt)
            assert len(after) == len(before)
            for old, new in zip(before, after, strict=True):
                assert torch.equal(old, new), f"{name} changed a tensor on the skipped {fault} step"
        if step == bad + 1:  # the run goes on: the next update is applied and finite
            moved = _state(model, opt)
            assert not torch.equal(moved[1], before[1]) and all(torch.isfinite(t).all() for t in moved)
    mon.close()
    assert [r.metrics[Metric.SKIPPED] for r in mon.records] == [float(s == bad) for s in range(9)]
    assert mon.signals.hooks.guard.zero_copy == (name in ZERO_COPY)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_guard_memory_is_zero_when_fused_and_allocated_once_otherwise(name: str) -> None:
    model = _model("cpu")
    opt = OPTIMIZERS[name](model.parameters())
    mon = Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(flush_every=50))
    guard = mon.signals.hooks.guard
    mon.overrides.skip_factor = 5.0
    pointers = []
    for _, idx in mon.steps([_batch(i, "cpu") for i in range(5)]):
        loss = _loss(model, idx)
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
        pointers.append([t.data_ptr() for t in guard._snapshot._saved])
    state_bytes = sum(t.numel() * t.element_size() for t in _state(model, opt))
    if name in ZERO_COPY:
        assert guard.nbytes() == 0 and pointers[-1] == []
    else:
        assert guard.nbytes() == state_bytes
        # the buffers were allocated when the optimizer state appeared, then reused on every step
        assert pointers[1] == pointers[2] == pointers[3] == pointers[4] != []
    mon.overrides.skip_factor = None
    for _, idx in mon.steps([_batch(9, "cpu")]):
        _loss(model, idx).backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    assert guard.nbytes() == 0  # turning the guard off frees the fallback's copy


def _scaled_run(make_opt: Callable[[Any], torch.optim.Optimizer], monitored: bool, inf_at: int = -1) -> Any:
    model = _model("cpu")
    opt = make_opt(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    cfg = MonitorConfig(flush_every=3, clip=0.2)
    mon = Monitor(model, opt, scaler=scaler, store=None, detectors=False, config=cfg) if monitored else None
    frozen = []
    for i in range(6):
        if mon is not None:
            mon.begin_step(batch_index=i)
        loss = _loss(model, _batch(i, "cpu"))
        scaler.scale(loss * (float("inf") if i == inf_at else 1.0)).backward()
        if mon is not None:
            mon.observe(loss=loss)
        else:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2, foreach=True)
        before = _state(model, opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        frozen.append(all(torch.equal(a, b) for a, b in zip(before, _state(model, opt), strict=True)))
        if mon is not None:
            mon.end_step()
    if mon is not None:
        mon.close()
    return model, mon, frozen


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    ],
    ids=["sgd-fused", "adamw-fused", "adamw-foreach"],
)
def test_grad_scaler_unscales_once_and_clips_like_clip_grad_norm(make_opt: Any) -> None:
    reference, _, _ = _scaled_run(make_opt, monitored=False)
    monitored, mon, _ = _scaled_run(make_opt, monitored=True)
    for a, b in zip(reference.parameters(), monitored.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    norms = [r.metrics[Metric.GRAD_NORM] for r in mon.records]
    assert all(0.2 < n < 100 for n in norms)  # of unscaled gradients, and above the clip: clipping acted


def test_fused_overflow_step_is_recorded_and_skipped_by_the_kernel() -> None:
    _, mon, frozen = _scaled_run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), True, inf_at=2)
    recs = list(mon.records)
    assert [r.metrics[Metric.OVERFLOW] for r in recs] == [0, 0, 1, 0, 0, 0]
    assert frozen == [False, False, True, False, False, False]
    assert [r.metrics[Metric.LOSS_SCALE] for r in recs] == [1024.0, 1024.0, 1024.0, 512.0, 512.0, 512.0]
