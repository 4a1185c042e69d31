"""A peer rank that dies in the middle of a joint action (two real gloo ranks, CPU): the survivor's rollback fails
with one line, no traceback, and the survivor trains on to the end with its monitor closed properly.

The ranks train alone here (no DDP): only the monitor's own collectives link them, so nothing but the monitor
could stop the survivor. Rank 1 is killed at the moment rank 0 calls it into a rollback; rank 0 then waits on the
joint actions' channel for a rank that is gone.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
from pathlib import Path

import pytest
import torch
from dist_support import Scripted, exit_codes
from torch import nn

from stabmon.collect.config import MonitorConfig
from stabmon.monitor import Monitor

pytestmark = pytest.mark.slow
STEPS = 12


class Lines(logging.Handler):
    """Every stabmon log record: its message, and whether it carries a traceback."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[str, bool]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.INFO:
            self.seen.append((record.getMessage(), record.exc_info is not None))


def _survive(rank: int, size: int, root: str) -> None:
    lines = Lines()
    logging.getLogger("stabmon").addHandler(lines)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = Monitor(model, opt, store=f"sqlite:///{root}/stabmon.db", detectors=False, mode="apply",
                  runbook=Scripted("rollback", {"lookback": 0, "onset_step": 4}, at=4, once=False),
                  checkpoint_dir=f"{root}/ckpt-rank{rank}",
                  config=MonitorConfig(flush_every=2, checkpoint_every=4, hang_timeout=None))
    if rank == 1:  # killed when rank 0 calls it in
        mon.flusher.joiners["rollback"] = lambda params: os.kill(os.getpid(), signal.SIGKILL)
    seen = []
    gen = torch.Generator().manual_seed(rank)
    for step, x in mon.steps([torch.randn(8, 4, generator=gen) for _ in range(STEPS)]):
        seen.append(step)
        loss = model(x).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
    mon.close()
    Path(root, "rank0.json").write_text(json.dumps({"seen": seen, "step": mon.step, "lines": lines.seen}))


def test_a_peer_killed_in_a_joint_rollback_leaves_the_survivor_one_line_and_its_run(tmp_path: Path) -> None:
    codes = exit_codes(_survive, 2, str(tmp_path), timeout=180)
    assert codes == [0, -signal.SIGKILL], codes
    got = json.loads((tmp_path / "rank0.json").read_text())
    assert got["seen"] == list(range(STEPS)) and got["step"] == STEPS  # trained on, alone, from where it was
    said = [m for m, _ in got["lines"]]
    gone = [m for m in said if "failed, another rank is gone" in m]
    assert len(gone) == 1 and gone[0].startswith("stabmon: rank 0: the joint action's gather failed"), said
    assert any("rollback" in m and "PeerLost" in m for m in said), said  # the executor's line: the rung failed
    assert not [m for m, traced in got["lines"] if traced], said  # no traceback in any stabmon line
    with sqlite3.connect(tmp_path / "stabmon.db") as conn:
        assert conn.execute("select status from runs").fetchall() == [("finished",)]
