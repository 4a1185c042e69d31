"""A monitored loop for test_fault_hangs.py: ``python hang_loop.py DB_URL CASE``.

``stuck``: step 23 never ends (a rank spinning in its own code); ``eval``: a 6 s evaluation inside
``monitor.paused("eval")`` at step 10; ``after``: 6 s of work between the loop's end and ``close()``;
``checkpoint``: the monitor's own checkpoint save at step 20 takes 6 s. Steps take
~20 ms and the watchdog's learned deadline is its 1.5 s floor, so each pause is four deadlines long. Prints
``done`` and exits 0 when the run ends normally; a hang exits with ``HANG_EXIT_CODE``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from fault_support import Tiny, data

from stabmon.checkpoints import UserCheckpoints
from stabmon.collect.config import HANG_EXIT_CODE, HangConfig, MonitorConfig
from stabmon.monitor import Monitor

PAUSE = 6.0
STUCK_AT = 23


def _slow_save(model: torch.nn.Module) -> Any:
    def save(step: int) -> Path:
        path = Path(tempfile.mkdtemp()) / f"ckpt-{step}.pt"
        torch.save({"model": model.state_dict()}, path)
        if step == 20:
            time.sleep(PAUSE)  # a slow filesystem
        return path

    return save


def main(url: str, case: str) -> None:
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hang = HangConfig(factor=5.0, floor=1.5, learn_after=5, exit_code=HANG_EXIT_CODE)
    ckpt = UserCheckpoints(Path(url.removeprefix("sqlite:///")).parent / "ckpt", save=_slow_save(model))
    mon = Monitor(model, opt, store=url, run_name=case, detectors=False, mode=None,
                  checkpoints=ckpt if case == "checkpoint" else None,
                  config=MonitorConfig(flush_every=50, hang_timeout=60.0, hang=hang,
                                       checkpoint_every=20 if case == "checkpoint" else 0))
    for step, x in mon.steps(data(40)):
        time.sleep(0.02)
        if case == "stuck" and step == STUCK_AT:
            while True:
                time.sleep(0.01)
        if case == "eval" and step == 10:
            with mon.paused("eval"):
                time.sleep(PAUSE)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    if case == "after":
        time.sleep(PAUSE)
    mon.close()
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
