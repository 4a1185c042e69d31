"""``diagnose`` re-runs a GradScaler run: the scaler's state comes from the checkpoint, an overflow that happens
in both executions (a batch whose scaled loss overflows float32) reproduces, scale drop included, and an inf in
one execution only (a forward hook, once) is ``hardware_suspect``.

Both by construction: batch 22's targets are 1e36 (its gradients, times the initial scale 2^16, overflow
float32 on every execution), and a forward hook makes the head's output 1e30 times too large the first time
step 25 runs (its loss is inf and its scaled gradients overflow: the scaler skips that step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stabmon.collect.config import MonitorConfig
from stabmon.events import Metric
from stabmon.monitor import Monitor

OVERFLOW_STEP, FAULT_STEP = 22, 25


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return (model(batch[0]) - batch[1]).pow(2).mean()


def _run(tmp_path: Path, *, flaky: bool, seed: int, after: list[float] | None = None
         ) -> tuple[Monitor, dict[str, Any]]:
    """The run and the diagnosis; ``after``: each later step's gradient norm, unscaled by hand, is appended."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    hit = {"armed": False}

    def once(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if not hit["armed"]:
            return None
        hit["armed"] = False
        return out * 1e30

    if flaky:
        model[2].register_forward_hook(once)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(seed)
    data = [(torch.randn(8, 6, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(30)]
    data[OVERFLOW_STEP] = (data[OVERFLOW_STEP][0], torch.full((8, 1), 1e36))
    mon = Monitor(model, opt, scaler=scaler, store=None, detectors=False, loss_fn=_loss,
                  sample_ids=lambda b: list(range(len(b[0]))),
                  config=MonitorConfig(clip=1.0, checkpoint_every=10, flush_every=5, hang_timeout=None),
                  checkpoint_dir=str(tmp_path))
    for step, batch in mon.steps(data):
        hit["armed"] = step == FAULT_STEP
        loss = _loss(model, batch)
        scaler.scale(loss).backward()
        mon.observe(loss=loss)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    mon.flush()
    scale = scaler.get_scale()
    ev = mon.diagnose(onset_step=FAULT_STEP, step=29, metric="loss", max_batches=3, rtol=1e-4,
                      recur=0.5).as_after()
    assert scaler.get_scale() == scale  # the scaler's state is put back with the model's
    if after is not None:  # the loop goes on: its next steps see their own gradients, unscaled by scaler.step
        for _, batch in mon.steps(data[:3]):
            loss = _loss(model, batch)
            scaler.scale(loss).backward()
            mon.observe(loss=loss)
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
            after.append(float(norm) / scaler.get_scale())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    mon.close()
    return mon, ev


@pytest.mark.parametrize("seed", [0, 3])
def test_an_overflow_in_both_executions_reproduces(tmp_path: Path, seed: int) -> None:
    mon, ev = _run(tmp_path, flaky=False, seed=seed)
    recorded = {r.step: r for r in mon.records}
    assert recorded[OVERFLOW_STEP].get(Metric.OVERFLOW) == 1.0  # the scaler skipped it in training
    rerun = ev["rerun"]
    assert rerun["reproduced"] is True, ev
    assert rerun["from_step"] == 20 and rerun["to_step"] >= FAULT_STEP > OVERFLOW_STEP
    assert ev["verdict"] != "hardware_suspect"


@pytest.mark.parametrize("seed", [0, 3])
def test_an_inf_in_one_execution_only_is_hardware_suspect(tmp_path: Path, seed: int) -> None:
    mon, ev = _run(tmp_path, flaky=True, seed=seed)
    assert {r.step: r for r in mon.records}[FAULT_STEP].get(Metric.OVERFLOW) == 1.0
    assert ev["verdict"] == "hardware_suspect", ev["summary"]
    m = ev["rerun"]["mismatch"]
    assert m["step"] == FAULT_STEP and m["metric"] == Metric.LOSS and m["recorded"] == "inf"


@pytest.mark.parametrize("seed", [0, 3])
def test_the_loops_next_step_after_a_diagnosis_is_unscaled(tmp_path: Path, seed: int) -> None:
    """A re-run ends on ``unscale_`` with no update: the scaler is left as the loop had it, so the next live step
    is unscaled and overflow-checked by ``scaler.step`` as always (it once updated on gradients 2^16 too large)."""
    by_hand: list[float] = []
    mon, _ = _run(tmp_path, flaky=True, seed=seed, after=by_hand)
    recorded = [r.get(Metric.GRAD_NORM) for r in mon.records if r.step >= 30]
    assert len(recorded) == len(by_hand) == 3
    assert recorded == pytest.approx(by_hand, rel=1e-4)
