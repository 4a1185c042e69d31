"""A diagnosis leaves the optimizer hooks as it found them.

A framework such as Lightning takes the monitor's optimizer hooks off (``Monitor.remove_optimizer_hooks``) and
calls ``before_optimizer_step`` / ``after_optimizer_step`` itself. A diagnosis pauses the hooks while its
experiments train; it used to install them afterwards whatever they were before, so every later step ran the
pre-step work twice: with ``lr_scale=0.5`` the step was taken at a quarter of the schedule's LR, not half.

The loop is plain SGD (no momentum, no clipping): a step moves each weight by exactly ``-lr x grad``, so the LR a
step used is read back from the weights, bit for bit, on every machine and seed.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_support import data, seeded_tiny, test_threads  # noqa: F401 (test_threads: the fixture)

from stabmon.monitor import Monitor, MonitorConfig

LR = 0.05
pytestmark = pytest.mark.usefixtures("test_threads")


def _update(model: torch.nn.Module, opt: torch.optim.Optimizer, take_step: Any) -> float:
    """Run ``take_step()``; the LR its update used, exactly ``LR * 0.5`` or else an estimate from the weights."""
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
    take_step()
    opt.zero_grad()
    after = list(model.parameters())
    if all(torch.equal(p.detach(), b.add(g, alpha=-LR * 0.5)) for p, b, g in zip(after, before, grads, strict=True)):
        return LR * 0.5
    moved = torch.cat([(b - p.detach()).flatten() for p, b in zip(after, before, strict=True)])
    return float(moved.norm() / torch.cat([g.flatten() for g in grads]).norm())


def _framework_step(mon: Monitor, opt: torch.optim.Optimizer) -> None:
    """The update the way a framework that removed the hooks drives it."""
    mon.before_optimizer_step()
    opt.step()
    mon.after_optimizer_step()


@pytest.mark.parametrize("hooks_on", [False, True])
def test_a_diagnosis_leaves_the_optimizer_hooks_as_the_loop_set_them(tmp_path: Path, hooks_on: bool) -> None:
    model = seeded_tiny()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batches = data(40)
    with Monitor(model, opt, store=None, runbook="diagnose-first", mode="observe",
                 config=MonitorConfig(checkpoint_every=5, flush_every=5), checkpoint_dir=str(tmp_path),
                 loss_fn=lambda m, b: m(b).pow(2).mean(), sample_ids=lambda b: list(range(len(b)))) as mon:
        if not hooks_on:
            mon.remove_optimizer_hooks()
        mon.overrides.lr_scale = 0.5
        used: list[float] = []
        held: list[float] = []
        for step, x in mon.steps(batches):
            if step == 20:
                found = mon.diagnose(onset_step=12, step=18, metric="loss", max_batches=4, rtol=1e-4, recur=0.5)
                assert "rerun" in found.as_after(), found.summary  # the experiments ran (the hooks were paused)
            loss = model(x).pow(2).mean()
            loss.backward()
            mon.observe(loss=loss)
            take_step = opt.step if hooks_on else partial(_framework_step, mon, opt)  # hooks on: inside step()
            used.append(_update(model, opt, take_step))
            held.append(opt.param_groups[0]["lr"])
    assert used == [LR * 0.5] * len(batches)  # every step at half the schedule's LR, after the diagnosis too
    assert held == [LR] * len(batches)  # and the group holds the schedule's value between steps
