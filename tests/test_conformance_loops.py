"""The conformance matrix on the one-process loops: a plain loop drawing its batches through ``monitor.steps()``
with the monitor's own checkpoints, and a loop shaped like nanoGPT's ``train.py`` (its own ``iter_num``, its own
batches, its own checkpoint dict through ``stabmon.UserCheckpoints``). Every action a shipped runbook uses, forced
by an injected fault, then each event: the run goes on, a crash and a resume from the newest checkpoint, Ctrl-C
and a resume. See tests/conformance_support.py for the fault and the invariants."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conformance_support import (
    ACTIONS,
    EVENTS,
    Fault,
    Invariants,
    Probe,
    forced_runbook,
    live_state,
    tiny_data,
    tiny_loss,
    tiny_setup,
)

import stabmon
from stabmon.checkpoints import CheckpointManager
from stabmon.collect.config import AttentionConfig, MonitorConfig, WatchConfig

STEPS = 100
STOP_AT = 63  # where the crash or the Ctrl-C comes: after every forced action has been applied and judged
SEED = int(os.environ.get("STABMON_TEST_SEED", "0"))


class Crash(RuntimeError):
    """The loop's own failure (a node lost): the run ends as failed, and is resumed."""


def _config(flush_every: int = 5, *, watch: bool = True) -> MonitorConfig:
    """``watch``: the closer flushes after a warning (a checkpoint in their window flushes first)."""
    return MonitorConfig(clip=1.0, flush_every=flush_every, checkpoint_every=10, attention=AttentionConfig(every=5),
                         **({} if watch else {"watch": WatchConfig(steps=0)}))


