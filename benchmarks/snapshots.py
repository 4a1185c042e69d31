"""What the host-memory snapshot tier costs (``MonitorConfig.snapshots``): step time and memory, on vs off.

The same monitored loop (an MLP of ``--width``, AdamW, disk checkpoints every 100 steps) runs with snapshots off
and on (every ``--every`` steps, the last ``--keep`` kept), alternating in rounds so that the machine's drift hits
both alike, and prints the ratio of their median time per step, the time one snapshot takes, and the host memory
the snapshots hold against one copy of the model and optimizer::

    python benchmarks/snapshots.py
    python benchmarks/snapshots.py --width 2048 --every 10 --keep 2
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

from stabmon.collect.config import MonitorConfig, SnapshotConfig
from stabmon.monitor import Monitor


def run(width: int, steps: int, snapshots: SnapshotConfig, seed: int = 0) -> tuple[float, Monitor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                          nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = [torch.randn(32, width) for _ in range(steps)]
    with tempfile.TemporaryDirectory() as d:
        mon = Monitor(model, opt, store=None, detectors=False, checkpoint_dir=d,
                      config=MonitorConfig(checkpoint_every=100, hang_timeout=None, snapshots=snapshots))
        start = time.perf_counter()
        for _, x in mon.steps(data):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        seconds = time.perf_counter() - start
        mon.close()
    return seconds / steps, mon


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--peak-of", choices=("off", "on"), help=argparse.SUPPRESS)  # one arm alone, for its peak RSS
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.peak_of:
        tier = SnapshotConfig(every=args.every, keep=args.keep) if args.peak_of == "on" else SnapshotConfig()
        run(args.width, args.steps, tier)
        print(_high_water())
        return
    off, on = [], []
    mon = None
    for _ in range(args.rounds):
        off.append(run(args.width, args.steps, SnapshotConfig())[0])
        seconds, mon = run(args.width, args.steps, SnapshotConfig(every=args.every, keep=args.keep))
        on.append(seconds)
    assert mon is not None and mon.snapshots is not None
    state = sum(t.numel() * t.element_size() for t in mon.model.state_dict().values())
    state += sum(t.numel() * t.element_size() for s in mon.optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor))
    one = mon.snapshots.candidates()[0].nbytes
    t0 = time.perf_counter()
    for step in range(1, 11):
        mon.snapshots.take(step * args.every, mon.recovery.state.state_dict)
    per_snapshot = (time.perf_counter() - t0) / 10
    ratio = statistics.median(on) / statistics.median(off)
    print(f"snapshots every {args.every} steps, {args.keep} kept, MLP width {args.width}, {args.steps} steps x "
          f"{args.rounds} rounds, {args.threads} thread(s):")
    print(f"  median time per step: off {statistics.median(off) * 1e3:.2f} ms, on {statistics.median(on) * 1e3:.2f} "
          f"ms; ratio on/off {ratio:.3f}")
    print(f"  one snapshot: {per_snapshot * 1e3:.1f} ms to take (= {per_snapshot / args.every * 1e3:.2f} ms per step "
          f"at this cadence), {one / 1e6:.1f} MB ({one / state:.2f} x model + optimizer state, "
          f"{state / 1e6:.1f} MB); held: {args.keep} x {one / 1e6:.1f} MB = {args.keep * one / 1e6:.1f} MB of host "
          "memory")
    peaks = {arm: _peak(arm, args) for arm in ("off", "on")}
    print(f"  peak RSS, each arm alone in its own process: off {peaks['off'] / 1e6:.1f} MB, on "
          f"{peaks['on'] / 1e6:.1f} MB (+{(peaks['on'] - peaks['off']) / 1e6:.1f} MB)")


def _high_water() -> int:
    """This process's peak resident memory in bytes: ``VmHWM`` (its own address space's; ``ru_maxrss`` would carry
    the parent's peak over ``exec``), else ``ru_maxrss`` where there is no ``/proc``."""
    try:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux (bytes on macOS)


def _peak(arm: str, args: argparse.Namespace) -> int:
    """The peak resident memory of a process that runs one arm alone."""
    out = subprocess.run([sys.executable, __file__, "--peak-of", arm, "--width", str(args.width), "--steps",
                          str(args.steps), "--every", str(args.every), "--keep", str(args.keep), "--threads",
                          str(args.threads)], check=True, capture_output=True, text=True)
    return int(out.stdout.split()[-1])


if __name__ == "__main__":
    main()
