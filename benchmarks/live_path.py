"""How far one gradient-norm value travels: the modules on the live path from the optimizer hook to a stored decision.

A small model is trained under the monitor (apply mode, the ``default`` runbook, a real SQLite store); from
step ``--spike`` the loss is scaled by ``--factor`` so that the gradient norm spikes and the runbook decides a
rollback. A profiler (``sys.setprofile`` on the training thread, ``threading.setprofile`` on the store's
writer) records every call into a ``stabmon`` module from the first spiking step until the decision is in the
database, and prints:

- files: the distinct ``stabmon`` source files entered on that path;
- hops: the distinct caller-file -> callee-file edges between two different ``stabmon`` files;
- call-backs into the Monitor: distinct (caller, Monitor method) pairs where code outside ``monitor.py`` calls
  back up into its owner, the ``Monitor``.

These are structure figures (how many places a reader follows), not timings::

    python benchmarks/live_path.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

import stabmon
from stabmon.monitor import Monitor, MonitorConfig

PACKAGE = str(Path(stabmon.__file__).resolve().parent)


class PathRecorder:
    """Collects stabmon files, file-to-file edges and call-backs into monitor.py while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.files: set[str] = set()
        self.edges: set[tuple[str, str]] = set()
        self.callbacks: set[tuple[str, str]] = set()
        self.lock = threading.Lock()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.active or event != "call":
            return
        callee = _rel(frame.f_code.co_filename)
        if callee is None:
            return
        caller_frame = frame.f_back
        caller = _rel(caller_frame.f_code.co_filename) if caller_frame is not None else None
        with self.lock:
            self.files.add(callee)
            if caller is not None and caller != callee:
                self.edges.add((caller, callee))
                if callee == "monitor.py" and caller_frame is not None:
                    self.callbacks.add((f"{caller}:{caller_frame.f_code.co_name}", frame.f_code.co_name))


def _rel(filename: str) -> str | None:
    path = str(Path(filename).resolve()) if not filename.startswith("<") else filename
    return path[len(PACKAGE) + 1 :] if path.startswith(PACKAGE + "/") else None


def run(steps: int, spike: int, factor: float, folder: Path) -> PathRecorder:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    store_url = f"sqlite:///{folder / 'path.db'}"
    recorder = PathRecorder()
    threading.setprofile(recorder)  # before the monitor starts its writer thread
    monitor = Monitor(
        model,
        optimizer,
        store=store_url,
        runbook="default",
        mode="apply",
        config=MonitorConfig(clip=1.0, checkpoint_every=50),
        checkpoint_dir=str(folder / "ckpt"),
    )
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    sys.setprofile(recorder)
    try:
        for step, _ in monitor.steps(range(steps)):
            if step == spike:
                recorder.active = True
            loss = nn.functional.mse_loss(model(x), y) * (factor if step >= spike else 1.0)
            loss.backward()
            monitor.observe(loss=loss)
            optimizer.step()
            optimizer.zero_grad()
            if recorder.active and _decided(monitor):
                break
        monitor.close()  # the writer drains: the decision is in the database when close returns
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return recorder


def _decided(monitor: Monitor) -> bool:
    from stabmon.events import Decision

    return any(isinstance(e, Decision) and e.action != "alert_only" for e in monitor.events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--spike", type=int, default=200)
    parser.add_argument("--factor", type=float, default=1e4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rec = run(args.steps, args.spike, args.factor, Path(tmp))
    print(f"files on the path: {len(rec.files)}")
    for f in sorted(rec.files):
        print(f"  {f}")
    print(f"hops (file -> file edges): {len(rec.edges)}")
    print(f"call-backs into the Monitor from other modules: {len(rec.callbacks)}")
    for caller, method in sorted(rec.callbacks):
        print(f"  {caller} -> Monitor.{method}")


if __name__ == "__main__":
    main()
