"""Names the store cannot hold on one backend are refused on every backend, with one line: a NUL character in a
run name, a metric name or a CSV header (PostgreSQL refuses any text holding a NUL and, before, lost every row
that carried such a name)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fault_support import FAST, count, data, report, stored_steps
from test_fault_monitor import monitor

from stabmon.events import StepRecord
from stabmon.store import StoreConfig, open_store

NUL = chr(0)
STEPS = 60


def test_a_nul_in_a_metric_name_costs_only_that_metric(backend_url: str, tmp_path: Path) -> None:
    url = backend_url
    with open_store(url, config=StoreConfig(spool_dir=str(tmp_path), **FAST)) as store:
        run = store.start_run(name="direct", environment={})
        records = [StepRecord(s, {"loss": 1.0, f"bad{NUL}name": 2.0}) for s in range(STEPS)]
        store.write_steps(run_id=run, records=records)
        assert store.flush(30)
        assert store.stats.bad_names == STEPS and store.stats.rejected_batches == 0
    assert stored_steps(url, run) == list(range(STEPS))
    mon, model, opt = monitor(url)
    for _step, x in mon.steps(data(STEPS)):
        loss = model(x).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss, **{f"grad{NUL}x": torch.tensor(1.0)})  # dropped and counted, never raised
        opt.step()
        opt.zero_grad()
    mon.close()
    assert mon.errors["observe"] == STEPS
    assert stored_steps(url, mon.run_id) == list(range(STEPS))
    kept = count(url, "select count(*) from step_metrics m join runs r on r.key = m.run_key where r.id = :r",
                 r=mon.run_id)
    assert kept >= STEPS  # every step's loss (and the monitor's own metrics)
    report("NUL in a metric name", backend=url.split(":")[0], steps_stored=f"{STEPS}/{STEPS}",
           monitor_steps_stored=f"{len(stored_steps(url, mon.run_id))}/{STEPS}", counted=STEPS)


def test_a_nul_in_a_run_name_is_one_line_before_any_row(backend_url: str, tmp_path: Path) -> None:
    url = backend_url
    message = r"contains a NUL character at position 3, which the store cannot hold: 'run\\x00x'$"
    with open_store(url, config=StoreConfig(spool_dir=str(tmp_path), **FAST)) as store:
        with pytest.raises(ValueError, match=r"^store.start_run.name " + message):
            store.start_run(name=f"run{NUL}x", environment={})
    with pytest.raises(ValueError, match=r"^run_name " + message):
        monitor(url, run_name=f"run{NUL}x")
    assert count(url, "select count(*) from runs") == 0


def test_an_import_with_a_nul_in_a_header_exits_with_one_line(backend_url: str, tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    path.write_text(f"step,lo{NUL}ss\n" + "".join(f"{s},{1.0 + s / 100}\n" for s in range(50)))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "stabmon", "import", str(path), "--run", "imported", "--db",
                           backend_url], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip().count("\n") == 0 and "contains a NUL character" in done.stderr, done.stderr
    assert count(backend_url, "select count(*) from runs") == 0
    report("NUL in an imported header", backend=backend_url.split(":")[0], exit_code=1,
           stderr_lines=len(done.stderr.strip().splitlines()), runs_left=0)
