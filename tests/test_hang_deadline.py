"""The hang deadline a user would pick, learned from the run: after a warm-up, ``factor`` x the slowest step, at
least ``HangConfig.floor`` (40 s), at most ``MonitorConfig.hang_timeout``; work outside the steps that the monitor
sees (its own saves, the frameworks' evaluations and checkpoints) gets the cap and is not learned; a declared
pause is no hang at all. Driven by an injected clock: nothing here depends on this machine's speed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stabmon.collect.config import HangConfig, MonitorConfig
from stabmon.collect.hangs import HangReporter, LoopActivity
from stabmon.detect.hang import HangWatchdog
from stabmon.events import Anomaly


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def watchdog(clock: Clock, **overrides: Any) -> HangWatchdog:
    """A watchdog configured as the monitor configures it (``start_watchdog``), defaults unless overridden."""
    config = MonitorConfig(hang=HangConfig(**overrides))
    h = config.hang
    return HangWatchdog(config.hang_timeout or 0.0, lambda a: None, clock=clock, factor=h.factor, floor=h.floor,
                        learn_after=h.learn_after, window=h.window, warmup=h.warmup, stacks=False)


def run_steps(dog: HangWatchdog, clock: Clock, seconds: list[float], first: int = 0) -> int:
    step = first
    for s in seconds:
        clock.now += s
        dog.beat(step)
        step += 1
    return step


def test_a_1s_step_run_names_a_frozen_rank_within_60_s_with_the_defaults() -> None:
    clock = Clock()
    dog = watchdog(clock)
    step = run_steps(dog, clock, [1.0] * 30)
    assert dog.deadline() == 40.0  # max(floor 40 s, 10 x 1 s)
    clock.now += 39.9
    assert dog.check() is None
    clock.now += 0.2
    found = dog.check()
    assert found is not None and found.step == step - 1 and found.threshold == 40.0
    # the worst case: the deadline, one poll of the watchdog, the wait for the other ranks' reports
    assert dog.deadline() + dog.poll + HangReporter.name_silent_after < 60.0


def test_warm_up_steps_are_timed_but_not_learned() -> None:
    clock = Clock()
    dog = watchdog(clock)
    # the first step (90 s: compilation) ends the first interval timed; the warm-up is the 5 intervals after it
    step = run_steps(dog, clock, [90.0, 60.0, 30.0, 20.0, 1.0, 1.0])
    assert dog.deadline() == 1800.0  # nothing learned yet: the cap
    step = run_steps(dog, clock, [1.0] * 19, first=step)
    assert dog.deadline() == 1800.0  # 19 learned: one short of learn_after
    run_steps(dog, clock, [1.0], first=step)
    assert dog.deadline() == 40.0  # the slow warm-up steps did not set it


def test_work_outside_the_steps_gets_the_cap_and_is_not_learned() -> None:
    clock = Clock()
    dog = watchdog(clock)
    step = run_steps(dog, clock, [1.0] * 30)
    dog.outside("checkpoint")
    clock.now += 330.0  # a 330 s checkpoint save by the monitor
    assert dog.check() is None and dog.deadline() == 1800.0
    dog.inside("checkpoint")
    clock.now += 0.5
    dog.beat(step)  # the rest of the step after the save: not a whole step, not learned
    assert dog.deadline() == 40.0
    dog.outside("evaluation")
    clock.now += 1800.5  # longer than the cap: a hung evaluation is still a hang
    found = dog.check()
    assert found is not None and "outside the steps: evaluation" in found.message


def test_a_330_s_declared_pause_is_no_hang_and_a_stuck_step_after_it_is() -> None:
    clock = Clock()
    dog = watchdog(clock)
    activity, published, exits = LoopActivity(), [], []
    report = HangReporter(rank=0, publish=published.extend, settle=lambda: None, exit_code=87, exit=exits.append,
                          quiet=activity.quiet)
    run_steps(dog, clock, [1.0] * 30)
    activity.pauses.append("eval")  # monitor.paused("eval")
    clock.now += 330.0
    found = dog.check()
    assert found is not None  # the watchdog's deadline passed ...
    report(found)
    assert published == [] and exits == []  # ... and the reporter knows it is a declared pause
    activity.pauses.remove("eval")
    dog.beat(29, learn=False)  # paused() re-arms the watchdog when it ends
    clock.now += 40.1
    stuck = dog.check()
    assert stuck is not None
    report(stuck)
    assert [a.kind for a in published] == ["hang"] and exits == [87]


def test_an_undeclared_slow_stretch_raises_the_deadline_for_good() -> None:
    clock = Clock()
    dog = watchdog(clock)
    step = run_steps(dog, clock, [1.0] * 30 + [120.0])  # an evaluation the loop did not declare, finished
    assert dog.deadline() == 1200.0
    run_steps(dog, clock, [1.0] * 2000, first=step)
    assert dog.deadline() == 1200.0  # it will come back: the deadline does not shrink below it (window None)
    windowed = watchdog(Clock(), window=100)
    wclock = Clock()
    windowed.clock = wclock
    step = run_steps(windowed, wclock, [1.0] * 30 + [120.0])
    run_steps(windowed, wclock, [1.0] * 200, first=step)
    assert windowed.deadline() == 40.0  # a window forgets it, as documented


@pytest.mark.parametrize(("hang", "message"), [
    (HangConfig(floor=0), "config.hang.floor must be > 0"),
    (HangConfig(window=0), "config.hang.window must be >= 1 or None"),
    (HangConfig(warmup=-1), "config.hang.warmup must be >= 0"),
    (HangConfig(learn_after=0), "config.hang.learn_after must be >= 1"),
])
def test_bad_hang_settings_name_the_field(hang: HangConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MonitorConfig(hang=hang)


def test_a_monitor_checkpoint_save_is_outside_the_steps(tmp_path: Path) -> None:
    """A real monitor: while its own save runs, the watchdog's deadline is the cap."""
    import torch

    from stabmon.monitor import Monitor

    model = torch.nn.Linear(2, 1)
    mon = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=None, detectors=False,
                  checkpoint_dir=str(tmp_path))
    seen: list[float] = []
    inner = mon.recovery.save_checkpoint

    def save(*args: Any, **kwargs: Any) -> Any:
        seen.append(mon._watchdog.deadline())
        return inner(*args, **kwargs)

    mon.recovery.save_checkpoint = save  # type: ignore[method-assign]
    mon.save_checkpoint()
    after = mon._watchdog.deadline()
    mon.close()
    assert seen == [mon.config.hang_timeout] and after == mon.config.hang_timeout  # (not learned yet either)


def _hang(message: str, step: int = 29, waited: float = 44.0) -> Anomaly:
    from stabmon.events import Severity

    return Anomaly(kind="hang", metric="step", step=step, score=waited, severity=Severity.ERROR, detector="hang",
                   message=message)


def test_a_rank_that_sent_no_report_is_named_the_culprit() -> None:
    from stabmon.runbook.hangs import hang_summary

    victim = ("rank 0: no step for 44 s after step 29 (...)\n\nstacks of every thread:\n"
              "Thread 0x1 (most recent call first):\n"
              "  File \"torch/autograd/graph.py\", line 8 in _engine_run_backward\n")
    silent = "rank 1: no hang report within 6 s of rank 0's alarm: stopped, frozen or dead"
    summary = hang_summary([_hang(victim), _hang(silent)])
    assert summary is not None and summary["culprit"] == 1 and "no hang report" in summary["why"]
    assert hang_summary([_hang(victim)])["culprit"] is None  # alone, rank 0 names nobody
