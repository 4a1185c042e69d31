"""Ctrl-C or SIGTERM in the middle of a step: the step is interrupted before its update or after its end, never
between, so the interrupt checkpoint holds a state the run really had.

Before, the signal's exception was raised wherever the main thread was: inside ``optimizer.step()`` it cut the
update in two (one param group updated, the other not) and the close counted the step and checkpointed that
state; between ``optimizer.step()`` and ``scheduler.step()`` it checkpointed the step with its scheduler one
behind, and a resume ran the rest of the run on a shifted schedule. Now a signal that comes once the step's
``optimizer.step()`` began waits until the step ends (at most
:data:`~stabmon.collect.interrupts.HOLD_AT_MOST_S`; a second signal does not wait), and a close that finds the
update cut anyway writes no interrupt checkpoint and says so.

Each case is a real process (``update_signal_loop.py``) that sends itself the signal at a chosen point of step
12, by construction; the reference is the same loop without a signal.
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

HERE = Path(__file__).resolve().parent
SIGNAL_STEP = 12


def _run(folder: Path, point: str, sig: str, times: int = 1) -> tuple[int, float, str]:
    """The loop in ``folder``; (exit code, seconds it ran, stderr)."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(HERE / "update_signal_loop.py"), str(folder / "ckpt"),
           f"sqlite:///{folder / 'run.db'}", point, sig, str(times)]
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=folder, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc.returncode, time.monotonic() - started, proc.stderr


def _checkpoints(folder: Path) -> dict[int, dict[str, Any]]:
    """Every checkpoint file's content by the monitor step it holds."""
    out = {}
    for path in (folder / "ckpt").glob("*.pt"):
        held = torch.load(path, weights_only=True)
        out[int(held["monitor"]["step"])] = held
    return out


def _status(folder: Path) -> tuple[str, list[int]]:
    with sqlite3.connect(folder / "run.db") as con:
        (key, status), = con.execute("SELECT key, status FROM runs").fetchall()
        steps = [s for (s,) in con.execute("SELECT DISTINCT step FROM steps WHERE run_key = ? ORDER BY step",
                                           (key,))]
    return status, steps


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The weights at the start of each step of the same loop without a signal."""
    folder = tmp_path_factory.mktemp("reference")
    code, _, err = _run(folder, "none", "TERM")
    assert code == 0, err[-3000:]
    return folder / "ref"


def _same_weights(held: dict[str, torch.Tensor], reference: Path, step: int) -> bool:
    ref = torch.load(reference / f"model-{step}.pt", weights_only=True)
    return sorted(held) == sorted(ref) and all(torch.equal(held[k], ref[k]) for k in ref)


EXIT = {"TERM": 128 + signal.SIGTERM, "INT": -signal.SIGINT}
"""How the loop ends: SystemExit(143) from the monitor's SIGTERM handler; Python's own exit on an uncaught
KeyboardInterrupt (it re-sends SIGINT to itself)."""


@pytest.mark.parametrize(("point", "sig"), [("update", "TERM"), ("update", "INT"), ("scheduler", "TERM"),
                                            ("scheduler", "INT")])
def test_a_signal_after_the_update_began_waits_for_the_step_to_end(
        point: str, sig: str, reference: Path, tmp_path: Path) -> None:
    code, _, err = _run(tmp_path, point, sig)
    assert code == EXIT[sig], err[-3000:]
    status, steps = _status(tmp_path)
    assert status == "interrupted"
    assert steps == list(range(SIGNAL_STEP + 1)), "step 12 finished and was stored; nothing trained after it"
    held = _checkpoints(tmp_path)
    assert max(held) == SIGNAL_STEP + 1, f"the interrupt checkpoint holds steps {sorted(held)}"
    last = held[SIGNAL_STEP + 1]
    assert _same_weights(last["model"], reference, SIGNAL_STEP + 1), "the checkpoint holds a half-applied update"
    assert last["scheduler"]["last_epoch"] == SIGNAL_STEP + 1, "the checkpoint's scheduler is not at the step"
    for step, state in held.items():  # every checkpoint holds the weights the run had at its step
        assert _same_weights(state["model"], reference, step), f"checkpoint of step {step}"
    assert "stabmon: " not in err, err[-3000:]  # nothing logged as failed or cut
    report("signal-in-step", point=point, signal=sig, exit=code, checkpoint_step=max(held))


def test_a_second_signal_does_not_wait_and_a_cut_update_is_not_checkpointed(reference: Path, tmp_path: Path) -> None:
    code, _, err = _run(tmp_path, "update", "TERM", times=2)
    assert code == EXIT["TERM"], err[-3000:]
    assert "interrupted inside optimizer.step() of step 12: no interrupt checkpoint" in err
    status, steps = _status(tmp_path)
    assert status == "interrupted" and steps == list(range(SIGNAL_STEP + 1))
    held = _checkpoints(tmp_path)
    assert max(held) == 10, f"checkpoints of steps {sorted(held)}: a cut update was saved"
    assert all(_same_weights(state["model"], reference, step) for step, state in held.items())


def test_a_step_that_does_not_end_is_interrupted_after_the_hold_at_most(tmp_path: Path) -> None:
    from stabmon.collect.interrupts import HOLD_AT_MOST_S

    code, seconds, err = _run(tmp_path, "stall", "TERM")
    assert code == EXIT["TERM"], err[-3000:]
    assert seconds < HOLD_AT_MOST_S + 30, f"the loop ran {seconds:.0f} s: the held SIGTERM never took effect"
    assert _status(tmp_path)[0] == "interrupted"
    report("signal-in-stalled-step", seconds=round(seconds, 1))


def test_a_signal_while_the_run_closes_waits_until_it_is_closed(reference: Path, tmp_path: Path) -> None:
    """Before, close() gave SIGTERM back to its default first: a signal during the close killed the process on
    the spot, with the store's last rows still queued and the run left ``running``."""
    code, _, err = _run(tmp_path, "close", "TERM")
    assert code == EXIT["TERM"], err[-3000:]
    status, steps = _status(tmp_path)
    assert (status, steps) == ("finished", list(range(40))), "the close was cut"
