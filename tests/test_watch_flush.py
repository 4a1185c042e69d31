"""Closer flushes while something is wrong (``MonitorConfig.watch``): after an anomaly at warning or above, the
monitor flushes every ``watch.flush_every`` steps for ``watch.steps`` steps, so the runbook answers within a few
steps of the evidence; a healthy run keeps its cadence. The trouble is made by construction: the loss is
multiplied by 1,000 on one step (``SPIKE``), which the default detectors flag on every seed."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from stabmon.collect.config import MonitorConfig, WatchConfig
from stabmon.events import Severity
from stabmon.monitor import Monitor

SEED = int(os.environ.get("STABMON_TEST_SEED", "0"))
SPIKE = 45
STEPS = 200


def _monitor(model: nn.Module, opt: torch.optim.Optimizer, watch: WatchConfig | None = None,
             flush_on_rise: float | None = 1.5, **monitor: object) -> Monitor:
    config = MonitorConfig(flush_every=20, hang_timeout=None, checkpoint_every=0, flush_on_rise=flush_on_rise, **(
        {"watch": watch} if watch is not None else {}))
    return Monitor(model, opt, **{"store": None, **monitor}, config=config,  # type: ignore[arg-type]
                   detectors={"step_time": {"enabled": False}})


def _steps(mon: Monitor, model: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, ...]],
           *, spike: bool) -> list[int]:
    """Train on ``batches`` (a hand-written loop, from the monitor's step on), the loss x1000 at ``SPIKE`` when
    ``spike``; returns the steps after which a flush ran (records reached the host)."""
    flushed, seen = [], len(mon.records)
    for x, y in batches:
        step = mon.step
        mon.begin_step()
        loss = (model(x) - y).pow(2).mean()
        if spike and step == SPIKE:
            loss = loss * 1000.0
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
        mon.end_step()
        if len(mon.records) != seen:
            seen = len(mon.records)
            flushed.append(step)
    return flushed


def _batches(n: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(SEED)
    return [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(SEED)
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _train(*, spike: bool, watch: WatchConfig | None = None, threads: int | None = None,
           flush_on_rise: float | None = 1.5, **monitor: object) -> tuple[Monitor, list[int]]:
    """A steady regression of ``STEPS`` steps, the loss x1000 at ``SPIKE`` when ``spike``: the monitor and the
    steps after which a flush ran."""
    if threads is not None:
        torch.set_num_threads(threads)
    model, opt = _model()
    mon = _monitor(model, opt, watch, flush_on_rise, **monitor)
    flushed = _steps(mon, model, opt, _batches(STEPS), spike=spike)
    mon.close()
    return mon, flushed


@pytest.mark.parametrize("threads", [None, 2])
def test_after_a_warning_the_flushes_come_closer_then_the_cadence_resumes(threads: int | None) -> None:
    previous = torch.get_num_threads()
    try:
        mon, flushed = _train(spike=True, runbook=None, threads=threads)
    finally:
        torch.set_num_threads(previous)
    warned = [a.step for a in mon.anomalies if a.severity >= Severity.WARNING]
    assert SPIKE in warned, [(a.kind, a.metric, a.step, a.severity) for a in mon.anomalies]
    assert flushed[:3] == [19, 39, SPIKE]  # the cadence, then the spike's own step (the loss alarm flushes it)
    closer = flushed[2:]
    gaps = [b - a for a, b in zip(closer, closer[1:], strict=False)]
    n = gaps.index(20)  # every 4 steps, then every 20 again
    assert set(gaps[:n]) == {4} and set(gaps[n:]) == {20}, flushed
    last_warned = min(s for s in flushed if s >= max(warned))  # the flush that saw the last warning
    assert last_warned + 56 <= closer[n] < last_warned + 60, (flushed, max(warned))  # 60 steps after it


def test_a_healthy_run_keeps_its_cadence() -> None:
    mon, flushed = _train(spike=False, runbook=None)
    assert [a for a in mon.anomalies if a.severity >= Severity.WARNING] == []
    assert flushed == list(range(19, STEPS, 20))


def test_off_the_cadence_holds_through_trouble() -> None:
    """Without the watch window only the loss alarm moves a flush: to the spike's own step, the cadence counted on
    from there; without the alarm's rise too, the cadence holds throughout."""
    _, flushed = _train(spike=True, runbook=None, watch=WatchConfig(steps=0))
    assert flushed == [19, 39, SPIKE, *range(SPIKE + 20, STEPS, 20)]
    _, flushed = _train(spike=True, runbook=None, watch=WatchConfig(steps=0), flush_on_rise=None)
    assert flushed == list(range(19, STEPS, 20))


def test_an_incident_a_resume_brings_back_keeps_the_flushes_close() -> None:
    """The default runbook proposes (nothing is applied): its incident stays open, so the flushes stay close; a
    monitor resumed from the state at step 100 flushes as closely from its first step (before: at its cadence
    until a warning came again)."""
    mon, flushed = _train(spike=True, runbook="default", mode="propose")
    assert mon.pipeline.engine.open_onset is not None
    assert set(b - a for a, b in zip(flushed[2:], flushed[3:], strict=False)) == {4}, flushed
    model, opt = _model()
    first = _monitor(model, opt, runbook="default", mode="propose")
    _steps(first, model, opt, _batches(100), spike=True)
    first.end_step()
    first.flush()
    state = first.training_state()
    assert first.pipeline.engine.open_onset is not None
    first.close()
    resumed = _monitor(model, opt, runbook="default", mode="propose")
    resumed.load_training_state(state)
    after = _steps(resumed, model, opt, _batches(12), spike=False)
    resumed.close()
    assert after == [103, 107, 111], after


@pytest.mark.parametrize(("field", "value", "message"), [
    ("steps", -1, "config.watch.steps must be >= 0, got -1"),
    ("flush_every", 0, "config.watch.flush_every must be >= 1, got 0"),
])
def test_bad_settings_are_one_line_errors(field: str, value: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MonitorConfig(watch=WatchConfig(**{field: value}))
    assert MonitorConfig.from_dict({"watch": {"steps": 30, "flush_every": 2}}).watch == WatchConfig(30, 2)


def test_a_replay_of_the_stored_run_makes_the_same_flushes(sqlite_url: str) -> None:
    """One pipeline: ``stabmon replay`` of a stored live run takes the closer flushes from its stored config and
    puts its blocks where the live flushes were (before: blocks of ``flush_every`` throughout)."""
    from stabmon.cli.replay import _live_alarm, _live_watch
    from stabmon.replay.replay import replay, simulated_pipeline
    from stabmon.replay.simulate import Simulation
    from stabmon.store import open_store
    from stabmon.store.repo import load_steps, run_config

    mon, flushed = _train(spike=True, runbook=None, store=sqlite_url, run_name="watched")
    with open_store(sqlite_url) as store, store.session() as session:
        records = load_steps(session=session, run_id=mon.run_id)
        config, _ = run_config(session=session, run_id=mon.run_id)
    assert _live_watch(config) == (60, 4) and _live_alarm(config) == (True, 1.5)

    class Blocks(Simulation):
        ends: list[int] = []

        def begin_block(self, records):  # type: ignore[no-untyped-def]
            self.ends.append(records[-1].step)
            super().begin_block(records)

    live = [*flushed, STEPS - 1] if flushed[-1] != STEPS - 1 else flushed  # (+ close()'s flush of the rest)
    cases = ((_live_watch(config), _live_alarm(config), live), ((0, 1), (False, None), list(range(19, STEPS, 20))))
    for watch, alarm, want in cases:
        target = Blocks()
        target.ends = []
        pipeline, target = simulated_pipeline(runbook=None, target=target)
        replay(records, pipeline=pipeline, target=target, flush_every=20, watch=watch, alarm=alarm)
        assert target.ends == want, (watch, target.ends, want)
    with pytest.raises(ValueError, match=r"replay.watch must be \(steps >= 0, flush_every >= 1\), got \(60, 0\)"):
        replay(records, flush_every=20, watch=(60, 0))
