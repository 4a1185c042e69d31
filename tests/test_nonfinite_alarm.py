"""The nonfinite alarm: a NaN loss is flushed at the end of its own step, not at the next ``flush_every``, so the
runbook answers within steps; by construction (the weights are made NaN before step ``BAD``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from stabmon.collect.config import MonitorConfig
from stabmon.collect.signals.alarm import NonfiniteAlarm
from stabmon.events import Metric
from stabmon.monitor import Monitor

SEED = int(os.environ.get("STABMON_TEST_SEED", "0"))
BAD = 7


def _train(tmp_path: Path, *, alarm: bool, steps: int = 12, **monitor: object) -> tuple[Monitor, list[int]]:
    """``steps`` steps; the weights turn NaN before step ``BAD``. Returns the monitor and, after each step, how
    many records had been flushed."""
    torch.manual_seed(SEED)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(steps)]
    mon = Monitor(model, opt, store=None, config=MonitorConfig(flush_every=20, flush_on_nonfinite=alarm,
                                                               hang_timeout=None), **monitor)
    flushed = []
    for step, (x, y) in mon.steps(data):
        if step == BAD:
            with torch.no_grad():
                model.weight.fill_(float("nan"))
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
        mon.end_step()
        flushed.append(len(mon.records))
    mon.close()
    return mon, flushed


def test_a_nan_loss_is_flushed_at_the_end_of_its_step(tmp_path: Path) -> None:
    mon, flushed = _train(tmp_path, alarm=True)
    assert flushed[:BAD] == [0] * BAD  # healthy steps keep the cadence
    assert flushed[BAD] == BAD + 1  # the NaN step and every step before it, at once
    assert [a.step for a in mon.anomalies if a.kind == "nonfinite" and a.metric == Metric.LOSS][0] == BAD
    # the loss stays NaN: each later step is flushed at its end too, so the 3-in-20 rule turns critical in 3 steps
    assert flushed[BAD + 1:] == list(range(BAD + 2, 13))


def test_off_or_with_a_finite_loss_the_cadence_holds(tmp_path: Path) -> None:
    _, flushed = _train(tmp_path, alarm=False)
    assert flushed == [0] * 12  # the first flush would be at step 20; close flushes the rest


def test_the_alarm_reads_numbers_and_host_tensors_and_tells_once() -> None:
    alarm = NonfiniteAlarm()
    for loss in (1.0, torch.tensor(0.5), torch.tensor([1.0, 2.0]), None):
        alarm.watch(loss)
    assert alarm.rang() is False
    alarm.watch(torch.tensor([1.0, float("inf")]))
    assert alarm.rang() is True and alarm.rang() is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_alarm_rings_once_the_copy_lands() -> None:
    alarm = NonfiniteAlarm()
    alarm.watch(torch.tensor(float("nan"), device="cuda"))
    torch.cuda.synchronize()  # (the test waits; the monitor never does)
    assert alarm.rang() is True
