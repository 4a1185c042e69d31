"""The live monitor's import path (Monitor, collectors, detectors, runbook engine, store writer, alerts) works
where polars is not installed: polars is imported only where a query or an importer needs it."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoPolars(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"polars", "_polars_runtime", "_polars_runtime_32", "_polars_runtime_64"}:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, NoPolars())

    import torch
    import stabmon
    from stabmon.monitor import Monitor, MonitorConfig
    import stabmon.collect, stabmon.detect, stabmon.runbook, stabmon.store.writer, stabmon.alerts

    model = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 7))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    url = "sqlite:///" + sys.argv[1]
    cfg = MonitorConfig(flush_every=5, clip=1.0)
    with Monitor(model, opt, store=url, runbook="default", mode="apply", config=cfg, run_name="np") as mon:
        mon.overrides.skip_factor = 4.0
        for step, idx in mon.steps([torch.randint(0, 7, (3, 4)) for _ in range(12)]):
            loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
            loss.backward()
            mon.observe(loss=loss)
            opt.step(); opt.zero_grad()
    print("polars loaded:", sorted(m for m in sys.modules if m.split(".")[0].endswith("polars")
                                    or m.startswith("_polars")))
    print("steps:", mon.step, "records:", len(mon.records), "errors:", dict(mon.errors))
    """
)


def test_monitor_with_a_sqlite_store_runs_without_polars(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "np.db")],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "polars loaded: []" in out.stdout, out.stdout
    assert "steps: 12 records: 12 errors: {}" in out.stdout, out.stdout
    with sqlite3.connect(tmp_path / "np.db") as db:  # the background writer stored every step
        assert db.execute("select count(*) from steps").fetchone() == (12,)
