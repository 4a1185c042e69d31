"""What the skip_step guard costs on CPU: step-time ratio and peak-RSS overhead, one arm per process.

A 25M-parameter MLP stack (``--layers`` x Linear(``--width``, ``--width``) + GELU) trained with AdamW, clip 1.0,
in six arms, each in a fresh process so that its peak RSS is its own (not another arm's model already
resident):

  for ``fused`` AdamW (the zero-copy guard) and ``foreach`` AdamW (the preallocated-buffer fallback):
  (u) unmonitored, clipping with ``clip_grad_norm_(foreach=True)``;
  (m) monitored at the defaults (store=None);
  (g) monitored with the skip_step guard on (factor 5; no step is actually skipped).

The arms run in interleaved rounds (u, m, g, u, m, g, ...) so drifting machine load hits all of them; each
process reports the median ms/step of its timed blocks (wall and process CPU) and ``ru_maxrss``. Printed:
median ratios (m)/(u) and (g)/(u) per optimizer, and the peak-RSS difference as a share of the parameter and
optimizer-state bytes. Targets: guard step ratio <= 1.02 and <= 2% extra peak memory (fused).

    python benchmarks/guard.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ARMS = ("u", "m", "g")
OPTIMIZERS = ("fused", "foreach")
LABEL = {"u": "unmonitored", "m": "monitored, defaults", "g": "monitored + skip guard"}


def run_arm(arm: str, optimizer: str, *, width: int, layers: int, steps: int, block: int, threads: int) -> dict:
    """One arm in this process: build, warm up, time ``steps`` steps in blocks; peak RSS at the end."""
    import torch
    from torch import nn

    from stabmon.monitor import Monitor, MonitorConfig  # every arm imports it: equal import footprint

    torch.set_num_threads(threads)
    probe = nn.Linear(1, 1)  # every arm loads what a Monitor loads (same import footprint in its RSS)
    Monitor(probe, torch.optim.SGD(probe.parameters(), lr=0.1), store=None, detectors=False).close()
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **{optimizer: True})
    x = torch.randn(16, width, generator=torch.Generator().manual_seed(1))
    mon = None
    timer = _Timer()
    if arm != "u":
        mon = Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(clip=1.0, hang_timeout=None))
        if arm == "g":
            mon.overrides.skip_factor = 5.0
            guard = mon.signals.hooks.guard
            for name in ("decide", "before_update", "after_update"):
                setattr(guard, name, timer.wrap(getattr(guard, name)))

    def one_step() -> None:
        if mon is not None:
            mon.begin_step()
        loss = model(x).pow(2).mean()
        loss.backward()
        if mon is not None:
            mon.observe(loss=loss)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mon is not None:
            mon.end_step()

    for _ in range(block):
        one_step()
    wall, cpu = [], []
    timer.ns, thread0 = 0, time.thread_time_ns()
    for _ in range(max(1, steps // block)):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(block):
            one_step()
        wall.append((time.perf_counter() - t0) / block)
        cpu.append((time.process_time() - c0) / block)
    guard_share = timer.ns / max(1, time.thread_time_ns() - thread0)
    skipped = 0.0
    if mon is not None:
        mon.close()
        skipped = sum(r.metrics.get("skipped", 0.0) for r in mon.records)
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "arm": arm,
        "optimizer": optimizer,
        "wall_ms": statistics.median(wall) * 1e3,
        "cpu_ms": statistics.median(cpu) * 1e3,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "param_bytes": model_bytes,
        "optimizer_bytes": sum(t.numel() * t.element_size() for t in state),
        "params": sum(p.numel() for p in model.parameters()),
        "skipped": skipped,
        "guard_cpu_share": guard_share,
        "guard_us_per_step": timer.ns / 1e3 / (max(1, steps // block) * block),
    }


class _Timer:
    """This thread's CPU time spent inside wrapped calls."""

    def __init__(self) -> None:
        self.ns = 0

    def wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns += time.thread_time_ns() - t0

        return timed


def spawn(arm: str, optimizer: str, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--arm", arm, "--optimizer", optimizer,
        "--width", str(args.width), "--layers", str(args.layers), "--steps", str(args.steps),
        "--block", str(args.block), "--threads", str(args.threads),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(results: list[dict], rounds: int) -> None:
    first = results[0]
    state = first["param_bytes"] + next(r for r in results if r["arm"] == "u")["optimizer_bytes"]
    print(
        f"MLP {first['params'] / 1e6:.1f}M parameters, AdamW, clip 1.0; parameters + optimizer state "
        f"{state / 2**20:.0f} MiB; {rounds} interleaved rounds, one process per arm and round"
    )
    for optimizer in OPTIMIZERS:
        mine = [r for r in results if r["optimizer"] == optimizer]
        base = {i: r for i, r in enumerate(x for x in mine if x["arm"] == "u")}
        rss_u = statistics.median(r["peak_rss_bytes"] for r in base.values())
        for arm in ARMS[1:]:
            runs = [r for r in mine if r["arm"] == arm]
            wall = [r["wall_ms"] / base[i]["wall_ms"] for i, r in enumerate(runs)]
            cpu = [r["cpu_ms"] / base[i]["cpu_ms"] for i, r in enumerate(runs)]
            rss = statistics.median(r["peak_rss_bytes"] for r in runs)
            own = ""
            if arm == "g":
                plain = [r for r in mine if r["arm"] == "m"]
                rss_m = statistics.median(r["peak_rss_bytes"] for r in plain)
                alone = [r["cpu_ms"] / m["cpu_ms"] for r, m in zip(runs, plain, strict=True)]
                inside = statistics.median(r.get("guard_cpu_share", math.nan) for r in runs)
                us = statistics.median(r.get("guard_us_per_step", math.nan) for r in runs)
                own = (
                    f" (guard alone: CPU step ratio {statistics.median(alone):.3f} vs monitored defaults; its own "
                    f"CPU time {us:.0f} us/step = {inside * 100:.2f}% of the step; peak RSS "
                    f"{(rss - rss_m) / state * 100:+.1f}%)"
                )
            print(
                f"{optimizer:<8} {LABEL[arm]:<24} step ratio: wall {statistics.median(wall):.3f}, "
                f"CPU {statistics.median(cpu):.3f} ({statistics.median(r['wall_ms'] for r in runs):.1f} vs "
                f"{statistics.median(r['wall_ms'] for r in base.values()):.1f} ms/step); peak RSS "
                f"{(rss - rss_u) / 2**20:+.0f} MiB = {(rss - rss_u) / state * 100:+.1f}% of parameters + "
                f"optimizer state{own}; steps skipped: {sum(r['skipped'] for r in runs):.0f}"
            )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="skip_step guard cost on CPU, one arm per process")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    p.add_argument("--optimizer", choices=OPTIMIZERS, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help="also write every process's figures here")
    p.add_argument("--report", type=Path, help="print the summary of an earlier --json file and exit")
    args = p.parse_args(argv)
    if args.report is not None:
        results = json.loads(args.report.read_text())
        report(results, len(results) // (len(ARMS) * len(OPTIMIZERS)))
        return
    if args.arm is not None:
        one = run_arm(
            args.arm, args.optimizer, width=args.width, layers=args.layers, steps=args.steps,
            block=args.block, threads=args.threads,
        )
        print(json.dumps(one))
        return
    results = [spawn(arm, opt, args) for _ in range(args.rounds) for opt in OPTIMIZERS for arm in ARMS]
    report(results, args.rounds)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
