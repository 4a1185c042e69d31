"""SIGTERM (a scheduler's preemption) or Ctrl-C during a checkpoint save stops the run like at any other moment.

Before, ``torch.save`` turned the ``SystemExit`` of the monitor's SIGTERM handler (or a ``KeyboardInterrupt``)
raised inside its writer into a ``RuntimeError`` ("unexpected pos ...") when its zip writer was closed on the
way out; the failsafe around the save took that for a failed save, logged "checkpoint failed (continuing)", and
the run trained on. Now the interrupt is raised as what it is: the process exits as on any SIGTERM, the run is
stored as ``interrupted``, and the checkpoint being written is complete or absent.

Each case is a real process (``save_signal_loop.py``) whose save at step 15 stops at one point of the save and
waits; the test sends the signal from outside once the point is reached, so every point is covered on every
machine.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_support import report

from stabmon.checkpoints import REGISTRY_NAME, CheckpointManager
from stabmon.collect.failsafe import Failsafe

HERE = Path(__file__).resolve().parent
SAVE_STEP = 15

POINTS = ["state", "write-first", "write-middle", "fsync", "replace", "replaced", "registry", "pruned"]


def ctrl_c_delivered() -> None:
    """In the child before exec: Ctrl-C at its default (a test runner started in the background ignores it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run(tmp_path: Path, point: str, signum: int) -> tuple[int, float, str]:
    """The loop, stopped at ``point`` of its step-15 save and sent ``signum`` there; (exit code, seconds from
    the signal to the exit, stderr)."""
    ckpt, marker = tmp_path / "ckpt", tmp_path / "marker"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(HERE / "save_signal_loop.py"), str(ckpt), f"sqlite:///{tmp_path / 'run.db'}", point,
           str(marker)]
    with subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=ctrl_c_delivered) as proc:
        try:
            deadline = time.monotonic() + 120
            while not marker.exists():
                assert proc.poll() is None, f"the loop ended before its save reached {point}: {proc.stderr.read()}"
                assert time.monotonic() < deadline, f"the save never reached {point}"
                time.sleep(0.02)
            sent = time.monotonic()
            proc.send_signal(signum)
            _, err = proc.communicate(timeout=60)
            return proc.returncode, time.monotonic() - sent, err
        finally:
            if proc.poll() is None:
                proc.kill()


def _stored(db: Path) -> tuple[str, list[int]]:
    with sqlite3.connect(db) as con:
        (key, status), = con.execute("SELECT key, status FROM runs").fetchall()
        steps = [s for (s,) in con.execute("SELECT DISTINCT step FROM steps WHERE run_key = ? ORDER BY step",
                                           (key,))]
    return status, steps


def _check_directory(ckpt: Path) -> list[int]:
    """Every checkpoint file there loads and holds a whole training state; no temporary file is left; the
    registry lists only files that exist with their recorded size. Returns the registered steps."""
    assert sorted(p.name for p in ckpt.iterdir() if p.name.endswith(".tmp")) == []
    for path in ckpt.glob("*.pt"):
        state = torch.load(path, map_location="cpu", weights_only=True)
        assert {"model", "optimizer", "monitor"} <= set(state), path.name
    manager = CheckpointManager(ckpt)
    assert (ckpt / REGISTRY_NAME).is_file()
    for info in manager.checkpoints:
        path = Path(info.path)
        assert path.is_file() and path.stat().st_size == info.nbytes, info
        state, problem = manager.validate(info)
        assert problem is None and state is not None, (info, problem)
    return [info.step for info in manager.checkpoints]


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS)
def test_sigterm_during_a_checkpoint_save_stops_the_run(tmp_path: Path, point: str) -> None:
    code, seconds, err = _run(tmp_path, point, signal.SIGTERM)
    status, steps = _stored(tmp_path / "run.db")
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert seconds < 30  # promptly: what is left is the close (flush, a final checkpoint, the store)
    assert "checkpoint failed" not in err, err[-3000:]  # the signal is not taken for a failed save
    assert status == "interrupted"
    assert steps == list(range(SAVE_STEP)), steps  # the save after step 14: not one step more
    registered = _check_directory(tmp_path / "ckpt")
    assert registered and max(registered) <= SAVE_STEP
    report(f"SIGTERM in a checkpoint save ({point})", exit_code=code, seconds_to_exit=seconds,
           steps_after_signal=len(steps) - SAVE_STEP, checkpoints=registered)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["write-middle", "registry"])
def test_ctrl_c_during_a_checkpoint_save_stops_the_run(tmp_path: Path, point: str) -> None:
    code, _, err = _run(tmp_path, point, signal.SIGINT)
    status, steps = _stored(tmp_path / "run.db")
    assert code != 0 and "KeyboardInterrupt" in err, err[-3000:]
    assert "checkpoint failed" not in err, err[-3000:]
    assert status == "interrupted"
    assert steps == list(range(SAVE_STEP)), steps
    _check_directory(tmp_path / "ckpt")


class _Interrupting:
    """The temporary file of a save, interrupted (``KeyboardInterrupt``) once ``after`` bytes are written."""

    def __init__(self, f: Any, after: int) -> None:
        self.f, self.after, self.written = f, after, 0

    def write(self, b: Any) -> int:
        if self.written >= self.after:
            raise KeyboardInterrupt
        n = self.f.write(b)
        self.written += n
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)

    def __enter__(self) -> _Interrupting:
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self.f.__exit__(*exc)


@pytest.mark.parametrize("through_failsafe", [False, True])
def test_an_interrupt_inside_torch_save_is_raised_as_the_interrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, through_failsafe: bool
) -> None:
    """In one process: ``torch.save`` interrupted half-way raises a RuntimeError of its own on the way out; the
    save raises the KeyboardInterrupt instead, the failsafe lets it through uncounted, and nothing is left."""
    manager = CheckpointManager(tmp_path, keep=2)
    state = {"model": {"w": torch.ones(64, 64)}, "optimizer": {"m": torch.zeros(64, 64)}}
    first = manager.save(state, step=5)
    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: _Interrupting(real_fdopen(fd, *a, **k), after=8192))
    safe = Failsafe()
    with pytest.raises(KeyboardInterrupt):
        if through_failsafe:
            safe.call("checkpoint", lambda: manager.save(state, step=10))
        else:
            manager.save(state, step=10)
    monkeypatch.undo()
    assert safe.errors["checkpoint"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [Path(first.path).name, REGISTRY_NAME]
    assert [c.step for c in CheckpointManager(tmp_path).checkpoints] == [5]


def test_the_failsafe_lets_an_interrupt_hidden_in_an_error_through() -> None:
    """Any library that turns an interrupt into an error of its own (the store's, a user's save) hides it no
    more; an error that is only an error is still caught and counted."""
    def hidden(interrupt: BaseException) -> None:
        try:
            raise interrupt
        finally:
            raise RuntimeError("cleanup failed")  # noqa: B012 - what torch's writer does on the way out

    safe = Failsafe()
    with pytest.raises(SystemExit) as stop:
        safe.call("store", lambda: hidden(SystemExit(143)))
    assert stop.value.code == 143
    with pytest.raises(KeyboardInterrupt):
        safe.call("checkpoint", lambda: hidden(KeyboardInterrupt()))
    assert safe.call("store", lambda: hidden(ValueError("bad"))) is None
    assert dict(safe.errors) == {"store": 1}
