"""A host-memory snapshot tier in front of the disk checkpoints: a rollback goes back tens of steps, not hundreds.

A rollback to a disk checkpoint saved every 100-300 steps throws away everything trained since; a fault 20 steps
long then costs 100-300 steps. DLRover's flash checkpoint and Orbax's emergency checkpointing answer with a tier in
memory: a copy of the training state taken every few steps, restored first. :class:`HostSnapshots` keeps the last
``keep`` copies of what a checkpoint holds (model, optimizer, scaler, scheduler, the monitor's state and the data
position), taken every ``every`` steps (``MonitorConfig.snapshots``), within ``max_bytes``; they are never written to
disk. Tensors are copied to host memory: on a GPU into pinned buffers on a side stream (no host sync on the training
thread: the copy is waited for only when the snapshot is used), on the CPU by a plain copy.

:class:`TieredCheckpoints` stands where the disk checkpoints stand (a
:class:`~stabmon.checkpoints.CheckpointStore`): a rollback's candidates are the snapshots and the disk checkpoints
together, newest first, each validated the same way (finite, fits the model and optimizer), so a rollback lands on
the newest snapshot before the incident's onset and falls back to the disk when none validates; under
torch.distributed the ranks agree on a step as they do for disk checkpoints (every rank snapshots at the same
steps). Saves, the registry, resumes: the disk's. A rollback drops the snapshots newer than where it landed.

>>> import torch
>>> snaps = HostSnapshots(every=10, keep=2)
>>> w = torch.ones(3)
>>> for step in (10, 20, 30):
...     w += 1
...     _ = snaps.take(step, lambda: {"model": {"w": w}})
>>> [i.step for i in snaps.candidates()], snaps.validate(snaps.candidates()[0])[0]["model"]["w"].tolist()
([30, 20], [4.0, 4.0, 4.0])
>>> state, _ = snaps.validate(snaps.candidates()[1]); state["model"]["w"] += 100   # a restore's copy
>>> snaps.validate(snaps.candidates()[1])[0]["model"]["w"].tolist()
[3.0, 3.0, 3.0]
"""

from __future__ import annotations

import copy
import logging
import os
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from stabmon.checkpoints import CheckpointInfo, CheckpointStore, NoValidCheckpointError, nonfinite_entry

log = logging.getLogger(__name__)

PREFIX = "memory://snapshot-"
"""The ``path`` of a snapshot's :class:`~stabmon.checkpoints.CheckpointInfo` (no file: host memory)."""


