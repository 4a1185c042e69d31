"""Accumulate per-step device tensors and copy them to the host once per flush.

Between flushes nothing is read back: collectors hand :class:`StepBuffer` device tensors (0-d or 1-d) together
with their metric names, and plain host floats (learning rate, step time) that cost nothing to keep. At
:meth:`StepBuffer.drain` every tensor is flattened into one vector, copied to the host in one transfer (into
pinned memory with ``non_blocking=True`` on CUDA, then one event wait) and split back into
:class:`StepRecord` objects.

>>> import torch
>>> buf = StepBuffer()
>>> buf.begin(step=0, batch_index=0)
>>> buf.add(["loss"], torch.tensor(2.5))
>>> buf.add(["grad_norm/a", "grad_norm/b"], torch.tensor([0.5, 1.0]))
>>> buf.add_host("lr", 0.1)
>>> buf.end(time=None)
>>> [r.metrics for r in buf.drain()]
[{'lr': 0.1, 'loss': 2.5, 'grad_norm/a': 0.5, 'grad_norm/b': 1.0}]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from stabmon.events import StepRecord


@dataclass
class _Pending:
    step: int
    batch_index: int | None
    host: dict[str, float] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    time: float | None = None


class StepBuffer:
    """Per-step metrics waiting for the next flush; see the module docstring."""

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor] = []
        self._steps: list[_Pending] = []
        self._current: _Pending | None = None
        self._pinned: torch.Tensor | None = None
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Applied to the stacked device vector before the copy (the cross-rank mean under
        torch.distributed)."""

    @property
    def open(self) -> bool:
        return self._current is not None

    def __len__(self) -> int:
        return len(self._steps)

    def begin(self, *, step: int, batch_index: int | None) -> None:
        self._current = _Pending(step=step, batch_index=batch_index)

    def add(self, names: Sequence[str], values: torch.Tensor) -> None:
        """Queue device values for the open step; ``values`` holds one element per name."""
        if self._current is None:
            return
        self._current.names.extend(names)
        self._tensors.append(values.detach().reshape(-1))

    def nbytes(self) -> int:
        """Bytes of the device tensors queued until the next flush."""
        return sum(t.numel() * t.element_size() for t in self._tensors)

    @property
    def pending_values(self) -> int:
        """How many device values the open step has queued."""
        return len(self._current.names) if self._current is not None else 0

    def discard(self) -> None:
        """Drop the open step and its queued values (a step that did not happen)."""
        if self._current is not None and self._current.names:
            self._tensors, _ = _split_tail(self._tensors, len(self._current.names))
        self._current = None

    def add_host(self, name: str, value: float) -> None:
        if self._current is not None:
            self._current.host[name] = float(value)

    def end(self, *, time: float | None) -> None:
        if self._current is None:
            return
        self._current.time = time
        self._steps.append(self._current)
        self._current = None

    def drain(self) -> list[StepRecord]:
        """One device-to-host copy of everything queued by closed steps; returns their records, oldest
        first."""
        steps, self._steps = self._steps, []
        n_values = sum(len(p.names) for p in steps)
        tensors = self._tensors[: len(self._tensors)]
        if self._current is not None and self._current.names:
            # values of the still-open step stay queued
            keep = len(self._current.names)
            tensors, self._tensors = _split_tail(self._tensors, keep)
        else:
            self._tensors = []
        values = self._to_host(tensors) if n_values else []
        records, i = [], 0
        for p in steps:
            metrics = dict(p.host)
            for name in p.names:
                metrics[name] = values[i]
                i += 1
            records.append(StepRecord(step=p.step, metrics=metrics, batch_index=p.batch_index, time=p.time))
        return records

    def _to_host(self, tensors: list[torch.Tensor]) -> list[float]:
        device = tensors[0].device
        flat = torch.cat([t.to(device=device, dtype=torch.float32) for t in tensors])
        if self.reduce is not None:
            flat = self.reduce(flat)
        if device.type != "cuda":
            return flat.tolist()
        if self._pinned is None or self._pinned.numel() < flat.numel():
            self._pinned = torch.empty(max(flat.numel(), 1024), dtype=torch.float32, pin_memory=True)
        host = self._pinned[: flat.numel()]
        host.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return host.tolist()


def _split_tail(tensors: list[torch.Tensor], n_values: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Split off the trailing tensors holding the last ``n_values`` values."""
    count, cut = 0, len(tensors)
    while count < n_values and cut > 0:
        cut -= 1
        count += tensors[cut].numel()
    return tensors[:cut], tensors[cut:]
