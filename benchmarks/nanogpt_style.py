"""Monitored vs unmonitored step time of examples/nanogpt_style.py, measured in one run.

Both arms run the example's ``main()`` in this process: the same seed, data, schedule and checkpoint cadence,
the unmonitored arm with ``--no-monitor`` (the loop's own clipping in place of the monitor's). Runs alternate
A, B, A, B... so that drifts in machine load hit both; each arm's time per iteration is the process CPU time
(insensitive to other processes on a shared machine) and the wall time of the whole run divided by its
iterations, evaluation, checkpoints and the monitor's start (opening the store) included. The median ratio
B/A over the rounds is printed::

    python benchmarks/nanogpt_style.py --rounds 3 --iters 100
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from typing import Any

from stabmon.cli.demo import load_example


def timed(example: Any, args: list[str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one run of the example."""
    with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(io.StringIO()):
        cpu, wall = time.process_time(), time.perf_counter()
        code = example.main([*args, "--out-dir", f"{d}/out", "--db", f"sqlite:///{d}/s.db"])
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if code != 0:
        raise SystemExit(f"the example exited with {code}")
    return cpu, wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=100)
    a = p.parse_args(argv)
    example = load_example("nanogpt_style")
    common = ["--max-iters", str(a.iters), "--seed", "1337"]
    for arm in (["--no-monitor"], []):  # warm-up: imports (stabmon's store, migrations), allocator
        timed(example, [*common, "--max-iters", "10", *arm])
    cpu_ratios, wall_ratios = [], []
    for _ in range(a.rounds):
        base = timed(example, [*common, "--no-monitor"])
        mon = timed(example, common)
        cpu_ratios.append(mon[0] / base[0])
        wall_ratios.append(mon[1] / base[1])
        print(f"round: unmonitored {base[0] / a.iters * 1e3:.1f} ms CPU/iter, monitored {mon[0] / a.iters * 1e3:.1f} "
              f"ms CPU/iter; wall {base[1] / a.iters * 1e3:.1f} vs {mon[1] / a.iters * 1e3:.1f} ms/iter")
    print(f"nanogpt_style, {a.iters} iters x {a.rounds} rounds: monitored / unmonitored = "
          f"{statistics.median(cpu_ratios):.3f} (CPU time), {statistics.median(wall_ratios):.3f} (wall time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
