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

``--signals``: the signals with lead (second-moment ratio, attention logits, output logits), turned on and
sampled every 10 steps (:data:`SIGNALS_ON`; they are off by default), judged by the detector suite of
:data:`SIGNAL_DETECTORS` replayed over the run's records. Per scenario: the median over seeds of ``lead`` =
loss-spike step - the first ``warning`` (or worse) on a signal's metric, the signal that fired first, and the
false alarms (warnings on those metrics) per 10k steps of the healthy runs (``healthy`` and each scenario's own
healthy reference). The loss spike is the first step >= ``--start`` whose loss is non-finite or >
``--loss-factor`` x the median of its ``--window`` previous values.

    python benchmarks/lead_time.py --signals --seeds 5
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

from stabmon.collect.config import (  # noqa: E402
    AttentionConfig,
    LogitConfig,
    MomentConfig,
    UpdateConfig,
)
from stabmon.detect.suite import DetectorSuite  # noqa: E402
from stabmon.events import Metric, Severity, StepRecord  # noqa: E402
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


SIGNALS = (Metric.MOMENT_RATIO, Metric.ATTN_LOGIT, Metric.LOGIT_MAX)
SIGNAL_DETECTORS = {"spike.metrics": [Metric.GRAD_NORM, Metric.LOSS, Metric.MOMENT_RATIO_PREFIX + "*",
                                      Metric.ATTN_LOGIT_PREFIX + "*", Metric.LOGIT_MAX]}
"""The detector configuration measured: the default suite with the spike detector also on each signal's
per-tensor / per-layer / per-head metrics (not the shipped default: see docs/detectors.md)."""


SIGNALS_ON = {"moments": MomentConfig(every=10), "attention": AttentionConfig(every=10),
              "logits": LogitConfig(every=10)}
"""The signals measured, each sampled every 10 steps (the monitor's defaults leave them off)."""


def records(config: tiny_gpt.TrainConfig) -> list[StepRecord]:
    """The records of one run monitored with :data:`SIGNALS_ON` (observe mode, nothing changed)."""
    made: list[Monitor] = []

    def factory(model: object, opt: object, sched: object, scaler: object = None) -> Monitor:
        made.append(Monitor(model, opt, scheduler=sched, scaler=scaler, store=None, runbook=None, mode="observe",  # type: ignore[arg-type]
                            config=MonitorConfig(clip=config.clip, **SIGNALS_ON)))
        return made[0]

    tiny_gpt.train(config, monitor=factory)
    return list(made[0].records)


def warnings(recs: list[StepRecord], start: int) -> list[tuple[int, str]]:
    """(step, metric) of each warning-or-worse anomaly on a signal's metric, replaying the default suite."""
    suite = DetectorSuite.from_config(overrides=SIGNAL_DETECTORS)
    out = []
    for r in recs:
        for a in suite.update(r):
            if a.step >= start and a.severity >= Severity.WARNING and a.metric.startswith(SIGNALS):
                out.append((a.step, a.metric))
    return out


def signal_row(name: str, seeds: int, threads: int, how: dict[str, float]) -> tuple[list[int], list[str], int, int]:
    """Leads (loss-spike step - first signal warning), the signals that fired first, and the healthy runs'
    warnings and steps."""
    s = sc.scenario(name)
    leads, first, alarms, steps = [], [], 0, 0
    for seed in range(seeds):
        if not s.healthy:
            recs = records(s.config(seed, threads=threads))
            loss = [(r.step, r.metrics[Metric.LOSS]) for r in recs if Metric.LOSS in r.metrics]
            spike = first_exceed(loss, factor=how["loss_factor"], window=int(how["window"]), start=int(how["start"]))
            fired = warnings(recs, int(how["start"]))
            if spike is not None and fired:
                leads.append(spike - fired[0][0])
                first.append(fired[0][1])
        healthy = records(s.healthy_config(seed, threads=threads) if not s.healthy else s.config(seed, threads=threads))
        alarms += len(warnings(healthy, int(how["start"])))
        steps += len(healthy)
        print(f"  {name} seed {seed}: leads {leads} first {first[-1:] if first else '-'} healthy alarms {alarms}",
              flush=True)
    return leads, first, alarms, steps


def signals_main(names: list[str], seeds: int, threads: int, how: dict[str, float]) -> None:
    print(f"signals sampled every 10 steps; loss spike: > {how['loss_factor']:g}x the median of the previous "
          f"{how['window']:g} losses (from step {how['start']:g})")
    rows = [(n, *signal_row(n, seeds, threads, how)) for n in names]
    print("| scenario | median lead (steps) | leads per seed | first signal | healthy false alarms / 10k steps |")
    print("|---|---|---|---|---|")
    for name, leads, first, alarms, steps in rows:
        med = f"{statistics.median(leads):g}" if leads else "-"
        top = max(set(first), key=first.count) if first else "-"
        rate = 1e4 * alarms / steps if steps else 0.0
        print(f"| {name} | {med} | {', '.join(map(str, leads)) or '-'} | {top} | {rate:.1f} ({alarms} in {steps}) |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(sc.SCENARIOS), help="comma-separated scenario names")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    p.add_argument("--factor", type=float, default=3.0, help="exceed the baseline by this factor")
    p.add_argument("--window", type=int, default=20, help="baseline: median of this many previous values")
    p.add_argument("--start", type=int, default=20, help="first step judged (after the baseline fills)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--per-layer", action="store_true", help="earliest over the per-layer series")
    p.add_argument("--signals", action="store_true", help="lead of the signals at warning (see the docstring)")
    p.add_argument("--loss-factor", type=float, default=1.2, help="--signals: the loss spike's factor")
    args = p.parse_args(argv)
    names = [n for n in args.scenarios.split(",") if n]
    for name in names:
        if name not in sc.SCENARIOS:
            p.error(f"--scenarios: unknown scenario {name!r} (known: {', '.join(sc.SCENARIOS)})")
    if args.signals:
        signals_main(names, args.seeds, args.threads,
                     {"loss_factor": args.loss_factor, "window": args.window, "start": args.start})
        return 0
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
