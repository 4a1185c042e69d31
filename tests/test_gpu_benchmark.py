"""benchmarks/gpu.py runs end to end (tiny preset on CPU; on CUDA where present), every arm in its own process,
so the GPU benchmark cannot rot between the occasions a GPU is at hand."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
ARMS = ["bf16-defaults", "bf16-sqlite", "bf16-every-signal", "bf16-skip-guard", "bf16-lead-signals", "fp16-scaler",
        "bf16-compile", "bf16-snapshots"]


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--tiny", "--rounds", "1", "--block", "1"]
    done = subprocess.run(
        [*cmd, "--warmup", "1", "--json", str(out), *extra],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| arm | ms/step unmonitored |" in done.stdout
    return json.loads(out.read_text())


@pytest.mark.slow
def test_every_arm_runs_and_reports_its_figures(tmp_path: Path) -> None:
    report = _run(tmp_path)
    arms = {r["arm"]: r for r in report["arms"]}
    assert sorted(arms) == sorted(ARMS)
    for name, r in arms.items():
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0 and r["ms_monitored"] > 0
        assert r["monitor_errors"] == {}
        assert r["model_optimizer_bytes"] > 0 and r["syncs_monitored"] is None  # CPU: no sync debug mode
        assert set(r["monitor_device"]) == {"embeddings", "skip_guard", "pending"}
    assert arms["bf16-skip-guard"]["monitor_device"]["skip_guard"] == 0  # fused AdamW: the zero-copy guard
    assert arms["bf16-compile"]["graph_breaks"] >= 0 and arms["bf16-compile"]["unique_graphs"] >= 1
    held = arms["bf16-snapshots"]["snapshot_host_bytes"]  # the snapshot tier's host copies, 2 kept
    assert held is not None and held >= arms["bf16-snapshots"]["model_optimizer_bytes"] / 2
    assert arms["bf16-defaults"]["snapshot_host_bytes"] is None


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_arms_count_no_host_sync_outside_flushes(tmp_path: Path) -> None:
    report = _run(tmp_path, "--device", "cuda", "--arms", "bf16-defaults", "bf16-skip-guard", "bf16-lead-signals",
                  "fp16-scaler", "bf16-snapshots")
    for r in report["arms"]:
        assert r["syncs_monitored"] == 0, r
        assert r["peak_bytes_monitored"] is not None
