"""examples/nanogpt_style.py: a nanoGPT-shaped loop attached in at most 15 lines, healthy and quiet, an LR jump
rescued through the loop's own checkpoints, and Ctrl-C then resume with every step and decision stored once."""

from __future__ import annotations

import io
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import tokenize
from pathlib import Path

import pytest
from test_interrupts import ctrl_c_delivered

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "nanogpt_style.py"
SEED = int(os.environ.get("STABMON_TEST_SEED", "1337"))


def run_example(tmp_path: Path, *args: str, db: Path | None = None, timeout: float = 600) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    db = db or tmp_path / "s.db"
    cmd = [sys.executable, str(EXAMPLE), "--out-dir", str(tmp_path / "out"), "--db", f"sqlite:///{db}",
           "--no-step-time", *args]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def final_val(output: str) -> float:
    found = re.findall(r"done: \d+ iters, val loss ([0-9.naif]+)", output)
    assert found, output[-2000:]
    return float(found[-1])


def query(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql).fetchall()


def test_the_loop_is_attached_in_at_most_15_marked_lines() -> None:
    comments = [
        tok for tok in tokenize.generate_tokens(io.StringIO(EXAMPLE.read_text()).readline)
        if tok.type == tokenize.COMMENT and re.match(r"#( noqa: \w+ +#)? stabmon\b", tok.string)
    ]
    lines = {tok.start[0] for tok in comments}
    assert 10 <= len(lines) <= 15, sorted(lines)


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "threads"), [(SEED, 1), (SEED + 1, 2)])
def test_a_healthy_run_is_quiet(tmp_path: Path, seed: int, threads: int) -> None:
    out = run_example(tmp_path, "--max-iters", "150", "--seed", str(seed), "--threads", str(threads))
    db = tmp_path / "s.db"
    assert query(db, "select status from runs") == [("finished",)]
    assert query(db, "select count(*), count(distinct step), max(step) from steps") == [(150, 150, 149)]
    # nothing at warning or above and no decision; an `info` anomaly may be recorded for the trace (the grad
    # norm drifts upward slowly as the LR decays: drift is info)
    assert query(db, "select kind, metric, message from anomalies where severity != 'info'") == []
    assert query(db, "select action from decisions") == []
    assert query(db, "select count(*) from alerts") == [(0,)]
    assert final_val(out) < 2.0  # it learned (from 2.6)


@pytest.mark.slow
def test_an_lr_jump_is_rescued_through_the_loops_own_checkpoints(tmp_path: Path) -> None:
    # the rollback (about step 120 back to 75) is judged over 120 steps past the step it rolled back from
    common = ("--max-iters", "280", "--seed", str(SEED))
    healthy = final_val(run_example(tmp_path / "h", *common, "--no-monitor"))
    broken = final_val(run_example(tmp_path / "b", *common, "--no-monitor", "--lr-jump-at", "100"))
    assert not broken < 1.1 * healthy  # unmonitored, the jump ruins the run (NaN compares False)
    out = run_example(tmp_path / "m", *common, "--lr-jump-at", "100")
    rescued = final_val(out)
    assert rescued < 1.1 * healthy, (rescued, healthy)
    db = tmp_path / "m" / "s.db"
    rows = query(db, "select before, after from interventions where action = 'rollback'")
    assert rows, out[-3000:]
    assert "ckpt-000100.pt" in rows[0][1] or "ckpt-000075.pt" in rows[0][1]  # one of the loop's own files
    assert str(tmp_path / "m" / "out") in rows[0][1] or "out/ckpt-" in rows[0][1]
    from typer.testing import CliRunner

    from stabmon.cli import app

    trace = CliRunner().invoke(app, ["trace", "latest", "--db", f"sqlite:///{db}"])
    assert trace.exit_code == 0, trace.output
    assert "rollback" in trace.output and "resolved" in trace.output, trace.output


@pytest.mark.slow
def test_a_fresh_run_in_a_longer_runs_directory_still_rolls_back_and_resumes_its_own_line(tmp_path: Path) -> None:
    """A run started again from scratch in the out dir of a longer one (nanoGPT's default ``out``). Before, the
    other run's later files (steps 150-200) stayed in the registry, counted against ``keep=3``: each of the new
    run's saves pruned itself, its rollback found no checkpoint before the incident, and the run was stopped."""
    run_example(tmp_path, "--max-iters", "200", "--seed", str(SEED))
    old = {p.name for p in (tmp_path / "out").glob("ckpt-*.pt")}
    assert old == {"ckpt-000150.pt", "ckpt-000175.pt", "ckpt-000200.pt"}, old
    out = run_example(tmp_path, "--max-iters", "160", "--seed", str(SEED + 1), "--lr-jump-at", "60")
    assert "3 checkpoint(s) after step 0 (steps 150-200) of a line this run does not continue" in out, out[-3000:]
    assert re.search(r"rolled back from step \d+ to checkpoint step (25|50) ", out), out[-3000:]
    assert "failed" not in out and "stopping the run" not in out, out[-3000:]
    db = tmp_path / "s.db"
    assert query(db, "select status from runs order by started_at") == [("finished",), ("finished",)]
    assert {p.name for p in (tmp_path / "out").glob("ckpt-*.pt")} >= old - {"ckpt-000150.pt"}  # not deleted
    # (the new line's own save at 150 replaced the other run's file of that name)
    resumed = run_example(tmp_path, "--max-iters", "170", "--seed", str(SEED + 1), "--init-from", "resume")
    # from its own line's newest checkpoint (150, saved after the rollback), not the other run's 175 or 200
    assert resumed.startswith("step 150: train loss") and "170 iters, val loss" in resumed, resumed[-3000:]
    assert "20 steps trained" in resumed, resumed[-3000:]
    assert query(db, "select count(*) from runs") == [(2,)]  # the resume continued the second run
    assert query(db, "select status from runs order by started_at") == [("finished",), ("finished",)]
    assert query(db, "select max(step) from steps where run_key = "
                     "(select key from runs order by started_at desc limit 1)") == [(169,)]


