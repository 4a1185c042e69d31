"""A step of the wall clock in the middle of a run (NTP, a VM resumed, an operator's ``date -s``) changes no
figure of ``stabmon goodput``.

Before, the ledger read every duration between steps from the steps' wall-clock end times: the clock stepped
back an hour mid-run gave a wall time of -3,585.6 s and a goodput of NaN, and a day forward booked 86,400 s as
"monitor" time (goodput 0.01%). Now the monitor times its own work between steps (``monitor_time``) and each
process's start-up (``startup_time``) on a monotonic clock, and the ledger reads the wall clock only between
two processes and for the run's closing (never below 0).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_support import data, report, seeded_tiny

from stabmon.events import Metric, StepRecord
from stabmon.goodput import LedgerInput, Timed, compute_ledger


def _steps(jump_at: int | None, jump: float) -> list[Timed]:
    """30 steps of 1 s, a 0.5 s flush before every 5th, a 2 s start-up; the wall clock jumps by ``jump`` s
    before step ``jump_at``."""
    out, now = [], 1000.0 + 2.0
    for s in range(30):
        metrics = {Metric.STEP_TIME: 1.0}
        if s == 0:
            metrics.update({Metric.SEGMENT_START: 1000.0, Metric.STARTUP_TIME: 2.0})
        elif s % 5 == 0:
            metrics[Metric.MONITOR_TIME] = 0.5
            now += 0.5
        if jump_at is not None and s == jump_at:
            now += jump
        now += 1.0
        out.append(Timed(seq=s, record=StepRecord(step=s, metrics=metrics, time=now)))
    return out


@pytest.mark.parametrize("jump", [-3600.0, 86_400.0, -5.0, 7.0])
def test_a_clock_step_inside_a_process_changes_no_figure(jump: float) -> None:
    plain = compute_ledger(LedgerInput(run_id="r", steps=_steps(None, 0.0), ended_at=1000.0 + 2 + 30 + 2.5 + 1))
    stepped = compute_ledger(LedgerInput(run_id="r", steps=_steps(13, jump),
                                         ended_at=1000.0 + 2 + 30 + 2.5 + 1 + jump))
    assert stepped.to_dict() == plain.to_dict()
    assert plain.wall_seconds == pytest.approx(2 + 30 + 2.5 + 1) and plain.goodput == pytest.approx(30 / 35.5)


def test_a_clock_step_between_processes_costs_at_most_its_size_and_never_goes_negative() -> None:
    steps = _steps(None, 0.0)
    second = steps[20].record  # a new process from step 20, its wall clock an hour behind
    restarted = StepRecord(step=20, metrics={**second.metrics, Metric.SEGMENT_START: second.time - 3600 - 4.0,
                                             Metric.STARTUP_TIME: 3.0}, time=second.time - 3600)
    later = [Timed(t.seq, StepRecord(step=t.record.step, metrics=t.record.metrics, time=t.record.time - 3600))
             for t in steps[21:]]
    ledger = compute_ledger(LedgerInput(run_id="r", steps=[*steps[:20], Timed(20, restarted), *later]))
    causes = {c.name: c.seconds for c in ledger.causes}
    assert all(v >= 0 for v in causes.values()) and 0 < ledger.goodput <= 1
    assert sum(causes.values()) == pytest.approx(ledger.wall_seconds)


@pytest.fixture
def jumping_clock(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``time.time`` as the process sees it, moved by ``offset[0]`` seconds (set it mid-run)."""
    offset = [0.0]
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + offset[0])
    return offset


def _run(tmp_path: Path, offset: list[float], jump: float) -> Any:
    import stabmon
    from stabmon.collect.config import MonitorConfig
    from stabmon.goodput import load_input
    from stabmon.store import open_store

    url = f"sqlite:///{tmp_path / 'run.db'}"
    model = seeded_tiny()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = stabmon.Monitor(model, opt, store=url, checkpoint_dir=str(tmp_path / "ckpt"),
                          config=MonitorConfig(flush_every=5, checkpoint_every=10, hang_timeout=None))
    with mon:
        for step, x in mon.steps(data(40)):
            if step == 20:
                offset[0] = jump
            time.sleep(0.01)
            loss = model(x).pow(2).mean()
            loss.backward()
            mon.observe(loss=loss)
            opt.step()
            opt.zero_grad()
    store = open_store(url)
    try:
        with store.session() as session:
            return compute_ledger(load_input(session=session, run_id=mon.run_id))
    finally:
        store.close()


@pytest.mark.parametrize("jump", [-3600.0, 86_400.0])
def test_a_live_run_whose_clock_steps_reports_what_it_did(jump: float, jumping_clock: list[float],
                                                          tmp_path: Path) -> None:
    ledger = _run(tmp_path, jumping_clock, jump)
    causes = {c.name: c.seconds for c in ledger.causes}
    assert 0.3 < ledger.wall_seconds < 60, ledger.to_dict()  # 40 steps of ~10 ms, whatever the clock did
    assert all(0 <= v < 60 for v in causes.values()) and 0.2 < ledger.goodput <= 1, ledger.to_dict()
    assert sum(causes.values()) == pytest.approx(ledger.wall_seconds)
    report("clock step mid-run", jump_s=jump, wall_s=round(ledger.wall_seconds, 2),
           goodput=round(ledger.goodput, 3), monitor_s=round(causes["monitor"], 2))
