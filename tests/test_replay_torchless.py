"""``stabmon replay`` and ``stabmon eval`` work where torch cannot be imported: the offline path builds its
pipeline through :mod:`stabmon.factory`, which never reaches the live monitor's layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

BLOCK_TORCH = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "torch":
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, NoTorch())
    from stabmon.cli import main

    sys.argv = ["stabmon", *sys.argv[1:]]
    try:
        main()
    finally:
        print("torch loaded:", sorted(m for m in sys.modules if m.split(".")[0] == "torch"), file=sys.stderr)
    """
)


def _stabmon_without_torch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("STABMON_DB_URL", None)
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH, *args],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )


def _spiky_log(path: Path) -> Path:
    """A loss that sits near 2 with a little alternation, then jumps far past any z-threshold at step 150."""
    rows = [f"{s},{2.0 + 0.01 * (s % 3) + (40.0 if s == 150 else 0.0)}" for s in range(200)]
    path.write_text("step,loss\n" + "\n".join(rows) + "\n")
    return path


def test_replay_runs_with_torch_not_importable(tmp_path: Path) -> None:
    log = _spiky_log(tmp_path / "run.csv")
    out = _stabmon_without_torch(tmp_path, "replay", str(log), "--json", "--db", f"sqlite:///{tmp_path / 'r.db'}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch loaded: []" in out.stderr, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert any(r["type"] == "Anomaly" and r["step"] == 150 and r["metric"] == "loss" for r in rows), rows
    summary = rows[-1]
    assert summary["type"] == "summary" and summary["steps"] == 200 and summary["run_id"], summary


def test_eval_runs_with_torch_not_importable(tmp_path: Path) -> None:
    _spiky_log(tmp_path / "run.csv")
    labels = tmp_path / "LABELS.csv"
    labels.write_text("file,step_start,step_end,kind,label_source,note\nrun.csv,150,152,loss_spike,author,\n")
    out = _stabmon_without_torch(tmp_path, "eval", "--labels", str(labels), "--no-peers", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch loaded: []" in out.stderr, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    (incident,) = [r for r in rows if r["type"] == "incident"]
    assert incident["method"] == "stabmon" and incident["detected"] is True, incident