@pytest.mark.slow
def test_ctrl_c_then_resume_stores_every_step_and_decision_once(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    cmd = [sys.executable, "-u", str(EXAMPLE), "--out-dir", str(tmp_path / "out"), "--db", f"sqlite:///{db}",
           "--no-step-time", "--max-iters", "160", "--seed", str(SEED), "--lr-jump-at", "60"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=ctrl_c_delivered)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # after the rollback, mid-way through the rest of the run
        seen.append(line)
        if line.startswith("iter 130:"):
            break
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0, "".join(seen) + rest
    assert query(db, "select status from runs") == [("interrupted",)]
    stopped = query(db, "select max(step) from steps")[0][0]
    assert 129 <= stopped < 159

    out = run_example(tmp_path, "--max-iters", "160", "--seed", str(SEED), "--init-from", "resume", db=db)
    assert query(db, "select status from runs") == [("finished",)]
    assert "Traceback" not in out
    # every step once, in order, and the resume continued exactly where Ctrl-C left off; only the stretch the
    # rollback went back over was trained twice, on purpose (both trajectories are kept, in order)
    (restored,) = query(db, "select json_extract(after, '$.restored_step') from interventions "
                            "where action = 'rollback'")[0]
    steps = [s for (s,) in query(db, "select step from steps order by seq")]
    k = next(i for i, s in enumerate(steps) if s != i)
    assert steps[k:] == list(range(restored, 160)), (k, restored, stopped)
    decisions = query(db, "select step, rule, rung, action, count(*) from decisions group by 1, 2, 3, 4")
    assert decisions and all(n == 1 for *_, n in decisions)
    assert query(db, "select count(*) from interventions where action = 'rollback'") == [(1,)]
    check_goodput(db, records=len(steps), kept=160)


def check_goodput(db: Path, *, records: int, kept: int) -> None:
    """The ledger of a run with one rollback and one Ctrl-C/resume: the steps the rollback abandoned, two
    processes with a restart gap between them, checkpoint saves, and causes that add up to the wall time."""
    from stabmon.goodput import compute_ledger, load_input
    from stabmon.store import open_store

    store = open_store(f"sqlite:///{db}")
    with store.session() as s:
        (run_id,) = [r for (r,) in s.execute(__import__("sqlalchemy").text("select id from runs"))]
        ledger = compute_ledger(load_input(session=s, run_id=run_id))
    store.close()
    by = {c.name: c for c in ledger.causes}
    assert ledger.segments == 2 and by["restart"].seconds > 0
    assert by["rollback"].steps == records - kept > 0  # every step trained twice was the rollback's
    assert by["productive"].steps + by["skipped_update"].steps == kept
    assert by["checkpoint"].seconds > 0 and by["startup"].seconds > 0
    # a gap between two clocks (time.time and perf_counter) may come out a few microseconds below zero
    assert sum(c.seconds for c in ledger.causes) == pytest.approx(ledger.wall_seconds, rel=1e-3)
    assert 0 < ledger.goodput < 1


@pytest.mark.slow
def test_a_healthy_runs_own_sparse_log_replays_as_quietly_as_it_ran(tmp_path: Path) -> None:
    """Live and replay agree on a sparse log: the loop's stdout (a loss line every 10 iterations) replayed through
    the ``default`` runbook raises nothing at warning or above and decides nothing, as the live run did. The
    replay leaves step time out: the printed times measure the machine the test ran on."""
    from stabmon.events import Anomaly, Decision, Severity
    from stabmon.replay.importers.sniff import import_file, sniff_format
    from stabmon.replay.replay import replay, simulated_pipeline

    out = run_example(tmp_path, "--max-iters", "600", "--seed", str(SEED))
    db = tmp_path / "s.db"
    assert query(db, "select count(*) from decisions") == [(0,)]
    log = tmp_path / "stdout.log"
    log.write_text(out)
    assert sniff_format(log).FORMAT == "nanogpt"
    records = import_file(log).records
    assert len(records) >= 60 and {r.step % 10 for r in records if r.get("loss") is not None} == {0}
    pipeline = simulated_pipeline(runbook="default", overrides=("step_time.enabled=false",))[0]
    events = replay(records, pipeline=pipeline).events
    loud = [e for e in events if isinstance(e, Anomaly) and e.severity >= Severity.WARNING]
    assert not loud and not [e for e in events if isinstance(e, Decision)], loud[:3]
