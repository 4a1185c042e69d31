"""A checkpoint load that fails part-way leaves every entry as it was: weights, optimizer state, GradScaler,
scheduler, and the monitor's own state (step, data position, overrides, skip guard, detectors and engine, ...).

Before, a failed load put back only the model, optimizer, scaler and scheduler (from a deep copy of them, twice
the memory of the training state at the worst moment), so a failure in the monitor's own entries left e.g. the
step counter at the checkpoint's and the weights at the live run's.

Each case injects a failure into one entry's load, by construction: the entry's ``load_state_dict`` raises once,
either before touching anything or after its real load has run (a half-done load). The model's failure is a
load pre-hook (the model is loaded last, and a failure inside its in-place copy cannot happen after the checks
that precede it). The training state is then compared with what it was before the load, bit for bit.
"""

from __future__ import annotations

import copy
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_support import data, seeded_tiny, test_threads  # noqa: F401 (test_threads: the fixture)

from stabmon.collect.checkpoint.restore import RESUME, ROLLBACK
from stabmon.monitor import Monitor, MonitorConfig

TOP = ("optimizer", "scaler", "scheduler")
MONITOR = ("step", "data", "overrides", "hooks", "follower", "checkpoints", "pipeline", "executor")
pytestmark = pytest.mark.usefixtures("test_threads")


class Injected(RuntimeError):
    """The failure the test injects."""


def _train(mon: Monitor, model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: Any, sched: Any,
           n: int) -> None:
    for _step, x in mon.steps(data(mon.step + n)):
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        mon.observe(loss=loss)
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()


@pytest.fixture
def run(tmp_path: Path) -> Any:
    """A monitor at step 20 with overrides in force and batches to skip, and the checkpoint it saved at step 10
    (read from its file: a load like a rollback's or a resume's; its registry names one more checkpoint, in
    another directory, which a resume adopts)."""
    model = seeded_tiny()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    mon = Monitor(model, opt, scaler=scaler, scheduler=sched, store=None, runbook="default", mode="propose",
                  checkpoint_dir=str(tmp_path / "ckpt"),
                  config=MonitorConfig(flush_every=5, checkpoint_every=10, hang_timeout=None))
    _train(mon, model, opt, scaler, sched, 10)
    saved = torch.load(mon.checkpoints.checkpoints[-1].path, weights_only=True)
    assert saved["monitor"]["step"] == 10
    registry = saved["monitor"]["checkpoints"]["checkpoints"]  # one more, elsewhere: a resume adopts it
    registry.append({**registry[0], "path": str(tmp_path / "elsewhere" / "ckpt-000000003.pt"), "step": 3})
    mon.overrides.lr_scale = 0.5
    mon.cursor.skip_range(30, 4)
    _train(mon, model, opt, scaler, sched, 10)
    assert mon.step == 20
    yield mon, saved
    mon.close()


def _entry(mon: Monitor, name: str) -> Any:
    states = mon.recovery.state.states
    return states[name] if name in TOP else states["monitor"].states[name]


