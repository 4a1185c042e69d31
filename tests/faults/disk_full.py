"""Run as a script: a store whose disk fills mid-run (``RLIMIT_FSIZE``: every write past the limit fails with
EFBIG after writing what fits, as on a full disk), then frees (``free``) or never frees (``never``).

Prints one JSON line of counts. Used by ``test_fault_store.py``; a subprocess, so the limit touches nothing else.
"""

from __future__ import annotations

import json
import math
import resource
import signal
import sys
import time

from stabmon.events import StepRecord
from stabmon.store import StoreConfig, open_store


def recs(start: int, stop: int) -> list[StepRecord]:
    return [
        StepRecord(s, {"loss": 1.0 / (s + 1), "grad_norm": math.sqrt(s)}, batch_index=s) for s in range(start, stop)
    ]


def main(url: str, spool_dir: str, mode: str) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    cfg = StoreConfig(spool_dir=spool_dir, flush_interval=0.02, retry_initial=0.05, retry_max=0.1, close_timeout=1.0)
    store = open_store(url, config=cfg)
    run = store.start_run(name="disk-full", environment={})
    store.write_steps(run_id=run, records=recs(0, 100))
    assert store.flush(20)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))  # the disk is full
    for chunk in range(10):
        store.write_steps(run_id=run, records=recs(100 + 30 * chunk, 130 + 30 * chunk))
        time.sleep(0.05)
    if mode == "free":
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        time.sleep(0.3)
        for chunk in range(3):  # and the run goes on
            store.write_steps(run_id=run, records=recs(400 + 30 * chunk, 430 + 30 * chunk))
    store.end_run(run_id=run, status="finished")
    flushed = store.flush(20 if mode == "free" else 0.5)
    store.close()
    stats = store.stats
    later = open_store(url, config=cfg)  # the next store on the same spool directory (the next run)
    run2 = later.start_run(name="next-run", environment={})
    later.write_steps(run_id=run2, records=recs(0, 20))
    later_flushed = later.flush(10 if mode == "free" else 0.5)
    later.close()
    print(
        json.dumps(
            {
                "run": run,
                "run2": run2,
                "flushed": flushed,
                "later_flushed": later_flushed,
                "later_quarantined": getattr(later.stats, "quarantined_lines", 0),
                "trained": 490 if mode == "free" else 400,
                "dropped_rows": stats.dropped_rows,
                "kept_rows": getattr(stats, "kept_rows", 0),
                "quarantined": getattr(stats, "quarantined_lines", 0),
                "failures": stats.failures,
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
