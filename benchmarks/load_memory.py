"""Peak memory of loading a checkpoint into a live run (``TrainingState.load``: a rollback's or a resume's).

A model of about ``--params`` million parameters (a stack of square ``Linear`` layers) and its Adam state (two
moments) are built on the CPU and trained one step; the checkpoint is the run's own training state, copied in
memory (what ``torch.load`` of its file returns). The load then runs in that same process, a fresh one per
measurement (``ru_maxrss`` is then the process's own peak). Printed: the resident set before the load, the
peak during it, and the peak above what was resident, in MiB. ``--baseline DIR`` measures DIR (a checkout of
another version of stabmon, e.g. ``git archive HEAD | tar -x -C /tmp/base``) the same way first.

    python benchmarks/load_memory.py --params 50 --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

CHILD = """
import copy, gc, resource, sys
import torch
from stabmon.monitor import Monitor, MonitorConfig

torch.manual_seed(0)
width = 2048
layers = max(1, round(float(sys.argv[1]) * 1e6 / (width * width + width)))
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
mon = Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(hang_timeout=None))
for _, x in mon.steps([torch.randn(4, width)]):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
state = copy.deepcopy(mon.training_state())
gc.collect()

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

before, peak_before = rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
mon.load_training_state(state)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
n = sum(p.numel() for p in model.parameters())
print(f"{n / 1e6:.1f}M parameters: resident before the load {before:.0f} MiB (peak so far {peak_before:.0f}), "
      f"peak during the load {peak:.0f} MiB, above the resident set {max(peak - before, 0.0):.0f} MiB "
      f"(the model's weights are {n * 4 / 2**20:.0f} MiB)")
mon.close()
"""


def measure(root: Path, params: float) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CHILD, str(params)], env=env, cwd=root, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return done.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=50.0, help="model size in millions of parameters")
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout of stabmon, measured first")
    args = parser.parse_args()
    if args.baseline is not None:
        print("baseline:", measure(args.baseline.resolve(), args.params))
    print("this tree:", measure(Path(__file__).resolve().parents[1], args.params))


if __name__ == "__main__":
    main()