def _fail_once(entry: Any, monkeypatch: pytest.MonkeyPatch, *, after: bool) -> None:
    """``entry.load_state_dict`` raises the first time it is called (after its real load with ``after``)."""
    real = entry.load_state_dict
    calls = []

    def load(state: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            if after:
                real(state)
            raise Injected("injected")
        real(state)

    monkeypatch.setattr(entry, "load_state_dict", load)


def _now(mon: Monitor) -> dict[str, Any]:
    """Everything a checkpoint holds, copied, and what a load changes besides: the run marked restored, a rewind
    of the data pending."""
    return {"state": copy.deepcopy(mon.training_state()), "restored": mon.run.restored,
            "cursor": (mon.cursor.state_dict(), mon.cursor._rewind),  # a rewind pending: the loop draws anew
            "registry": [c.path for c in mon.checkpoints.checkpoints]}


def _same(a: Any, b: Any) -> bool:
    """Equal bit for bit (NaN equal to NaN)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _differences(a: dict[str, Any], b: dict[str, Any], where: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b), key=str):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{where}{k}.")
        elif not _same(x, y):
            out.append(f"{where}{k}")
    return out


def _load(mon: Monitor, saved: dict[str, Any], reason: str) -> None:
    if reason == RESUME:
        mon.load_training_state(saved)
    else:
        mon.recovery.state.load(saved, reason=reason)


def _cases() -> list[Any]:
    from stabmon.collect.checkpoint.monitor_state import EXCLUDED

    out = []
    for reason in (RESUME, ROLLBACK):
        for name in (*TOP, *MONITOR, "model"):
            if f"monitor.{name}" in EXCLUDED[reason]:
                continue  # not loaded for this reason: nothing to fail
            for after in (False, True) if name != "model" else (False,):
                out.append(pytest.param(name, after, reason, id=f"{reason}-{name}-{'after' if after else 'before'}"))
    return out


@pytest.mark.parametrize(("name", "after", "reason"), _cases())
def test_a_load_that_fails_in_any_entry_leaves_every_entry_as_it_was(
    run: Any, monkeypatch: pytest.MonkeyPatch, name: str, after: bool, reason: str
) -> None:
    mon, saved = run
    model, opt = mon.model, mon.optimizer
    if name == "model":
        def refuse(*args: Any) -> None:
            raise Injected("injected")

        handle = model.register_load_state_dict_pre_hook(refuse)
    else:
        _fail_once(_entry(mon, name), monkeypatch, after=after)
    before = _now(mon)
    weights = [p.detach().clone() for p in model.parameters()]
    moments = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()}
    with pytest.raises(Injected):
        _load(mon, saved, reason)
    assert _differences(before, _now(mon)) == []
    # the ones a reader looks at first, spelled out
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert all(torch.equal(opt.state[next(model.parameters())][k], v) for k, v in moments.items())
    assert mon.step == 20 and mon.cursor.position == 20 and mon.overrides.lr_scale == 0.5
    assert sorted(mon.cursor.skip) == [30, 31, 32, 33] and mon.run.restored is False
    if name == "model":
        handle.remove()
    else:
        monkeypatch.undo()
    _load(mon, saved, reason)  # the same load, nothing injected: it goes through
    assert mon.step == 10 and mon.cursor.position == 10
    assert all(torch.equal(p, saved["model"][k]) for k, p in model.state_dict().items())


def test_a_state_that_does_not_fit_is_refused_before_anything_is_touched(run: Any) -> None:
    mon, saved = run
    before = _now(mon)
    param = next(iter(saved["optimizer"]["state"]))
    bad = {**saved, "optimizer": {**saved["optimizer"], "state": {
        **saved["optimizer"]["state"], param: {**saved["optimizer"]["state"][param], "exp_avg": torch.zeros(3)}}}}
    with pytest.raises(ValueError, match=r"state \d+\.exp_avg is \(3,\)"):
        mon.load_training_state(bad)
    with pytest.raises(ValueError, match="empty scaler state"):
        mon.load_training_state({**saved, "scaler": {}})
    with pytest.raises(ValueError, match="scheduler state that is list"):
        mon.load_training_state({**saved, "scheduler": []})
    assert _differences(before, _now(mon)) == []


@pytest.mark.parametrize("where", ["scheduler", "pipeline", "model"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_during_a_load_takes_effect_once_the_load_is_whole(
    run: Any, monkeypatch: pytest.MonkeyPatch, where: str, signum: int
) -> None:
    """The signal arrives inside one entry's load (sent by that load itself); the load finishes, then the
    interrupt is raised: the run is wholly at the checkpoint, never half."""
    mon, saved = run
    model = mon.model

    def on_sigterm(s: int, frame: Any) -> None:  # as the monitor's exit guard does
        raise SystemExit(128 + s)

    previous = {s: signal.signal(s, h) for s, h in ((signal.SIGINT, signal.default_int_handler),
                                                     (signal.SIGTERM, on_sigterm))}
    try:
        if where == "model":
            handle = model.register_load_state_dict_pre_hook(lambda *a: os.kill(os.getpid(), signum))
        else:
            entry = _entry(mon, where)
            real = entry.load_state_dict

            def load(state: Any) -> None:
                os.kill(os.getpid(), signum)
                real(state)

            monkeypatch.setattr(entry, "load_state_dict", load)
        with pytest.raises(KeyboardInterrupt if signum == signal.SIGINT else SystemExit):
            mon.load_training_state(saved)
        if where == "model":
            handle.remove()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    assert mon.step == 10 and mon.cursor.position == 10 and mon.overrides.lr_scale == 1.0
    assert all(torch.equal(p, saved["model"][k]) for k, p in model.state_dict().items())
