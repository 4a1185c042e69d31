"""Store throughput and training-thread cost, printed next to their targets (one run, no assertions).

    python benchmarks/store.py [--steps 25000] [--metrics 40] [--pg URL]

* rows/s the background writer sustains into SQLite (a temporary file) and PostgreSQL (a temporary database on
  the server named by --pg, ``$STABMON_TEST_PG_URL`` or the local default; skipped with a message if
  unreachable). A row is one metric value (plus one per step for the step itself).
* per-step cost on the training thread: the time ``Store.write_steps`` takes for one realistic StepRecord
  (~40 metrics), while the writer works in the background: median, mean and 99th percentile.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
import uuid

TARGET_ROWS_PER_S = 250_000
TARGET_STEP_US = 20.0
DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def make_records(n_steps: int, n_metrics: int) -> list:
    from stabmon.events import StepRecord

    rng = random.Random(0)
    names = ["loss", "grad_norm", "loss_scale", "lr", "step_time", "nonfinite"]
    names += [f"grad_norm/transformer.h.{i}" for i in range(n_metrics - len(names))]
    names = names[:n_metrics]
    out = []
    for step in range(n_steps):
        m = {n: rng.random() for n in names}
        if step % 997 == 0:
            m["loss"] = math.nan
        out.append(StepRecord(step=step, metrics=m, batch_index=step, time=1.7e9 + step))
    return out


def run_one(url: str, records: list) -> tuple[float, dict[str, float]]:
    """(rows/s sustained by the writer, training-thread µs per step: median, mean, p99)."""
    from stabmon.store import StoreConfig, open_store

    store = open_store(url, config=StoreConfig(flush_interval=0.05))
    run_id = store.start_run(name="bench", environment={})
    store.flush(30)
    rows0, costs = store.stats.rows_written, []
    t0 = time.perf_counter()
    for rec in records:
        a = time.perf_counter_ns()
        store.write_steps(run_id=run_id, records=[rec])
        costs.append(time.perf_counter_ns() - a)
    ok = store.flush(600)
    elapsed = time.perf_counter() - t0
    rows = store.stats.rows_written - rows0
    store.close()
    if not ok:
        raise RuntimeError("flush timed out")
    costs.sort()
    us = {
        "median": statistics.median(costs) / 1000.0,
        "mean": statistics.fmean(costs) / 1000.0,
        "p99": costs[int(len(costs) * 0.99)] / 1000.0,
    }
    return rows / elapsed, us


def _cost_line(label: str, us: dict[str, float]) -> str:
    return (
        f"{label} training thread: median {us['median']:.2f} us/step, mean {us['mean']:.2f}, "
        f"p99 {us['p99']:.2f} (target <= {TARGET_STEP_US:.0f}; mean and p99 include waits for the GIL "
        "while the writer thread builds rows)"
    )


def pg_database(admin_url: str):  # noqa: ANN201 - (url, drop) or raises
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    name = f"stabmon_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return make_url(admin_url).set(database=name).render_as_string(hide_password=False), drop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=25_000)
    p.add_argument("--metrics", type=int, default=40)
    p.add_argument("--pg", default=os.environ.get("STABMON_TEST_PG_URL", DEFAULT_PG))
    args = p.parse_args(argv)
    records = make_records(args.steps, args.metrics)
    print(
        f"{args.steps} steps x {args.metrics} metrics ({args.steps * (args.metrics + 1):,} rows per backend)"
    )

    with tempfile.TemporaryDirectory() as tmp:
        rate, cost = run_one(f"sqlite:///{os.path.join(tmp, 'bench.db')}", records)
    print(f"sqlite     writer: {rate:>12,.0f} rows/s   (target >= {TARGET_ROWS_PER_S:,})")
    print(_cost_line("sqlite    ", cost))

    try:
        from stabmon.store import upgrade

        url, drop = pg_database(args.pg)
    except Exception as exc:  # noqa: BLE001
        print(f"postgresql skipped: cannot reach {args.pg}: {type(exc).__name__}: {exc}".splitlines()[0])
        return 0
    try:
        upgrade(url)
        rate, cost = run_one(url, records)
        print(f"postgresql writer: {rate:>12,.0f} rows/s   (no target)")
        print(_cost_line("postgresql", cost))
    finally:
        drop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
