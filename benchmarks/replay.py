"""End-to-end replay throughput next to river's raw GaussianScorer on the same stream (one run, no
assertions).

    python benchmarks/replay.py [--steps 20000] [--seed 0] [--log FILE] [--runbook default] [--repeat 3]
                                [--clock wall|cpu]

* replay: :func:`stabmon.replay.replay` with the default detector suite and runbook engine, interventions
  simulated, over every StepRecord of the stream; throughput in metric samples per second (a sample is one
  metric value of one step);
* river: one ``river.anomaly.GaussianScorer`` per metric doing ``score_one`` + ``learn_one`` on every sample
  of the
  same stream, the floor any river-based detector sits on;
* the ratio replay / river (the target is >= 0.5).

Both are timed ``--repeat`` times, alternately, and each keeps its best time (as ``timeit`` does): on a shared
machine the slowest run measures the neighbours, not the code. ``--clock cpu`` times both with the process's
CPU time instead of the wall clock: on a machine whose cores are shared with other work, the CPU time a run
took is what the code costs, while the wall clock also counts the time it waited for a core.

The stream is a seeded synthetic fp16-like run (loss, grad norm, loss scale, overflow, lr, step time), or with
``--log`` any recorded run stabmon can import (e.g. the llm.c ``main.log`` of the real-runs folder).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def synthetic(n: int, seed: int) -> list:
    from stabmon.events import Metric, StepRecord

    rng = random.Random(seed)
    out, scale, clean = [], 65536.0, 0
    for s in range(n):
        # healthy dynamic loss scaling: an overflow every ~1000 steps halves the scale, 500 clean steps double
        # it (capped), so the scale hovers around its cap as in a healthy fp16 run
        overflow = 1.0 if rng.random() < 0.001 else 0.0
        clean = 0 if overflow else clean + 1
        scale = scale / 2 if overflow else (min(scale * 2, 2.0**20) if clean % 500 == 0 else scale)
        spike = 8.0 if rng.random() < 0.0005 else 1.0
        out.append(
            StepRecord(
                step=s,
                metrics={
                    Metric.LOSS: 3.0 + 2.0 * math.exp(-s / 3000) + rng.gauss(0, 0.02) + (spike > 1) * 1.5,
                    Metric.GRAD_NORM: math.exp(rng.gauss(math.log(0.3), 0.15)) * spike,
                    Metric.LOSS_SCALE: scale,
                    Metric.OVERFLOW: overflow,
                    Metric.LR: 3e-4,
                    Metric.STEP_TIME: 0.25 + rng.gauss(0, 0.005),
                },
            )
        )
    return out


def river_loop(records: list, clock=time.perf_counter) -> float:
    from river.anomaly import GaussianScorer

    scorers: dict[str, GaussianScorer] = {}
    t0 = clock()
    for r in records:
        for name, value in r.metrics.items():
            sc = scorers.get(name)
            if sc is None:
                sc = scorers[name] = GaussianScorer(grace_period=10)
            sc.score_one(None, value)
            sc.learn_one(None, value)
    return clock() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--log", type=Path, default=None, help="a recorded run to use instead of the synthetic one"
    )
    ap.add_argument("--runbook", default="default")
    ap.add_argument("--repeat", type=int, default=3,
                    help="alternate replay and river this many times and keep each one's best time, so a "
                         "busy machine slowing one of them down does not skew the ratio")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time with the wall clock or with this process's CPU time (see the module docstring)")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    from stabmon.replay.importers.sniff import import_file
    from stabmon.replay.replay import replay, simulated_pipeline

    records = import_file(args.log).records if args.log else synthetic(args.steps, args.seed)
    samples = sum(len(r.metrics) for r in records)
    t_replay = t_river = math.inf
    for _ in range(max(1, args.repeat)):
        pipeline, target = simulated_pipeline(runbook=args.runbook)  # fresh objects: every repeat does the same work
        t0 = clock()
        result = replay(records, pipeline=pipeline, target=target)
        t_replay = min(t_replay, clock() - t0)
        t_river = min(t_river, river_loop(records, clock))
    s = result.summary()
    print(
        f"stream: {len(records)} steps, {samples} metric samples "
        f"({args.log or f'synthetic seed {args.seed}'}; {args.clock} clock)"
    )
    print(
        f"replay (detectors + runbook {args.runbook!r}, simulated): {samples / t_replay:,.0f} samples/s "
        f"({len(records) / t_replay:,.0f} steps/s; {s['anomalies']} anomalies, {s['decisions']} decisions)"
    )
    print(f"river GaussianScorer score_one+learn_one:   {samples / t_river:,.0f} samples/s")
    print(f"ratio replay / river: {t_river / t_replay:.2f}x (target >= 0.5x)")


if __name__ == "__main__":
    main()
