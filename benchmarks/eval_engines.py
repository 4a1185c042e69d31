"""``stabmon eval`` throughput, in runs per second, on the local process pool and on Ray (one run, no assertions
beyond "every engine gives the same tables").

    python benchmarks/eval_engines.py [--labels ../shared/data/real-runs/LABELS.csv] [--group-wandb]
                                      [--workers 1 2] [--no-ray] [--peers]

For each worker count it times :func:`stabmon.replay.eval.evaluate` with ``engine="local"`` (``--jobs`` N: N
spawned processes, 1: this process) and with ``engine="ray"`` on a local Ray instance of N CPUs. Ray's start
(``ray.init``: the raylet and its worker processes) is timed apart and reported beside the evaluation, because a
cluster pays it once, not per command; the local pool's start (spawning N processes that import stabmon) is
inside its time, as ``--jobs`` pays it on every command. Every engine's report is compared with the first one:
rows and summary must be equal.

Printed per line: the engine, the workers, the runs evaluated, the seconds, runs/s, the mean seconds of one
run's task on one worker (``seconds x workers / runs``) and the steps replayed per second; the local engine with
one worker (in this process) adds the CPU seconds per run, which a busy shared machine does not inflate: what a
cluster's estimate starts from.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_LABELS = Path(__file__).resolve().parents[2] / "shared" / "data" / "real-runs" / "LABELS.csv"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--labels", type=Path, default=DEFAULT_LABELS)
    ap.add_argument("--group-wandb", action="store_true", help="join W&B segments (as the real-runs corpus needs)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--peers", action="store_true", help="also run the peer rules (default: stabmon only)")
    args = ap.parse_args()

    from stabmon.replay.eval import count_runs, evaluate

    runs = count_runs(args.labels, group_wandb=args.group_wandb)
    print(f"{args.labels}: {runs} runs; {sys.platform}, python {sys.version.split()[0]}")
    print(f"{'engine':<7} {'workers':>7} {'runs':>5} {'seconds':>8} {'runs/s':>7} {'s/run/worker':>13} "
          f"{'steps/s':>9}  note")
    reference = None

    def timed(engine: object, workers: int, label: str, note: str = "") -> None:
        nonlocal reference
        t0, c0 = time.perf_counter(), time.process_time()
        report = evaluate(args.labels, engine=engine, jobs=workers, peers=args.peers,  # type: ignore[arg-type]
                          group_wandb=args.group_wandb)
        took, cpu = time.perf_counter() - t0, time.process_time() - c0
        if label == "local" and workers == 1:  # in this process: its CPU time is the runs' CPU time
            note = f"CPU {cpu / runs:.3f} s/run"
        steps = sum(r["steps"] for r in report.files if r["method"] == "stabmon")
        same = "" if reference is None else ("same tables" if (report.rows(), report.summary) == reference
                                             else "TABLES DIFFER")
        reference = reference or (report.rows(), report.summary)
        print(f"{label:<7} {workers:>7} {runs:>5} {took:>8.2f} {runs / took:>7.2f} {took * workers / runs:>13.3f} "
              f"{steps / took:>9.0f}  {'; '.join(x for x in (same, note) if x)}", flush=True)

    for n in args.workers:
        timed("local", n, "local")
    if args.no_ray:
        return
    if importlib.util.find_spec("ray") is None:
        print("ray: not installed (pip install 'stabmon[ray]')")
        return
    import ray

    from stabmon.replay.engines import RayEngine

    for n in args.workers:
        t0 = time.perf_counter()
        ray.init(num_cpus=n, include_dashboard=False, logging_level=logging.WARNING)
        start = time.perf_counter() - t0
        try:
            timed(RayEngine(workers=n), n, "ray", f"ray.init {start:.2f} s not included")
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
