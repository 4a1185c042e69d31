"""A monitored loop that is sent Ctrl-C or SIGTERM by itself in the middle of a step, for
test_fault_signal_in_step.py.

``python update_signal_loop.py CKPT_DIR DB_URL POINT SIGNAL [TIMES]`` trains up to 40 steps of the fault suite's
tiny model (two param groups, SGD written out one group at a time, a LambdaLR) with a checkpoint every 5 and no
``close()``, like the README's quick start. At step :data:`SIGNAL_STEP` the process sends itself ``SIGNAL``
(``TERM`` or ``INT``) ``TIMES`` times (default 1) at ``POINT``:

- ``update``: inside ``optimizer.step()``, after the first param group was updated and before the second;
- ``scheduler``: after ``optimizer.step()``, before ``scheduler.step()``;
- ``stall``: after ``optimizer.step()``, then the loop sleeps up to 60 s (a step that does not end);
- ``close``: the loop runs to its end and calls ``close()``, which is sent the signal as it ends the run in the
  store (as torchrun stops the other ranks of a job while they close);
- ``none``: no signal (the reference run).

Each run writes ``REF_DIR/model-<step>.pt`` (``REF_DIR`` is CKPT_DIR's sibling ``ref``): the model's weights at
the start of each step, to compare a checkpoint with. ``STABMON_TEST_SEED`` moves the weights,
``STABMON_TEST_THREADS`` sets torch's threads.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from fault_support import data, seeded_tiny

from stabmon.monitor import Monitor, MonitorConfig

SIGNAL_STEP = 12


class GroupByGroup(torch.optim.SGD):
    """Plain SGD applied one param group at a time, with a point between the groups (``between``)."""

    between: Any = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for i, group in enumerate(self.param_groups):
            if i == 1 and self.between is not None:
                self.between()
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-float(group["lr"]))


def main(ckpt: str, url: str, point: str, sig: str, times: int) -> None:
    torch.set_num_threads(int(os.environ.get("STABMON_TEST_THREADS") or torch.get_num_threads()))
    signum = {"TERM": signal.SIGTERM, "INT": signal.SIGINT}[sig]
    ref = Path(ckpt).parent / "ref"
    ref.mkdir(parents=True, exist_ok=True)
    model = seeded_tiny()
    opt = GroupByGroup([{"params": model.a.parameters()}, {"params": model.b.parameters()}], lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))

    def send() -> None:
        for _ in range(times):
            os.kill(os.getpid(), signum)

    mon = Monitor(model, opt, scheduler=scheduler, store=url, run_name="signal-in-step", checkpoint_dir=ckpt,
                  config=MonitorConfig(flush_every=5, checkpoint_every=5, hang_timeout=None))
    for step, x in mon.steps(data(40)):
        torch.save(model.state_dict(), ref / f"model-{step}.pt")
        print(f"step {step}", flush=True)
        opt.between = send if point == "update" and step == SIGNAL_STEP else None
        loss = model(x).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        if step == SIGNAL_STEP and point in ("scheduler", "stall"):
            send()
            if point == "stall":
                time.sleep(60)
        scheduler.step()
        opt.zero_grad()
    if point == "close":
        end_run = mon.outbox.close

        def signalled(status: str) -> None:
            send()
            end_run(status)

        mon.outbox.close = signalled  # type: ignore[method-assign]
        mon.close()


if __name__ == "__main__":
    main(*sys.argv[1:5], int(sys.argv[5]) if len(sys.argv) > 5 else 1)
