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

``--signals``: the signals with lead (second-moment ratio, attention logits, output logits, per-layer update
ratios), turned on and sampled every 10 steps (:data:`SIGNALS_ON`; they are off by default), judged by the shipped
default detector suite replayed over the run's records (its ``level`` detector holds ``attn_logit/*`` under 100,
its ``out_of_line`` detector each ``update_ratio/<layer>`` within 20x of the median layer's). Per scenario:
the median over seeds of ``lead`` = loss departure - the first ``warning`` (or worse) on a signal's metric, the
signal that fired first, the lead over the first ``error`` the same suite raises on any other metric (what a
runbook acts on today), and the false alarms (warnings on the signals' metrics) per 10k steps of the healthy runs
(``healthy`` and each scenario's own healthy reference). The loss *departs* at the first step >= ``--start``
whose loss is non-finite, > ``--loss-factor`` x the median of its ``--window`` previous values (a spike), or >
``--loss-factor`` x the lowest loss since ``--start`` (it turned up: a slow divergence has no spike). A run
whose loss never departs (it stalls instead) has no lead there; the second lead is over the loss *leaving its
healthy twin* (the median of its last 5 values > ``--loss-factor`` x the twin's at the same steps): where the
damage shows in the loss, spike or not. A second table does the same for the first warning on any metric but
the loss itself (every shipped detector: the grad norm's spikes, the loss scale, ... and the signals), with its
false alarms on the healthy runs. ``--real LABELS.csv`` (repeatable) replays a real corpus through the same suite
and counts its warnings outside the labelled incidents, per metric family: the false alarms there.

    python benchmarks/lead_time.py --signals --seeds 5 --real ../shared/data/real-finetunes/LABELS.csv
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import Counter
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
from stabmon.replay.tune import load_runs  # noqa: E402


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


SIGNALS = (Metric.MOMENT_RATIO, Metric.ATTN_LOGIT, Metric.LOGIT_MAX, Metric.LOGIT_LOGZ, Metric.UPDATE_RATIO_PREFIX)


SIGNALS_ON = {"moments": MomentConfig(every=10), "attention": AttentionConfig(every=10),
              "logits": LogitConfig(every=10), "updates": UpdateConfig(every=10)}
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


def replay(recs: list[StepRecord], start: int) -> tuple[list[tuple[int, str]], int | None, list[tuple[int, str]]]:
    """(step, metric) of each warning-or-worse anomaly on a signal's metric, the first error-or-worse step on
    any other metric, and (step, metric) of each warning-or-worse on any metric but the loss itself (the grad
    norm, the loss scale, ... included), replaying the shipped default suite over the records."""
    suite = DetectorSuite.from_config()
    fired, error, anywhere = [], None, []
    for r in recs:
        for a in suite.update(r):
            if a.step < start:
                continue
            if a.severity >= Severity.WARNING and a.metric != Metric.LOSS:
                anywhere.append((a.step, a.metric))
            if a.metric.startswith(SIGNALS):
                if a.severity >= Severity.WARNING:
                    fired.append((a.step, a.metric))
            elif a.severity >= Severity.ERROR and error is None:
                error = a.step
    return fired, error, anywhere


def departure(loss: list[tuple[int, float]], *, factor: float, window: int, start: int) -> int | None:
    """The first step >= ``start`` whose loss is non-finite, > ``factor`` x the median of the ``window`` previous
    finite losses, or > ``factor`` x the lowest finite loss from ``start`` on (see the module docstring)."""
    history: list[float] = []
    best = math.inf
    for step, v in loss:
        if step >= start:
            if not math.isfinite(v) or (history and v > factor * statistics.median(history)) or v > factor * best:
                return step
            best = min(best, v)
        if math.isfinite(v):
            history = (history + [v])[-window:]
    return None


def off_twin(loss: list[tuple[int, float]], twin: list[tuple[int, float]], *, factor: float, start: int,
             smooth: int = 5) -> int | None:
    """The first step >= ``start`` at which the run's loss (the median of its last ``smooth`` values) is non-finite
    or > ``factor`` x its healthy twin's at the same step: the damage shows in the loss, spike or not."""
    theirs = dict(twin)
    mine: list[float] = []
    ref: list[float] = []
    for step, v in loss:
        mine, ref = (mine + [v])[-smooth:], (ref + [theirs.get(step, math.nan)])[-smooth:]
        if step < start:
            continue
        if not math.isfinite(v):
            return step
        if len(mine) == smooth and statistics.median(mine) > factor * statistics.median(ref):
            return step
    return None


def signal_row(name: str, seeds: int, threads: int, how: dict[str, float]) -> dict[str, object]:
    """Leads (loss departure - first signal warning; the same against the loss leaving its healthy twin's), leads
    over today's first error, the signals that fired first, and the healthy runs' warnings and steps."""
    s = sc.scenario(name)
    start = int(how["start"])
    leads, over_twin, over_error, first, alarms, steps = [], [], [], [], 0, 0
    any_leads, any_twin, any_first, any_alarms, departed = [], [], [], 0, 0
    for seed in range(seeds):
        healthy = records(s.healthy_config(seed, threads=threads) if not s.healthy else s.config(seed, threads=threads))
        quiet = replay(healthy, start)
        alarms += len(quiet[0])
        any_alarms += len(quiet[2])
        steps += len(healthy)
        if not s.healthy:
            recs = records(s.config(seed, threads=threads))
            loss = [(r.step, r.metrics[Metric.LOSS]) for r in recs if Metric.LOSS in r.metrics]
            twin = [(r.step, r.metrics[Metric.LOSS]) for r in healthy if Metric.LOSS in r.metrics]
            depart = departure(loss, factor=how["loss_factor"], window=int(how["window"]), start=start)
            leaves = off_twin(loss, twin, factor=how["loss_factor"], start=start)
            fired, error, anywhere = replay(recs, start)
            departed += depart is not None
            if anywhere:
                any_first.append(anywhere[0][1])
                for out, ref in ((any_leads, depart), (any_twin, leaves)):
                    if ref is not None:
                        out.append(ref - anywhere[0][0])
            if fired:
                first.append(fired[0][1])
                for out, ref in ((leads, depart), (over_twin, leaves), (over_error, error)):
                    if ref is not None:
                        out.append(ref - fired[0][0])
        print(f"  {name} seed {seed}: leads {leads} over twin {over_twin} over error {over_error} "
              f"first {first[-1:] or '-'} healthy alarms {alarms}; any metric: leads {any_leads} "
              f"first {any_first[-1:] or '-'} healthy alarms {any_alarms}", flush=True)
    return {"leads": leads, "over_twin": over_twin, "over_error": over_error, "first": first, "alarms": alarms,
            "steps": steps, "any_leads": any_leads, "any_twin": any_twin, "any_first": any_first,
            "any_alarms": any_alarms, "departed": departed, "seeds": seeds}


def signals_main(names: list[str], seeds: int, threads: int, how: dict[str, float]) -> None:
    print(f"signals sampled every 10 steps; the loss departs: > {how['loss_factor']:g}x the median of the previous "
          f"{how['window']:g} losses or {how['loss_factor']:g}x the lowest since step {how['start']:g}")
    rows = [(n, signal_row(n, seeds, threads, how)) for n in names]
    print("| scenario | median lead over the loss's departure (steps) | per seed | over its leaving the healthy "
          "twin | per seed | over today's first error | first signal | healthy false alarms / 10k steps |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        leads, twin, over, first = r["leads"], r["over_twin"], r["over_error"], r["first"]
        print(f"| {name} | {_med(leads)} | {', '.join(map(str, leads)) or '-'} | {_med(twin)} | "
              f"{', '.join(map(str, twin)) or '-'} | {_med(over)} | {_top(first)} | {_rate(r['alarms'], r['steps'])} |")
    print("\nany metric but the loss (every shipped detector: grad norm, loss scale, ... and the signals above):")
    print("| scenario | seeds whose loss departs | median lead over the loss's departure (steps) | per seed | "
          "over its leaving the healthy twin | per seed | first metric | healthy false alarms / 10k steps |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        leads, twin = r["any_leads"], r["any_twin"]
        print(f"| {name} | {r['departed']}/{r['seeds']} | {_med(leads)} | "
              f"{', '.join(map(str, leads)) or '-'} | {_med(twin)} | {', '.join(map(str, twin)) or '-'} | "
              f"{_top(r['any_first'])} | {_rate(r['any_alarms'], r['steps'])} |")


def real_alarms(labels: str, pre: int = 100) -> tuple[int, int, int, Counter[str]]:
    """Runs, records, training steps spanned and warnings-or-worse per metric family (the name before its first
    ``/``) outside the labelled incidents (``step_start - pre`` to ``step_end``, as ``stabmon eval``), replaying
    the shipped default suite over each run of a corpus."""
    runs = load_runs(labels, group_wandb=True)  # the corpus's resumed W&B segments: one run each
    records = spanned = 0
    outside: Counter[str] = Counter()
    for run in runs:
        windows = [(lb.step_start - pre, lb.step_end) for lb in run.labels if lb.category == "numeric"]
        suite = DetectorSuite.from_config()
        records += len(run.records)
        if run.records:
            spanned += run.records[-1].step - run.records[0].step + 1
        for r in run.records:
            for a in suite.update(r):
                if a.severity >= Severity.WARNING and not any(lo <= a.step <= hi for lo, hi in windows):
                    outside[a.metric.split("/")[0]] += 1
    return len(runs), records, spanned, outside


def real_main(corpora: list[str]) -> None:
    print("\nthe real corpora: warnings outside the labelled incidents, per metric family")
    print("| corpus | runs | records | training steps spanned | warnings outside incidents (per 10k records; "
          "per 10k steps) |")
    print("|---|---|---|---|---|")
    for labels in corpora:
        n, records, spanned, outside = real_alarms(labels)
        found = "; ".join(f"`{k}` {v} ({1e4 * v / records:.2f}; {1e4 * v / spanned:.3f})"
                          for k, v in sorted(outside.items())) or "none"
        print(f"| {Path(labels).parent.name} | {n} | {records:,} | {spanned:,} | {found} |")


def _top(names: list[str]) -> str:
    return max(set(names), key=names.count) if names else "-"


def _rate(alarms: int, steps: int) -> str:
    return f"{1e4 * alarms / steps if steps else 0.0:.1f} ({alarms} in {steps})"


def _med(values: list[int]) -> str:
    return f"{statistics.median(values):g}" if values else "-"


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
    p.add_argument("--real", action="append", default=[], metavar="LABELS.csv",
                   help="--signals: also count the warnings outside labelled incidents on this corpus (repeatable)")
    args = p.parse_args(argv)
    names = [n for n in args.scenarios.split(",") if n]
    for name in names:
        if name not in sc.SCENARIOS:
            p.error(f"--scenarios: unknown scenario {name!r} (known: {', '.join(sc.SCENARIOS)})")
    for labels in args.real:
        if not Path(labels).is_file():
            p.error(f"--real: no such LABELS.csv: {labels}")
    if args.signals:
        signals_main(names, args.seeds, args.threads,
                     {"loss_factor": args.loss_factor, "window": args.window, "start": args.start})
        real_main(args.real)
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
