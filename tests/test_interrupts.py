"""Ctrl-C, SIGTERM and an exit without close() end the run as ``interrupted`` with every trained step stored.

Each case is a real Python process running the README's quick-start loop (no ``with``, no ``close()``) that
interrupts itself at step 37; the database is read afterwards.
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

LOOP = textwrap.dedent("""
    import os, signal, sys
    import torch
    import stabmon

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = stabmon.Monitor(model, optimizer, store=sys.argv[1], run_name="interrupted-loop")
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for step, _ in monitor.steps(range(1000)):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        monitor.observe(loss=loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == 37:
            how = sys.argv[2]
            if how == "exit":
                sys.exit(0)
            if how == "crash, then sigterm while closing":  # as torchrun stops a rank whose peer died
                close = monitor.outbox.close
                def sigterm_then_close(status):
                    os.kill(os.getpid(), signal.SIGTERM)
                    close(status)
                monitor.outbox.close = sigterm_then_close
                raise RuntimeError("Connection reset by peer")
            os.kill(os.getpid(), signal.SIGINT if how == "sigint" else signal.SIGTERM)
""")


def ctrl_c_delivered() -> None:
    """In the child before exec: Ctrl-C at its default, so Python turns it into KeyboardInterrupt even where the
    test runner was started in the background (which ignores SIGINT, and a child inherits that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run(tmp_path: Path, how: str) -> tuple[int, str, int]:
    db = tmp_path / "runs.db"
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    proc = subprocess.run([sys.executable, str(script), f"sqlite:///{db}", how], capture_output=True, text=True,
                          preexec_fn=ctrl_c_delivered,
                          timeout=120)
    with sqlite3.connect(db) as con:
        (key, status), = con.execute("SELECT key, status FROM runs").fetchall()
        (steps,), = con.execute("SELECT count(DISTINCT step) FROM steps WHERE run_key = ?", (key,)).fetchall()
    return proc.returncode, status, steps


@pytest.mark.parametrize(("how", "code"), [
    ("sigint", None), ("sigterm", 128 + 15), ("exit", 0),
    ("crash, then sigterm while closing", -signal.SIGTERM),  # the close at exit finishes, then SIGTERM ends it
])
def test_an_interrupted_loop_keeps_its_steps_and_ends_interrupted(tmp_path: Path, how: str, code: int | None) -> None:
    returncode, status, steps = _run(tmp_path, how)
    assert status == "interrupted"
    assert steps == 38  # steps 0..37, the one interrupted included: it trained
    if code is not None:
        assert returncode == code
    else:
        assert returncode != 0  # KeyboardInterrupt


def test_a_handler_the_user_installed_is_left_alone() -> None:
    import signal

    import torch

    from stabmon.monitor import Monitor

    def mine(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        model = torch.nn.Linear(2, 1)
        monitor = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=None)
        assert signal.getsignal(signal.SIGTERM) is mine
        monitor.close()
        assert signal.getsignal(signal.SIGTERM) is mine
        monitor = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    monitor.close()


def test_a_failure_while_closing_for_ctrl_c_does_not_abort_the_close(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Leaving the ``with`` block on Ctrl-C closes the run as interrupted; a failure inside that close (a lost
    peer's collective, a full disk) is a failure to count, not the Ctrl-C again (before: the failsafe took it for a
    new interrupt, re-raised it, and the close stopped half-way: no run ended, no interrupt checkpoint)."""
    import sqlite3

    import torch

    from stabmon.monitor import Monitor, MonitorConfig

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, opt, store=f"sqlite:///{tmp_path / 'run.db'}", checkpoint_dir=str(tmp_path / "ckpt"),
                  config=MonitorConfig(flush_every=5, checkpoint_every=0, hang_timeout=None))

    def lost_peer() -> None:
        raise RuntimeError("Connection closed by peer")

    try:
        with mon:
            for step, x in mon.steps([torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
                                      for i in range(20)]):
                if step == 7:
                    mon.signals.buffer.drain = lost_peer  # type: ignore[method-assign]
                    raise KeyboardInterrupt
                loss = model(x).pow(2).mean()
                loss.backward()
                mon.observe(loss=loss)
                opt.step()
                opt.zero_grad()
    except KeyboardInterrupt:
        pass
    assert mon.errors["collect"] >= 1  # counted
    with sqlite3.connect(tmp_path / "run.db") as db:
        (status,) = db.execute("select status from runs").fetchone()
    assert status == "interrupted"
    assert [p.name for p in sorted((tmp_path / "ckpt").glob("*.pt"))] == ["ckpt-000000007.pt"]
