"""CLI tables piped into a file or another program do not wrap at 80 columns."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from stabmon.monitor import Monitor


def test_a_piped_table_keeps_each_row_on_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    name = "nanogpt-shakespeare-char-" + "-".join(["lr3e-4", "bs64", "block256", "accum5"] * 4)
    model = torch.nn.Linear(2, 1)
    Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=url, run_name=name).close()
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-m", "stabmon", "runs", "--db", url], capture_output=True, text=True,
                         env=env, check=True).stdout
    assert len(name) > 80 and any(name in line for line in out.splitlines())


def test_replay_numbers_rungs_from_one_as_the_trace_does(real_runs: Path) -> None:
    log = real_runs / "bigscience-chronicles" / "tr11-176B_spike-it31214-31251.log"
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-m", "stabmon", "replay", str(log), "--no-store"], capture_output=True,
                         text=True, env=env, check=True).stdout
    decisions = [line for line in out.splitlines() if "Decision" in line]
    assert decisions and all("rung 0)" not in line for line in decisions)
    assert any("rung 1)" in line for line in decisions)
