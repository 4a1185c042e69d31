"""Does the update norm ||Δθ||/||θ|| lead the grad norm? Per scenario of ``examples/scenarios.py``, the first step
at which each signal exceeds its own recent baseline by a stated factor, and the lead of the update norm.

Each run is monitored in observe mode (no runbook, nothing changed) with the update norm sampled on every step
(``MonitorConfig(updates=UpdateConfig(every=1))``); the grad norm is the monitor's (before clipping). A signal
*exceeds* at step t >= ``--start`` when it is non-finite or more than ``--factor`` times the median of its
``--window`` previous finite values. ``lead`` = grad-norm step - update-norm step (positive: the update norm
fired first; ``-`` where a signal never fired). The healthy control shows what fires without any trouble.
``--per-layer``: each signal's step is the earliest over its per-layer series (``grad_norm/<layer>``,
``update_ratio/<layer>``) instead of the global value.

    python benchmarks/lead_time.py                         # every scenario, seeds 0-2, factor 3
    python benchmarks/lead_time.py --scenarios bad-shard,lr-too-high --seeds 5 --factor 2
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "examples")]

import scenarios as sc  # noqa: E402
import tiny_gpt  # noqa: E402

from stabmon.collect.config import UpdateConfig  # noqa: E402
from stabmon.events import Metric  # noqa: E402
from stabmon.monitor import Monitor, MonitorConfig  # noqa: E402


def series(scenario: str, seed: int, threads: int) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of every grad-norm and update-norm series (global and per layer) of one run that is
    monitored but left alone."""
    config = sc.scenario(scenario).config(seed, threads=threads)
    made: list[Monitor] = []

    def factory(model: object, opt: object, sched: object, scaler: object = None) -> Monitor:
        made.append(Monitor(model, opt, scheduler=sched, scaler=scaler, store=None, runbook=None, mode="observe",  # type: ignore[arg-type]
                            config=MonitorConfig(clip=config.clip, updates=UpdateConfig(every=1))))
        return made[0]

    tiny_gpt.train(config, monitor=factory)
    records = list(made[0].records)
    names = sorted({n for r in records for n in r.metrics if n.startswith((Metric.GRAD_NORM, Metric.UPDATE_RATIO))})
    return {name: [(r.step, r.metrics[name]) for r in records if name in r.metrics] for name in names}


def onset(s: dict[str, list[tuple[int, float]]], signal: str, per_layer: bool, **how: float) -> int | None:
    """The first exceeding step of ``signal`` (global), or the earliest of its per-layer series."""
    names = [n for n in s if n.startswith(signal + "/")] if per_layer else [signal]
    steps = [st for n in names if (st := first_exceed(s[n], **how)) is not None]  # type: ignore[arg-type]
    return min(steps, default=None)


def first_exceed(values: list[tuple[int, float]], *, factor: float, window: int, start: int) -> int | None:
    """The first step >= ``start`` whose value is non-finite or > ``factor`` x the median of the ``window``
    previous finite values."""
    history: list[float] = []
    for step, v in values:
        if step >= start and (not math.isfinite(v) or (history and v > factor * statistics.median(history))):
            return step
        if math.isfinite(v):
            history = (history + [v])[-window:]
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(sc.SCENARIOS), help="comma-separated scenario names")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    p.add_argument("--factor", type=float, default=3.0, help="exceed the baseline by this factor")
    p.add_argument("--window", type=int, default=20, help="baseline: median of this many previous values")
    p.add_argument("--start", type=int, default=20, help="first step judged (after the baseline fills)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--per-layer", action="store_true", help="earliest over the per-layer series")
    args = p.parse_args(argv)
    names = [n for n in args.scenarios.split(",") if n]
    for name in names:
        if name not in sc.SCENARIOS:
            p.error(f"--scenarios: unknown scenario {name!r} (known: {', '.join(sc.SCENARIOS)})")
    print(f"first step > {args.factor:g}x the median of the previous {args.window} values (from step {args.start})"
          f"{', earliest layer' if args.per_layer else ''}; lead = grad-norm step - update-norm step")
    print(f"{'scenario':<18} {'seed':>4} {'grad_norm':>9} {'update':>7} {'lead':>5}")
    leads: dict[str, list[int | None]] = {}
    for name in names:
        for seed in range(args.seeds):
            s = series(name, seed, args.threads)
            g, u = (onset(s, m, args.per_layer, factor=args.factor, window=args.window, start=args.start)
                    for m in (Metric.GRAD_NORM, Metric.UPDATE_RATIO))
            lead = g - u if g is not None and u is not None else None
            leads.setdefault(name, []).append(lead)
            print(f"{name:<18} {seed:>4} {_s(g):>9} {_s(u):>7} {_s(lead):>5}", flush=True)
    print("summary (lead per seed):")
    for name, values in leads.items():
        print(f"  {name:<18} {', '.join(_s(v) for v in values)}")
    return 0


def _s(v: int | None) -> str:
    return "-" if v is None else str(v)


if __name__ == "__main__":
    sys.exit(main())
