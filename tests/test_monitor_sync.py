"""No host sync on the hot path: host reads of tensors happen only inside flushes.

A TorchFunctionMode counts every ``.item()``, ``.tolist()``, ``float()``, ``int()``, ``bool()``, ``.cpu()``
and ``.numpy()`` on a tensor during 50 monitored steps, noting whether a flush was running. The loop itself
(SGD, a small transformer-like model) reads nothing back, so every call outside a flush would be the
monitor's.
"""

from __future__ import annotations

import pytest
import torch
from sync_support import SyncCounter, count_alarm_reads
from test_monitor import Tiny
from torch import nn

from stabmon.collect.config import ActivationConfig, EmbeddingConfig, MonitorConfig, UpdateConfig
from stabmon.monitor import Monitor
from stabmon.overrides import Overrides


def _run(
    config: MonitorConfig,
    counter: SyncCounter,
    *,
    overrides: Overrides | None = None,
    steps: int = 50,
    device: str = "cpu",
    fused_adamw: bool = False,
    scaler: bool = False,
    **monitor: object,
) -> Monitor:
    torch.manual_seed(0)
    model = Tiny(vocab=17, d=16).to(device)
    if fused_adamw:
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    amp = torch.amp.GradScaler(device, init_scale=256.0) if scaler else None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))
    data = [torch.randint(0, 17, (4, 8), generator=torch.Generator().manual_seed(i)).to(device) for i in range(steps)]
    mon = Monitor(model, opt, scaler=amp, scheduler=sched, store=None, detectors=False, config=config,
                  **monitor)  # type: ignore[arg-type]
    if overrides is not None:
        mon.overrides.load_state_dict(overrides.state_dict())
    real_flush = mon.flush

    def counted_flush():  # noqa: ANN202
        counter.in_flush += 1
        try:
            return real_flush()
        finally:
            counter.in_flush -= 1

    mon.flush = counted_flush  # type: ignore[method-assign]
    count_alarm_reads(mon, counter)
    with counter:
        for _, idx in mon.steps(data):
            logits = model(idx)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
            (amp.scale(loss) if amp is not None else loss).backward()
            mon.observe(loss=loss)
            if amp is not None:
                amp.step(opt)
                amp.update()
            else:
                opt.step()
            sched.step()
            opt.zero_grad()
        mon.close()
    return mon


@pytest.mark.parametrize("every", [10, 1], ids=["defaults", "every-signal-every-step"])
def test_no_host_sync_outside_flushes(every: int) -> None:
    cfg = MonitorConfig(
        clip=1.0,
        flush_every=20,
        activations=ActivationConfig(every=every),
        embeddings=EmbeddingConfig(every=every),
        updates=UpdateConfig(every=every),
    )
    counter = SyncCounter()
    # a diagnose rung keeps every step's batch, RNG state and sample ids: host work, no device read
    mon = _run(cfg, counter, overrides=Overrides(lr_scale=0.5, skip_factor=3.0), runbook="diagnose-first",
               mode="apply", sample_ids=lambda idx: [f"seq{i}" for i in range(len(idx))])
    assert counter.outside == []
    assert mon.batches is not None and len(mon.batches.entries) == 50 and "update_ratio" in mon.records[0].metrics
    # 50 steps, flush_every=20: flushes after steps 20 and 40, and at close: one host copy each
    assert counter.inside == ["tolist"] * 3
    assert counter.landed == ["__float__"] * 50  # the loss alarm: each step's loss, from its host slot
    assert len(mon.records) == 50
    rec = mon.records[0]
    assert "act_rms/blocks.0" in rec.metrics and "emb_drift/wte" in rec.metrics and "skipped" in rec.metrics


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("scaler", [False, True], ids=["plain", "grad-scaler"])
def test_no_host_sync_with_the_zero_copy_guard_and_a_host_embedding_reference(scaler: bool, device: str) -> None:
    cfg = MonitorConfig(
        clip=1.0,
        flush_every=20,
        activations=ActivationConfig(every=1),
        embeddings=EmbeddingConfig(every=1, rows=5, reference="cpu"),
    )
    counter = SyncCounter()
    mon = _run(cfg, counter, overrides=Overrides(skip_factor=3.0), fused_adamw=True, scaler=scaler, device=device)
    assert counter.outside == []
    assert counter.inside == ["tolist"] * 3
    assert mon.signals.hooks.guard.zero_copy and "emb_update/wte" in mon.records[-1].metrics


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_host_sync_outside_flushes_on_cuda() -> None:
    cfg = MonitorConfig(
        clip=1.0,
        flush_every=20,
        activations=ActivationConfig(every=1),
        embeddings=EmbeddingConfig(every=1),
        hang_timeout=None,
    )
    counter = SyncCounter()
    mon = _run(cfg, counter, overrides=Overrides(lr_scale=0.5, skip_factor=3.0), device="cuda")
    assert counter.outside == []
    assert counter.inside == ["tolist"] * 3  # of the pinned host buffer, after one event wait
    # the nonfinite alarm read only pinned slots whose event had completed: at most one per step
    assert set(counter.landed) <= {"__float__"} and len(counter.landed) <= 50
    assert len(mon.records) == 50 and mon.records[0].metrics["grad_norm"] > 0


def test_counter_catches_an_injected_item(monkeypatch: pytest.MonkeyPatch) -> None:
    from stabmon.collect.signals import grads

    real = grads.GradNorms.compute

    def leaky(self):  # noqa: ANN001, ANN202
        out = real(self)
        if out is not None:
            out.total.item()  # the kind of bug the property forbids
        return out

    monkeypatch.setattr(grads.GradNorms, "compute", leaky)
    counter = SyncCounter()
    _run(MonitorConfig(clip=1.0), counter, steps=5)
    assert counter.outside == ["item"] * 5