def _tree_map(obj: Any, tensor: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A copy of a state tree: ``tensor(t)`` for each tensor, a deep copy of every other leaf."""
    if isinstance(obj, torch.Tensor):
        return tensor(obj)
    if isinstance(obj, dict):
        return {k: _tree_map(v, tensor) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_tree_map(v, tensor) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_tree_map(v, tensor) for v in obj)
    return copy.deepcopy(obj)


def _to_host(obj: Any, stream: Any) -> Any:
    """A copy of ``obj`` whose tensors live in host memory (pinned and copied on ``stream`` from a GPU)."""

    def host(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device.type != "cuda":
            return t.clone()
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        with torch.cuda.stream(stream):
            out.copy_(t, non_blocking=True)
        return out

    return _tree_map(obj, host)


def _clone(obj: Any) -> Any:
    """A copy a restore may keep (the snapshot stays as it was taken)."""
    return _tree_map(obj, torch.Tensor.clone)


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a state tree (dicts, lists, tuples), depth first."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    return []


def nbytes(obj: Any) -> int:
    """The bytes of every tensor in a state tree."""
    return sum(t.numel() * t.element_size() for t in tensors(obj))


class HostSnapshots:
    """The last ``keep`` snapshots, one every ``every`` steps, at most ``max_bytes`` in all (None: ``keep``
    copies); see the module docstring."""

    def __init__(self, *, every: int, keep: int = 2, max_bytes: int | None = None) -> None:
        if every < 1 or keep < 1:
            raise ValueError(f"snapshots: every and keep must be >= 1, got {every}, {keep}")
        self.every, self.keep, self.max_bytes = int(every), int(keep), max_bytes
        self._held: deque[tuple[CheckpointInfo, Any, Any]] = deque()  # (info, host state, ready event)
        self._stream: Any = None
        self.taken = self.skipped = 0
        self._warned = False

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def take(self, step: int, state: Callable[[], Mapping[str, Any]]) -> CheckpointInfo | None:
        """Snapshot ``state()`` as the state after ``step`` steps (the oldest dropped beyond ``keep``); None when
        one snapshot would exceed ``max_bytes`` (said once)."""
        tree = dict(state())
        size = nbytes(tree)
        if self.max_bytes is not None and size > self.max_bytes:
            self.skipped += 1
            if not self._warned:
                self._warned = True
                log.warning("stabmon: snapshots: one takes %.3g GB, more than snapshots.max_bytes (%.3g GB): none "
                            "taken (rollbacks use the disk checkpoints)", size / 1e9, self.max_bytes / 1e9)
            return None
        while self._held and (len(self._held) >= self.keep or (
                self.max_bytes is not None and size + sum(i.nbytes for i, _, _ in self._held) > self.max_bytes)):
            self._held.popleft()
        ready = None
        if torch.cuda.is_available() and any(t.device.type == "cuda" for t in tensors(tree)):
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            host = _to_host(tree, self._stream)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        else:
            host = _to_host(tree, None)
        info = CheckpointInfo(step=int(step), path=f"{PREFIX}{int(step)}", nbytes=size, own=True)
        self._held = deque(e for e in self._held if e[0].step != step)
        self._held.append((info, host, ready))
        self.taken += 1
        return info

    def candidates(self, before_step: int | None = None) -> list[CheckpointInfo]:
        """The snapshots held at or before ``before_step``, newest first."""
        return [i for i, _, _ in reversed(self._held) if before_step is None or i.step <= before_step]

    def validate(self, info: CheckpointInfo, check: Callable[[dict[str, Any]], str | None] | None = None
                 ) -> tuple[dict[str, Any] | None, str | None]:
        """``(a copy of the snapshot's state, None)``, or ``(None, why it cannot be restored)``."""
        for held, host, ready in self._held:
            if held.path == info.path:
                if ready is not None:
                    ready.synchronize()  # the side stream's copy: waited for here, when a rollback needs it
                bad = nonfinite_entry(host)
                if bad is not None:
                    return None, f"non-finite values in {bad or 'the snapshot'}"
                problem = check(host) if check is not None else None
                if problem is not None:
                    return None, problem
                return _clone(host), None
        return None, "the snapshot is no longer held"

    def drop_after(self, step: int) -> None:
        """Forget the snapshots newer than ``step`` (a rollback undid their training)."""
        self._held = deque(e for e in self._held if e[0].step <= step)

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i, _, _ in self._held)


class TieredCheckpoints:
    """The snapshots in front of a :class:`~stabmon.checkpoints.CheckpointStore` (the disk); see the module
    docstring. Everything but choosing a rollback's checkpoint is the disk's."""

    def __init__(self, disk: CheckpointStore, snapshots: HostSnapshots) -> None:
        self.disk, self.snapshots = disk, snapshots
        self.directory: Path = disk.directory

    # -- what a rollback chooses from: both tiers --------------------------------------------------------
    def candidates(self, before_step: int | None = None) -> list[CheckpointInfo]:
        """The snapshots and the disk checkpoints at or before ``before_step``, newest first (a snapshot first at
        an equal step: it loads from memory)."""
        found = [*self.snapshots.candidates(before_step), *self.disk.candidates(before_step)]
        return sorted(found, key=lambda i: (i.step, i.path.startswith(PREFIX)), reverse=True)

    def validate(self, info: CheckpointInfo, check: Callable[[dict[str, Any]], str | None] | None = None
                 ) -> tuple[dict[str, Any] | None, str | None]:
        if info.path.startswith(PREFIX):
            return self.snapshots.validate(info, check)
        return self.disk.validate(info, check)

    def last_known_good(
        self, before_step: int | None = None, *, check: Callable[[dict[str, Any]], str | None] | None = None
    ) -> tuple[CheckpointInfo, dict[str, Any]]:
        """The newest snapshot or disk checkpoint at or before ``before_step`` that validates, with its state."""
        for info in self.snapshots.candidates(before_step):
            disk_newer = [d for d in self.disk.candidates(before_step) if d.step > info.step]
            if disk_newer:
                break  # a disk checkpoint is newer than every snapshot left: the disk's choice
            state, reason = self.snapshots.validate(info, check)
            if state is not None:
                return info, state
            log.warning("stabmon: snapshot of step %d refused: %s", info.step, reason)
        return self.disk.last_known_good(before_step, check=check)

    def rolled_back(self, target: CheckpointInfo) -> str | None:
        """A rollback landed on ``target``: later snapshots are dropped, and the disk's registry abandons its
        checkpoints after that step (a new timeline)."""
        self.snapshots.drop_after(target.step)
        return self.disk.rolled_back(target)

    def starts_at(self, step: int) -> list[CheckpointInfo]:
        self.snapshots.drop_after(step)
        return self.disk.starts_at(step)

    # -- the rest is the disk's ----------------------------------------------------------------------------
    @property
    def reader(self) -> bool:
        return self.disk.reader

    @reader.setter
    def reader(self, value: bool) -> None:
        self.disk.reader = value

    @property
    def hold_before(self) -> int | None:
        return self.disk.hold_before

    @hold_before.setter
    def hold_before(self, value: int | None) -> None:
        self.disk.hold_before = value  # the snapshots' ring keeps its own count: the disk is the fallback

    @property
    def can_save(self) -> bool:
        return self.disk.can_save

    @property
    def checkpoints(self) -> list[CheckpointInfo]:
        return self.disk.checkpoints

    def save(self, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]], *, step: int) -> CheckpointInfo:
        return self.disk.save(state, step=step)

    def register(self, path: str | os.PathLike[str], *, step: int) -> CheckpointInfo:
        return self.disk.register(path, step=step)

    def state_dict(self) -> dict[str, Any]:
        return self.disk.state_dict()

    def adopt(self, state: Mapping[str, Any]) -> int:
        return self.disk.adopt(state)

    def attach(self, *, sink: Any, run_id: str) -> None:
        self.disk.attach(sink=sink, run_id=run_id)


__all__ = ["PREFIX", "HostSnapshots", "NoValidCheckpointError", "TieredCheckpoints", "nbytes", "tensors"]
