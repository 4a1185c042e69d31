"""Hangs, each in its own process: a stuck step exits with the hang code only after the steps still waiting are
stored and the run is marked hung; a long but declared pause (``monitor.paused``) and work after the loop has
ended, or a slow checkpoint save by the monitor, are never taken for a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_support import count, report, stored_steps

from stabmon.collect.config import HANG_EXIT_CODE

HERE = Path(__file__).resolve().parent


def _run(tmp_path: Path, case: str) -> tuple[int, str, str, float]:
    url = f"sqlite:///{tmp_path / 'run.db'}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(HERE / "hang_loop.py"), url, case], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    return done.returncode, url, done.stdout + done.stderr, time.monotonic() - started


def _run_id(url: str) -> str:
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    with engine.connect() as conn:
        run = conn.execute(sa.text("select id from runs")).scalar_one()
    engine.dispose()
    return str(run)


def test_a_stuck_step_stores_what_is_pending_and_marks_the_run_before_exiting(tmp_path: Path) -> None:
    code, url, log, took = _run(tmp_path, "stuck")
    assert code == HANG_EXIT_CODE, log[-3000:]
    run = _run_id(url)
    stored = stored_steps(url, run)
    status = count(url, "select count(*) from runs where id = :r and status = 'hung'", r=run)
    hangs = count(url, "select count(*) from anomalies where kind = 'hang'")
    report("stuck step, exit 87", steps_stored=f"{len(stored)}/23", run_status="hung" if status else "not hung",
           hang_anomalies=hangs, process_s=round(took, 1))
    assert stored == list(range(23)), stored  # before: none (they waited in the buffer, flush_every 50)
    assert status == 1 and hangs == 1  # before: the run stayed running


@pytest.mark.parametrize("case", ["eval", "after", "checkpoint"])
def test_a_declared_pause_and_work_after_the_loop_are_not_hangs(tmp_path: Path, case: str) -> None:
    code, url, log, took = _run(tmp_path, case)
    assert code == 0 and "done" in log, log[-3000:]  # before: exit 87 after ~1.5 s of the 6 s pause
    run = _run_id(url)
    assert count(url, "select count(*) from anomalies where kind = 'hang'") == 0
    assert count(url, "select count(*) from runs where id = :r and status = 'finished'", r=run) == 1
    assert stored_steps(url, run) == list(range(40))
    report(f"6 s pause ({case}) with a 1.5 s hang deadline", exit_code=code, steps_stored="40/40",
           process_s=round(took, 1))
