"""A monitored loop for test_fault_hangs.py: ``python hang_loop.py DB_URL CASE``.

``stuck``: step 23 never ends (a rank spinning in its own code); ``eval``: a 6 s evaluation inside
``monitor.paused("eval")`` at step 10; ``after``: 6 s of work between the loop's end and ``close()``. Steps take
~20 ms and the watchdog's learned deadline is its 1.5 s floor, so each pause is four deadlines long. Prints
``done`` and exits 0 when the run ends normally; a hang exits with ``HANG_EXIT_CODE``.
"""

from __future__ import annotations

import sys
import time

import torch
from fault_support import Tiny, data

from stabmon.collect.config import HANG_EXIT_CODE, HangConfig, MonitorConfig
from stabmon.monitor import Monitor

PAUSE = 6.0
STUCK_AT = 23


def main(url: str, case: str) -> None:
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hang = HangConfig(factor=5.0, floor=1.5, learn_after=5, exit_code=HANG_EXIT_CODE)
    mon = Monitor(model, opt, store=url, run_name=case, detectors=False, mode=None,
                  config=MonitorConfig(flush_every=50, hang_timeout=60.0, hang=hang))
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
