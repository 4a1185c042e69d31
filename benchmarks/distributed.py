"""Figures for distributed training, measured on real gloo ranks on CPU (the test scenarios, run here to print
numbers instead of asserting them):

  1. sharded vs unsharded norms: for DDP, FSDP1 (original and flat parameters) and FSDP2 on 2 and 4 ranks, the
     largest relative difference of the global and per-layer gradient norms (and embedding drift) from a
     single-process run on the same data, and of the final parameters (clipping binds on every step);
  2. straggler: the step at which a rank made 20 % slower is named, and the slowdown the anomaly reports;
  3. hang: how long after its last step each hung rank was reported (one stuck in a collective, one in
     Python), against the learned deadline.

    python benchmarks/distributed.py --repeats 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import test_monitor_hang as hang  # noqa: E402 - the scenarios live with their tests
import test_monitor_ranks as ranks  # noqa: E402
import test_monitor_sharded as sharded  # noqa: E402
import torch  # noqa: E402
from dist_support import exit_codes, run_ranks  # noqa: E402


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def norms() -> None:
    ref_metrics, ref_params = sharded._reference()
    names = [k for k in ref_metrics[0] if k.startswith(("grad_norm", "emb_")) and k != "grad_norm_local"]
    for size in (2, 4):
        results = run_ranks(sharded._every_kind, size, timeout=300)
        for kind in sharded.KINDS:
            worst_norm = worst_param = 0.0
            for metrics, params in (r[kind] for r in results):
                for got, want in zip(metrics, ref_metrics, strict=True):
                    worst_norm = max([worst_norm, *(_rel(got[n], want[n]) for n in names if n in got)])
                for n, p in params.items():
                    worst_param = max(worst_param, float(((p - ref_params[n]).abs().max()).item()))
            print(f"norms  {kind:10s} {size} ranks: max relative difference of {len(names)} norms "
                  f"{worst_norm:.2e}, max |param difference| {worst_param:.2e}")


def straggler(repeats: int) -> None:
    for i in range(repeats):
        anomalies, _ = run_ranks(ranks._run, ranks.RANKS, 40, 2, None, timeout=300)[0]
        found = [a for a in anomalies if a[0] == "straggler"]
        if not found:
            print(f"straggler run {i}: NOT named in 40 steps")
            continue
        _, step, message = found[0]
        print(f"straggler run {i}: named at step {step} (flush {step // ranks.FLUSH + 1}): {message}")


def hangs(repeats: int) -> None:
    for i in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            url = f"sqlite:///{Path(tmp) / 'stabmon.db'}"
            codes = exit_codes(hang._train, 2, url, "", timeout=120)
            for a in sorted((a for a in hang._hangs(url) if a.kind == "hang"), key=lambda a: a.message):
                where = "in a collective" if "all_reduce" in a.message else "in Python"
                print(f"hang run {i}: {a.message.split(':')[0]} ({where}) reported {a.score:.2f} s after its "
                      f"last step; deadline {a.threshold:.2f} s; exit codes {codes}")


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    norms()
    straggler(args.repeats)
    hangs(args.repeats)


if __name__ == "__main__":
    main()
