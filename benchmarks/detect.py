"""Detector throughput, printed next to river's raw GaussianScorer on the same stream (one run, no
assertions).

    python benchmarks/detect.py [--steps 20000] [--seed 0]

* updates/s of the default :class:`stabmon.detect.DetectorSuite` (one update = one StepRecord through every
  enabled detector) on a seeded synthetic stream shaped like a real fp16 run: loss, grad norm, loss scale,
  overflow, step time, one activation RMS and one embedding update ratio per step;
* updates/s of each detector alone, on its own metric of the same stream;
* updates/s of ``river.anomaly.GaussianScorer`` doing ``score_one`` + ``learn_one`` on the grad-norm column:
  the floor a river-based detector cannot beat, and the ratio the suite pays for its bookkeeping.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def make_stream(n: int, seed: int) -> list:
    from stabmon.events import Metric, StepRecord

    rng = random.Random(seed)
    out, scale, clean = [], 65536.0, 0
    for s in range(n):  # dynamic loss scaling: halve on overflow, double after 200 clean steps
        overflow = 1.0 if rng.random() < 0.005 else 0.0
        clean = 0 if overflow else clean + 1
        scale = scale / 2 if overflow else (scale * 2 if clean % 200 == 0 else scale)
        g = math.exp(rng.gauss(math.log(0.3), 0.15)) * (10.0 if rng.random() < 0.001 else 1.0)
        out.append(StepRecord(step=s, metrics={
            Metric.LOSS: 3.0 + 2.0 * math.exp(-s / 3000) + rng.gauss(0, 0.02),
            Metric.GRAD_NORM: g,
            Metric.LOSS_SCALE: scale,
            Metric.OVERFLOW: overflow,
            Metric.STEP_TIME: 0.5 + abs(rng.gauss(0, 0.01)),
            Metric.ACT_RMS_PREFIX + "h.0": 1.0 + 0.1 * rng.random(),
            Metric.EMB_UPDATE_PREFIX + "wte": 1e-4 * (1 + rng.random()),
        }))
    return out


def _rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def bench_suite(stream: list) -> tuple[float, int]:
    from stabmon.detect import DetectorSuite

    suite = DetectorSuite.from_config()
    t0 = time.perf_counter()
    found = sum(len(suite.update(r)) for r in stream)
    return _rate(len(stream), time.perf_counter() - t0), found


def bench_each(stream: list) -> list[tuple[str, str, float]]:
    from stabmon.detect import DETECTORS
    from stabmon.events import Metric

    metric_for = {"frozen_embedding": Metric.EMB_UPDATE_PREFIX + "wte", "drift": Metric.GRAD_NORM,
                  "loss_scale": Metric.LOSS_SCALE, "step_time": Metric.STEP_TIME}
    rows = []
    for name, cls in DETECTORS.items():
        metric = metric_for.get(name, Metric.GRAD_NORM)
        det = cls(metric)
        t0 = time.perf_counter()
        for r in stream:
            det.update(r.step, r.metrics)
        rows.append((name, metric, _rate(len(stream), time.perf_counter() - t0)))
    return rows


def bench_gaussian(stream: list) -> float:
    from river import anomaly

    from stabmon.events import Metric

    scorer = anomaly.GaussianScorer(grace_period=10)
    t0 = time.perf_counter()
    for r in stream:
        y = r.metrics[Metric.GRAD_NORM]
        scorer.score_one(None, y)
        scorer.learn_one(None, y)
    return _rate(len(stream), time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    stream = make_stream(args.steps, args.seed)
    gauss = bench_gaussian(stream)
    suite, found = bench_suite(stream)
    print(f"stream: {args.steps} steps, seed {args.seed}")
    print(f"{'river GaussianScorer (score+learn, 1 metric)':<48} {gauss:>12,.0f} updates/s")
    print(f"{'DetectorSuite defaults (all detectors)':<48} {suite:>12,.0f} updates/s"
          f"   {gauss / suite:5.1f}x slower than GaussianScorer; {found} anomalies")
    for name, metric, rate in bench_each(stream):
        print(f"  {name + ' on ' + metric:<46} {rate:>12,.0f} updates/s   {gauss / rate:5.1f}x")


if __name__ == "__main__":
    main()
