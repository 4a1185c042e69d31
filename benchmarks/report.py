"""Report size and build time for a long run, and whether its spikes survive downsampling (one run, no
assertions).

    python benchmarks/report.py [--steps 1000000] [--layers 8] [--buckets 1000]

Builds a synthetic run (loss, global and per-layer grad norms, lr, step time, tokens/s, activation norms) with
spikes injected at random steps and a few NaN steps, renders the HTML report and prints: the time to build the
drawable series and render the page, the page's size, points drawn vs points recorded, and how many injected
spikes are drawn at their exact step.
"""

from __future__ import annotations

import argparse
import random
import sys
import time


def make_frame(steps: int, layers: int, seed: int):  # noqa: ANN201 - polars DataFrame
    import polars as pl

    names = ["loss", "grad_norm", "lr", "step_time", "tokens_per_sec"]
    names += [f"grad_norm/h.{i}" for i in range(layers)] + [f"act_rms/h.{i}" for i in range(layers // 2)]
    step = pl.int_range(0, steps, eager=True)
    frames = []
    for k, name in enumerate(names):
        rng = random.Random(seed + k)
        pool = pl.Series(values=[rng.random() for _ in range(1000)])
        noise = pool.sample(steps, with_replacement=True, seed=seed + k)
        frames.append(pl.DataFrame({"seq": step, "step": step, "name": [name] * steps, "value": 1.0 + noise}))
    return pl.concat(frames), names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--buckets", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import polars as pl

    from stabmon.report import RunInfo, build_report, render_html

    df, names = make_frame(args.steps, args.layers, args.seed)
    rng = random.Random(args.seed)
    spikes = sorted(rng.sample(range(args.steps), 20))
    nans = sorted(rng.sample(range(args.steps), 5))
    is_spike = pl.col("step").is_in(spikes) & (pl.col("name") == "grad_norm")
    is_nan = pl.col("step").is_in(nans) & (pl.col("name") == "loss")
    df = df.with_columns(value=pl.when(is_spike).then(100.0).when(is_nan).then(float("nan")).otherwise("value"))
    t0 = time.perf_counter()
    data = build_report(df, [], run=RunInfo("bench", "bench"), buckets=args.buckets)
    t1 = time.perf_counter()
    page = render_html(data)
    t2 = time.perf_counter()
    drawn = sum(len(s.steps) + len(s.abandoned[0]) for c in data.charts for s in c.series)
    grad = next(s for c in data.charts for s in c.series if s.name == "grad_norm")
    kept = {st for st, v in zip(grad.steps, grad.values, strict=True) if v == 100.0}
    loss = next(s for c in data.charts for s in c.series if s.name == "loss")
    print(f"steps {args.steps}, metrics {len(names)}, values recorded {df.height}")
    print(f"build series {t1 - t0:.2f} s, render {t2 - t1:.2f} s")
    print(f"html size {len(page.encode()) / 1e6:.2f} MB")
    print(f"points drawn {drawn} = {drawn / df.height:.5f} of recorded")
    print(f"spikes drawn at their step {len(kept & set(spikes))}/{len(spikes)}; "
          f"non-finite loss values marked {len(loss.nonfinite)}/{len({s * args.buckets // args.steps for s in nans})} "
          f"(one mark per step bucket holding any; {len(nans)} NaN steps injected)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