# -- a plain loop -------------------------------------------------------------------------------------------
def _plain(tmp: Path, action: str, *, event: str, state: dict[str, Any] | None = None,
           fault: Fault | None = None, probe: Probe | None = None, flush_every: int = 5,
           watch: bool = True) -> tuple[Any, Any]:
    """Train to :data:`STEPS` (from ``state``, a checkpoint, when given); the event ends it early."""
    model, optimizer, scheduler = tiny_setup(SEED + (1 if state is not None else 0))
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    fault = fault or Fault()
    monitor = stabmon.Monitor(model, optimizer, scheduler=scheduler, store=f"sqlite:///{tmp / 'run.db'}",
                              runbook=forced_runbook(action), mode="apply", checkpoint_dir=str(tmp / "ckpt"),
                              config=_config(flush_every, watch=watch), run_name=f"plain-{action}", loss_fn=tiny_loss,
                              resume=state["monitor"] if state is not None else None)
    manager = monitor.checkpoints
    assert isinstance(manager, CheckpointManager)
    probe = probe or Probe(lambda: [c.path for c in manager.checkpoints], lambda: live_state(
        model=model, optimizer=optimizer, scheduler=scheduler, monitor=monitor))
    probe.state = lambda: live_state(model=model, optimizer=optimizer, scheduler=scheduler, monitor=monitor)
    try:
        with monitor:
            for step, batch in monitor.steps(tiny_data(), max_steps=STEPS):
                probe.step_start()
                if state is None and step == STOP_AT and event == "interrupt":
                    raise KeyboardInterrupt
                if state is None and step == STOP_AT and event == "resume":
                    raise Crash("the node went away")
                loss = fault(step, tiny_loss(model, batch))
                loss.backward()
                monitor.observe(loss=loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    except (KeyboardInterrupt, Crash):
        pass
    probe.step_start()  # a checkpoint written at close (Ctrl-C): the state the run would go on from
    return monitor, probe


def _resumed_state(path: str, action: str, *, scheduled: bool = True) -> dict[str, Any]:
    """What a resume from checkpoint ``path`` reconstructs, in fresh objects (nothing written anywhere);
    ``scheduled``: the loop has a scheduler object (nanoGPT writes its own schedule into the param groups)."""
    state = torch.load(path, weights_only=True, map_location="cpu")
    model, optimizer, scheduler = tiny_setup(SEED + 7)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduled:
        scheduler.load_state_dict(state["scheduler"])
    else:
        scheduler = None
    monitor = stabmon.Monitor(model, optimizer, scheduler=scheduler, store=None, runbook=forced_runbook(action),
                              mode="apply", config=_config(), resume=state["monitor"])
    try:
        return live_state(model=model, optimizer=optimizer, scheduler=scheduler, monitor=monitor)
    finally:
        monitor.close()


@pytest.mark.parametrize("event", EVENTS)
@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_plain_loop(action: str, event: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cell = Invariants(f"plain/{action}/{event}")
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        fault = Fault()
        monitor, probe = _plain(tmp_path, action, event=event, fault=fault)
        stopped = monitor.should_stop
        manager = monitor.checkpoints
        assert manager is not None
        if event != "continue" and not stopped:  # a resume from the newest checkpoint, to the end
            newest = manager.latest()
            assert newest is not None
            state = torch.load(newest.path, weights_only=True, map_location="cpu")
            cell.resumed(probe.at(newest.path), _resumed_state(newest.path, action))
            monitor, probe = _plain(tmp_path, action, event=event, state=state, fault=fault, probe=probe)
            manager = monitor.checkpoints
            assert manager is not None
        elif stopped:  # the run stopped itself: a resume from its stop checkpoint goes on to the end
            newest = manager.latest()
            assert newest is not None and newest.step == monitor.step
            state = torch.load(newest.path, weights_only=True, map_location="cpu")
            cell.resumed(probe.at(newest.path), _resumed_state(newest.path, action))
    files = [c.path for c in manager.checkpoints if Path(c.path).is_file()]
    assert cell.checkpoints(files) >= 2
    for path in files:  # every checkpoint still on disk is the state the run went on from when it was written
        if Probe.key(path) in probe.snapshots:
            cell.resumed(probe.at(path), _resumed_state(path, action))
    cell.store(f"sqlite:///{tmp_path / 'run.db'}", monitor.run_id, action=action, stopped=stopped)
    cell.quiet_log(caplog.records)


# -- a loop shaped like nanoGPT's train.py ------------------------------------------------------------------
def _lr_at(it: int) -> float:
    """nanoGPT's own schedule, written into the param groups each iteration: warm-up, then cosine."""
    import math

    warmup, decay, top, low = 10, STEPS, 3e-3, 3e-4
    if it < warmup:
        return top * (it + 1) / (warmup + 1)
    ratio = min(1.0, (it - warmup) / (decay - warmup))
    return low + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (top - low)


def _get_batch(it: int, micro: int) -> Any:
    """The loop samples its own batches (a seeded draw per iteration and micro-step: a resume draws the same)."""
    data = tiny_data(n=8, seed=1000 + 2 * it + micro)
    return data[0]


def _nanogpt(tmp: Path, action: str, *, event: str, resume: dict[str, Any] | None = None,
             fault: Fault | None = None, probe: Probe | None = None) -> tuple[Any, Probe]:
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    model, optimizer, _ = tiny_setup(SEED + (1 if resume is not None else 0))
    holder: dict[str, Any] = {}

    def save_checkpoint(step: int) -> str:
        checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": step,
                      "monitor": holder["monitor"].state_dict()}
        torch.save(checkpoint, path := os.path.join(out, f"ckpt-{step:06d}.pt"))
        return path

    checkpoints = stabmon.UserCheckpoints(str(out), save=save_checkpoint, keep=None)
    if resume is not None:
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
    fault = fault or Fault()
    monitor = holder["monitor"] = stabmon.Monitor(
        model, optimizer, store=f"sqlite:///{tmp / 'run.db'}", runbook=forced_runbook(action), mode="apply",
        config=_config(), checkpoints=checkpoints, run_name=f"nanogpt-{action}",
        resume=resume["monitor"] if resume is not None else None)

    def state() -> dict[str, Any]:
        return live_state(model=model, optimizer=optimizer, scheduler=None, monitor=monitor)

    probe = probe or Probe(lambda: [c.path for c in checkpoints.checkpoints], state)
    probe.state = state
    iter_num = monitor.step
    try:
        with monitor:
            while iter_num < STEPS:
                monitor.begin_step()  # (the first one saves the initial state)
                probe.step_start()
                for group in optimizer.param_groups:
                    group["lr"] = _lr_at(iter_num)
                if resume is None and iter_num == STOP_AT and event == "interrupt":
                    raise KeyboardInterrupt
                if resume is None and iter_num == STOP_AT and event == "resume":
                    raise Crash("the node went away")
                for micro in range(2):
                    loss = fault(iter_num, tiny_loss(model, _get_batch(iter_num, micro)))
                    monitor.observe(loss=loss)
                    (loss / 2).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                monitor.end_step()
                iter_num = monitor.step
                if monitor.should_stop:
                    break
    except (KeyboardInterrupt, Crash):
        pass
    probe.step_start()
    return monitor, probe


@pytest.mark.parametrize("event", EVENTS)
@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_nanogpt_shaped_loop(action: str, event: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cell = Invariants(f"nanogpt/{action}/{event}")
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        fault = Fault()
        monitor, probe = _nanogpt(tmp_path, action, event=event, fault=fault)
        if action == "diagnose":  # this loop hands no batch to the monitor: nothing to replay
            decided = [e.action for e in monitor.events if type(e).__name__ == "Decision"]
            cell.dropped(caplog.text, decided, "diagnose")
            cell.quiet_log(caplog.records)
            return
        stopped = monitor.should_stop
        checkpoints = monitor.checkpoints
        assert checkpoints is not None
        newest = checkpoints.latest()
        assert newest is not None
        if event != "continue" or stopped:
            cell.resumed(probe.at(newest.path), _resumed_state(newest.path, action, scheduled=False))
        if event != "continue" and not stopped:
            state = torch.load(newest.path, weights_only=True, map_location="cpu")
            monitor, probe = _nanogpt(tmp_path, action, event=event, resume=state, fault=fault, probe=probe)
            checkpoints = monitor.checkpoints
            assert checkpoints is not None
    files = [c.path for c in checkpoints.checkpoints if Path(c.path).is_file()]
    assert cell.checkpoints(files) >= 2
    for path in files:
        if Probe.key(path) in probe.snapshots:
            cell.resumed(probe.at(path), _resumed_state(path, action, scheduled=False))
    cell.store(f"sqlite:///{tmp_path / 'run.db'}", monitor.run_id, action=action, stopped=stopped)
    cell.quiet_log(caplog.records)


@pytest.mark.parametrize("action", ["rollback", "scale_lr"])
def test_a_checkpoint_between_flushes_holds_the_steps_not_flushed_yet(action: str, tmp_path: Path) -> None:
    """Checkpoints every 10 steps, flushes every 7 (and no closer flushes after the fault, whose window flushes
    before each checkpoint): a checkpoint is written with steps waiting for their flush.
    They go with it (read to the host, still waiting: the flush cadence, and every decision's timing, as without
    checkpoints), so the crashed run's resume flushes them first: every step is stored once."""
    from stabmon.store import open_store
    from stabmon.store.repo import load_steps

    cell = Invariants(f"plain-flush7/{action}/resume")
    fault = Fault()
    monitor, probe = _plain(tmp_path, action, event="resume", fault=fault, flush_every=7, watch=False)
    manager = monitor.checkpoints
    assert manager is not None
    newest = manager.latest()
    assert newest is not None
    state = torch.load(newest.path, weights_only=True, map_location="cpu")
    assert state["monitor"]["pending"], "the newest checkpoint was written between flushes"
    cell.resumed(probe.at(newest.path), _resumed_state(newest.path, action))
    monitor, probe = _plain(tmp_path, action, event="resume", state=state, fault=fault, probe=probe, flush_every=7,
                            watch=False)
    store = open_store(f"sqlite:///{tmp_path / 'run.db'}")
    try:
        with store.session() as session:
            steps = [r.step for r in load_steps(session=session, run_id=monitor.run_id)]
    finally:
        store.close()
    assert set(steps) == set(range(STEPS))  # every step is stored ...
    if action != "rollback":  # ... once, but those the crash made the resume train again (restart)
        again = set(range(newest.step, STOP_AT))
        assert sorted(steps) == sorted([*range(STEPS), *again]), sorted(steps)
    cell.store(f"sqlite:///{tmp_path / 'run.db'}", monitor.run_id, action=action)
