"""A monitored loop whose checkpoint directory is taken away mid-run, for test_fault_checkpoint_dir.py.

``python ckpt_loop.py CKPT_DIR DB_URL FAULT RUNBOOK`` trains 60 steps with a checkpoint every 5 and injects a
loss spike at step 40 (once). ``FAULT``: ``readonly`` (the checkpoint directory made read-only at step 30),
``deleted`` (deleted at step 30) or ``readonly-start`` (read-only before the monitor starts). ``RUNBOOK``:
``rollback`` (roll back and skip 5 batches) or ``stop`` (checkpoint and stop). Prints one JSON line: exit
code, the interventions' ``after`` facts, the step reached; exits with the monitor's exit code.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from fault_support import SpikeDetectors, Tiny, data

from stabmon.collect.config import MonitorConfig
from stabmon.events import InterventionRecord
from stabmon.monitor import Monitor
from stabmon.runbook import loads_runbook

LADDERS = {
    "rollback": "[{action: rollback, params: {lookback: 0, skip_batches: 5}, observe: 3}]",
    "stop": "[{action: checkpoint_and_stop, params: {reason: injected}}]",
}


def main(ckpt: str, url: str, fault: str, ladder: str) -> int:
    runbook = loads_runbook(f"name: ckpt\nmode: apply\ncooldown: 0\nrules:\n  - name: spike\n"
                            f"    when: {{kind: spike}}\n    ladder: {LADDERS[ladder]}\n")
    if fault == "readonly-start":
        Path(ckpt).mkdir()
        os.chmod(ckpt, 0o555)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(model, opt, store=url, detectors=SpikeDetectors(), runbook=runbook, mode="apply",
                  checkpoint_dir=ckpt, config=MonitorConfig(flush_every=5, checkpoint_every=5, hang_timeout=None))
    spiked = False
    for step, x in mon.steps(data(200), max_steps=60):
        if step == 30 and not spiked and fault != "readonly-start":
            if fault == "readonly":
                os.chmod(ckpt, 0o555)
            else:
                shutil.rmtree(ckpt)
        loss = model(x).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss + (1e6 if step == 40 and not spiked else 0.0))
        spiked = spiked or step == 40
        opt.step()
        opt.zero_grad()
    mon.close()
    after = [dict(e.after) for e in mon.events if isinstance(e, InterventionRecord)]
    print(json.dumps({"exit_code": mon.exit_code, "after": after, "step": mon.step,
                      "files": sorted(p.name for p in Path(ckpt).glob("*")) if Path(ckpt).is_dir() else None},
                     default=str))
    return mon.exit_code


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
