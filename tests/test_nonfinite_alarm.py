"""The nonfinite alarm: a NaN loss is flushed at the end of its own step, not at the next ``flush_every``, so the
runbook answers within steps; by construction (the weights are made NaN before step ``BAD``)."""

from __future__ import annotations

import os
from collections.abc import Callable
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

    def loss_at(step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if step == BAD:
            with torch.no_grad():
                model.weight.fill_(float("nan"))
        return (model(x) - y).pow(2).mean()

    return mon, _flushes(mon, opt, data, loss_at)


def _flushes(mon: Monitor, opt: torch.optim.Optimizer, data: list[tuple[torch.Tensor, torch.Tensor]],
             loss_at: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]) -> list[int]:
    """Train on ``data`` with the loss ``loss_at(step, x, y)``; how many records had been flushed after each step."""
    flushed = []
    for step, (x, y) in mon.steps(data):
        loss = loss_at(step, x, y)
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
        mon.end_step()
        flushed.append(len(mon.records))
    mon.close()
    return flushed


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


def _jump(tmp_path: Path, *, rise: float | None, at: int | None, steps: int = 100) -> list[int]:
    """``steps`` steps of a regression whose targets are 10x larger from step ``at`` on (None: never): the loss
    jumps there by construction. Returns how many records had been flushed after each step."""
    torch.manual_seed(SEED)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(SEED)
    data = [(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)) for _ in range(steps)]
    mon = Monitor(model, opt, store=None, detectors=False,
                  config=MonitorConfig(flush_every=20, flush_on_rise=rise, hang_timeout=None))
    return _flushes(mon, opt, data, lambda step, x, y: (model(x) - (10 * y if at is not None and step >= at else y))
                    .pow(2).mean())


def test_a_loss_that_jumps_is_flushed_at_its_own_step_and_a_steady_one_keeps_the_cadence(tmp_path: Path) -> None:
    jump = 27
    flushed = _jump(tmp_path, rise=1.5, at=jump)
    assert flushed[jump - 1] == 20 and flushed[jump] == jump + 1  # the jump's step flushed at its end
    cadence = [20 * ((s + 1) // 20) for s in range(100)]
    assert _jump(tmp_path, rise=1.5, at=None) == _jump(tmp_path, rise=None, at=jump) == cadence
    # a loss that stays up (100x) rings while the running means catch up, not for ever: the flushes with fewer
    # than 20 records waiting are the alarm's, and there are none in the last 40 steps
    flushes = [s for s in range(len(flushed)) if flushed[s] == s + 1]
    rang = [s for s, before in zip(flushes, [-1, *flushes], strict=False) if s - before < 20]
    assert rang[:2] == [jump, jump + 1] and rang[-1] < 60, (rang, flushed)


def test_the_rise_is_checked_and_a_bad_one_named() -> None:
    with pytest.raises(ValueError, match=r"^config.flush_on_rise must be > 1 or None, got 1.0$"):
        MonitorConfig(flush_on_rise=1.0).validate()
    with pytest.raises(ValueError, match=r"rise must be > 1"):
        NonfiniteAlarm(rise=0.5)
    alarm = NonfiniteAlarm(rise=2.0, warmup=2)
    for loss in (-1.0, -1.0, -1.0, -5.0, 3.0):  # a loss that is not positive (an RL objective): never a rise
        alarm.watch(loss)
    assert alarm.rang() is False


def test_a_replay_ends_its_blocks_where_the_live_alarm_flushed() -> None:
    """``replay(alarm=...)`` judges the recorded losses with the same alarm: a block ends at a NaN loss and, with
    the rise, at a jump, as the live flush did; without it, the cadence alone."""
    from stabmon.events import StepRecord
    from stabmon.replay.replay import replay, simulated_pipeline
    from stabmon.replay.simulate import Simulation

    losses = [2.0 + 0.01 * (s % 3) for s in range(60)]
    losses[27], losses[44] = 9.0, float("nan")
    records = [StepRecord(s, {Metric.LOSS: v}) for s, v in enumerate(losses)]

    class Blocks(Simulation):
        def __init__(self) -> None:
            super().__init__()
            self.ends: list[int] = []

        def begin_block(self, records):  # type: ignore[no-untyped-def]
            self.ends.append(records[-1].step)
            super().begin_block(records)

    def ends(alarm: tuple[bool, float | None]) -> list[int]:
        pipeline, target = simulated_pipeline(runbook=None, target=Blocks())
        replay(records, pipeline=pipeline, target=target, flush_every=20, alarm=alarm)
        return target.ends  # type: ignore[union-attr]

    assert ends((False, None)) == [19, 39, 59]
    assert ends((True, None)) == [19, 39, 44, 59]
    assert ends((True, 1.5)) == [19, 27, 44, 59]
