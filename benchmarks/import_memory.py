"""Peak memory of ``stabmon import`` on large logs: a CSV, a Megatron log, and one Megatron line repeated.

Three files of about ``--mb`` MB each are generated in a temporary directory:

- ``csv``: a W&B-style table, one row per step (step, loss, grad_norm, lr, tokens_per_sec);
- ``megatron``: one BigScience-style ``iteration N/ TOTAL | ... |`` line per step;
- ``megatron-repeat``: two iteration lines (1 and 2) repeated to the end, i.e. a restart on every other line;
- ``trainer_state``: a Hugging Face ``trainer_state.json``, one ``log_history`` entry per step (an evaluation
  entry every 500), with a bare ``NaN`` token now and then as the Trainer writes one.

Each is imported by ``python -m stabmon import FILE --run R --db sqlite:///<tmp>`` in its own subprocess
(waited for with ``os.wait4``, so ``ru_maxrss`` is that process's own peak); a tiny CSV is imported the same
way first to show the footprint of the imports themselves. Printed per file: peak RSS, wall time, steps
stored (counted in the database) and the run's config size. ``--baseline DIR`` runs the same imports with
``DIR`` (a checkout of another version of stabmon, e.g. ``git worktree add /tmp/base main``) first on
``PYTHONPATH``, and prints the ratio of the peaks. Target: peak RSS <= 500 MB for a 200 MB log.

    python benchmarks/import_memory.py --mb 200 --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MEGATRON = (
    " iteration {step:8d}/  500000 | consumed samples: {samples:12d} | elapsed time per iteration (ms): "
    "{ms:.1f} | learning rate: {lr:.3E} | global batch size:  2048 | lm loss: {loss:.6E} | loss scale: "
    "4096.0 | grad norm: {gnorm:.3f} | number of skipped iterations:   0 | number of nan iterations:   0 | "
    "samples per second: {sps:.3f} | TFLOPs: {tflops:.2f} |\n"
)


def write_csv(path: Path, mb: int) -> None:
    target = mb * 1_000_000
    with open(path, "w") as fh:
        fh.write("step,loss,grad_norm,lr,tokens_per_sec\n")
        step = 0
        while fh.tell() < target:
            fh.write(
                "".join(
                    f"{s},{2.0 + 1.0 / (s + 1):.6f},{0.5 + (s % 97) / 100:.4f},{6e-5 * (1 - s / 1e8):.6e},"
                    f"{150000 + s % 1000}\n"
                    for s in range(step, step + 10_000)
                )
            )
            step += 10_000


def write_megatron(path: Path, mb: int, *, repeat: bool) -> None:
    target = mb * 1_000_000
    with open(path, "w") as fh:
        step = 1
        while fh.tell() < target:
            lines = []
            for i in range(step, step + 10_000):
                s = 1 + i % 2 if repeat else i
                lines.append(
                    MEGATRON.format(
                        step=s,
                        samples=2048 * s,
                        ms=1500.0 + s % 50,
                        lr=6e-5,
                        loss=2.0 + 1 / s,
                        gnorm=0.3 + (s % 13) / 10,
                        sps=1.365,
                        tflops=150.0,
                    )
                )
            fh.write("".join(lines))
            step += 10_000


def write_trainer_state(path: Path, mb: int) -> None:
    target = mb * 1_000_000
    with open(path, "w") as fh:
        fh.write('{"best_metric": null, "epoch": 3.0, "global_step": 0, "log_history": [\n')
        step, first = 1, True
        while fh.tell() < target:
            parts = []
            for s in range(step, step + 10_000):
                grad = "NaN" if s % 9973 == 0 else f"{0.5 + (s % 97) / 100:.16f}"
                lr = 6e-5 * (1 - s / 1e8)
                parts.append(f'{{"epoch": {s / 1e5:.6f}, "grad_norm": {grad}, "learning_rate": {lr!r}, '
                             f'"loss": {2.0 + 1.0 / s:.4f}, "step": {s}}}')
                if s % 500 == 0:
                    parts.append(f'{{"epoch": {s / 1e5:.6f}, "eval_loss": {2.1 + 1.0 / s:.16f}, '
                                 f'"eval_runtime": 12.5, "step": {s}}}')
            fh.write(("" if first else ",\n") + ",\n".join(parts))
            first, step = False, step + 10_000
        fh.write('\n], "max_steps": 0, "total_flos": 0}\n')


def measure(path: Path, tmp: Path, pythonpath: str) -> dict[str, float | int | str]:
    """Import ``path`` into a fresh SQLite file in a subprocess; its own peak RSS, time and what was stored."""
    db = tmp / f"bench-{time.monotonic_ns()}.db"
    cmd = [sys.executable, "-m", "stabmon", "import", str(path), "--run", "bench", "--db", f"sqlite:///{db}", "--json"]
    env = {**os.environ, "PYTHONPATH": pythonpath}
    t0 = time.monotonic()
    with open(tmp / "out.txt", "w+b") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=out, stderr=subprocess.STDOUT)  # cwd: not on sys.path
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (RUSAGE_CHILDREN would be the max)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode(errors="replace")
    result: dict[str, float | int | str] = {"peak_mb": usage.ru_maxrss / 1024, "wall_s": time.monotonic() - t0}
    if proc.returncode:
        return {**result, "error": text.strip().splitlines()[-1][:300] if text.strip() else f"exit {proc.returncode}"}
    with sqlite3.connect(db) as conn:
        result["steps"] = conn.execute("select count(*) from steps").fetchone()[0]
        result["config_bytes"] = len(conn.execute("select config from runs").fetchone()[0])
    db.unlink()
    return result


def row(name: str, size_mb: float, r: dict[str, float | int | str]) -> str:
    if "error" in r:
        return f"| {name} | {size_mb:.0f} | {r['peak_mb']:.0f} | failed: {r['error']} | | |"
    return (
        f"| {name} | {size_mb:.0f} | {r['peak_mb']:.0f} | {r['wall_s']:.1f} | {r['steps']:,} | {r['config_bytes']:,} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=200, help="size of each generated log, MB")
    p.add_argument("--baseline", help="a checkout of another stabmon version to compare with")
    p.add_argument("--only", default="csv,megatron,megatron-repeat,trainer_state",
                   help="which files, comma-separated")
    args = p.parse_args()
    here = str(Path(__file__).resolve().parent.parent)
    arms = [("this", here)] + ([("baseline", str(Path(args.baseline).resolve()))] if args.baseline else [])
    with tempfile.TemporaryDirectory(prefix="stabmon-import-mem-") as d:
        tmp = Path(d)
        files = {"tiny csv": tmp / "tiny.csv"}
        files["tiny csv"].write_text("step,loss\n1,2.0\n2,1.9\n")
        writers = {
            "csv": lambda f: write_csv(f, args.mb),
            "megatron": lambda f: write_megatron(f, args.mb, repeat=False),
            "megatron-repeat": lambda f: write_megatron(f, args.mb, repeat=True),
            "trainer_state": lambda f: write_trainer_state(f, args.mb),
        }
        for name in args.only.split(","):
            suffix = {"csv": "csv", "trainer_state": "json"}.get(name, "log")
            files[name] = tmp / f"{name}.{suffix}"
            writers[name](files[name])
        results: dict[tuple[str, str], dict[str, float | int | str]] = {}
        for arm, path in arms:
            print(f"\n{arm} ({path})\n\n| file | MB | peak RSS MB | wall s | steps stored | run config bytes |")
            print("|---|---|---|---|---|---|")
            for name, f in files.items():
                results[arm, name] = measure(f, tmp, path)
                print(row(name, f.stat().st_size / 1e6, results[arm, name]), flush=True)
        if args.baseline:
            print("\npeak RSS, this / baseline:")
            for name in files:
                a, b = results["this", name], results["baseline", name]
                print(f"  {name}: {a['peak_mb']:.0f} / {b['peak_mb']:.0f} MB = {a['peak_mb'] / b['peak_mb']:.2f}")


if __name__ == "__main__":
    main()
