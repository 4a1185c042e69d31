"""A monitored loop whose checkpoint save stops at a chosen point and waits for a signal, for
test_fault_sigterm_save.py.

``python save_signal_loop.py CKPT_DIR DB_URL POINT MARKER`` trains up to 200 steps with a checkpoint every 5
(keeping 2) and no ``close()``, like the README's quick start. The save at step 15 (its fourth: older
checkpoints are pruned) stops at ``POINT``, writes ``MARKER`` and sleeps until a signal arrives (at most 60 s):

- ``state``: while the training state is gathered (the optimizer's ``state_dict``);
- ``write-first`` / ``write-middle``: inside ``torch.save``, at its first write to the temporary file / once
  half of the previous checkpoint's bytes are written;
- ``fsync``: at the temporary file's fsync; ``replace``: before its rename; ``replaced``: after it (the file is
  complete and not yet registered);
- ``registry``: while the registry file is written; ``pruned``: after an old checkpoint file was deleted.

Each point is a wrapper around what the save calls (``torch.save``'s file object, ``os.fsync``,
``os.replace``, ``Path.unlink``), armed for that one save only. Prints one line per step trained (``step N``).
``STABMON_TEST_SEED`` moves the model's weights, ``STABMON_TEST_THREADS`` sets torch's threads.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from fault_support import Tiny, data

from stabmon.checkpoints import REGISTRY_NAME
from stabmon.monitor import Monitor, MonitorConfig

SAVE_STEP = 15


class Point:
    """Where the armed save stops: ``hit(name)`` waits for the signal when ``name`` is the chosen point."""

    def __init__(self, point: str, marker: str) -> None:
        self.point, self.marker = point, Path(marker)
        self.armed = False
        self.half = 0

    def hit(self, name: str) -> None:
        if not (self.armed and name == self.point):
            return
        self.armed = False  # once: the close's own save goes through
        self.marker.write_text(name)
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:  # the signal's handler raises in here
            time.sleep(0.01)


class Watched:
    """A file that reports its writes (the temporary file a save writes through)."""

    def __init__(self, f: Any, point: Point, registry: bool) -> None:
        self.f, self.point, self.registry, self.written = f, point, registry, 0

    def write(self, b: Any) -> int:
        if self.registry:
            self.point.hit("registry")
        elif self.written == 0:
            self.point.hit("write-first")
        elif self.point.half and self.written >= self.point.half:
            self.point.hit("write-middle")
        n = self.f.write(b)
        self.written += n
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)

    def __enter__(self) -> Watched:
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self.f.__exit__(*exc)


def watch(point: Point) -> None:
    """Wrap what a save calls; each wrapper stops at its point when armed, else does what it wraps."""
    real_mkstemp, real_fdopen, real_fsync, real_replace = tempfile.mkstemp, os.fdopen, os.fsync, os.replace
    real_unlink = Path.unlink
    names: dict[int, str] = {}

    def mkstemp(*args: Any, **kwargs: Any) -> Any:
        fd, name = real_mkstemp(*args, **kwargs)
        names[fd] = os.path.basename(name)
        return fd, name

    def fdopen(fd: int, *args: Any, **kwargs: Any) -> Any:
        f = real_fdopen(fd, *args, **kwargs)
        name = names.pop(fd, None)
        return f if name is None else Watched(f, point, registry=name.startswith(f".{REGISTRY_NAME}."))

    def fsync(fd: int) -> None:
        point.hit("fsync")
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        if str(dst).endswith(".pt"):
            point.hit("replace")
            real_replace(src, dst)
            point.hit("replaced")
        else:
            real_replace(src, dst)

    def unlink(self: Path, missing_ok: bool = False) -> None:
        real_unlink(self, missing_ok=missing_ok)
        if self.suffix == ".pt":
            point.hit("pruned")

    tempfile.mkstemp, os.fdopen, os.fsync, os.replace = mkstemp, fdopen, fsync, replace  # type: ignore[assignment]
    Path.unlink = unlink  # type: ignore[method-assign]


def main(ckpt: str, url: str, point_name: str, marker: str) -> None:
    point = Point(point_name, marker)
    watch(point)
    torch.set_num_threads(int(os.environ.get("STABMON_TEST_THREADS") or torch.get_num_threads()))
    model = Tiny()
    with torch.no_grad():  # another seed, other weights: the save stops where it stops whatever they are
        for p in model.parameters():
            seed = int(os.environ.get("STABMON_TEST_SEED", "0"))
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)), alpha=0.1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    real_state_dict = opt.state_dict

    def state_dict() -> Any:
        point.hit("state")
        return real_state_dict()

    opt.state_dict = state_dict  # type: ignore[method-assign]
    mon = Monitor(model, opt, store=url, run_name="signal-in-save", checkpoint_dir=ckpt,
                  config=MonitorConfig(flush_every=5, checkpoint_every=5, checkpoint_keep=2, hang_timeout=None))
    for step, x in mon.steps(data(200)):
        loss = model(x).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
        print(f"step {step}", flush=True)
        if step == SAVE_STEP - 1:  # the save after this step is the one that stops
            point.armed = True
            point.half = max(1, mon.checkpoints.checkpoints[-1].nbytes // 2)


if __name__ == "__main__":
    main(*sys.argv[1:5])
