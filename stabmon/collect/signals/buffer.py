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
>>> buf.add(["loss"], torch.tensor(1.5))  # a second micro-batch of the same step: the step keeps the mean
>>> buf.end(time=None)
>>> [r.metrics for r in buf.drain()]
[{'lr': 0.1, 'loss': 2.0, 'grad_norm/a': 0.5, 'grad_norm/b': 1.0}]
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from stabmon.events import StepRecord

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    step: int
    batch_index: int | None
    host: dict[str, float] = field(default_factory=dict)
    host_counts: dict[str, int] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    time: float | None = None


class StepBuffer:
    """Per-step metrics waiting for the next flush; see the module docstring."""

    def __init__(
        self, *, reduce: Callable[[torch.Tensor, Sequence[bool]], torch.Tensor] | None = None,
        maxed: Callable[[str], bool] | None = None, gather: Gather | None = None,
    ) -> None:
        self._tensors: list[torch.Tensor] = []
        self._steps: list[_Pending] = []
        self._ready: list[StepRecord] = []  # closed steps already on the host, still waiting for the flush
        self._stored: set[int] = set()  # ids of loaded ones the store holds already
        self._current: _Pending | None = None
        self._pinned: torch.Tensor | None = None
        self.reduce = reduce
        """Applied to the stacked device vector before the copy, with a flag per value saying whether ``maxed``
        holds for its name (under torch.distributed: the mean over ranks, or the maximum where flagged)."""
        self.maxed = maxed
        self.gather = gather
        """Under torch.distributed: per-rank values of the flushed steps, gathered before the reduction and
        summarised into extra metrics of each step (:class:`~stabmon.collect.cluster.ranks.RankGather`)."""

    @property
    def open(self) -> bool:
        return self._current is not None

    def __len__(self) -> int:
        return len(self._ready) + len(self._steps)

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
        """Queue a host value for the open step; a name given again in the same step keeps the mean (gradient
        accumulation: one loss per micro-batch)."""
        if self._current is None:
            return
        host, counts = self._current.host, self._current.host_counts
        n = counts.get(name, 0)
        host[name] = float(value) if n == 0 else host[name] + (float(value) - host[name]) / (n + 1)
        counts[name] = n + 1

    def end(self, *, time: float | None) -> None:
        if self._current is None:
            return
        self._current.time = time
        self._steps.append(self._current)
        self._current = None

    def settle(self) -> list[StepRecord]:
        """The closed steps' records on the host now (one copy, as a drain makes), still waiting for the flush:
        what a checkpoint written between flushes holds of them (:meth:`state_dict`). One process only: under
        torch.distributed a drain is a collective every rank must reach (there, flush before saving)."""
        self._ready = self.drain()
        return list(self._ready)

    def state_dict(self) -> list[dict[str, Any]]:
        """The closed steps waiting for the flush, as plain values (:meth:`settle` first)."""
        return [{"step": r.step, "metrics": dict(r.metrics), "batch_index": r.batch_index, "time": r.time}
                for r in self._ready]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        """A resume: the steps its checkpoint holds that were never flushed wait for this run's first flush."""
        self._ready = [StepRecord(step=int(r["step"]), metrics={k: float(v) for k, v in r["metrics"].items()},
                                  batch_index=r.get("batch_index"), time=r.get("time")) for r in state or []]

    def mark_stored(self, last_step: int | None) -> None:
        """A resume into a run that already holds steps up to ``last_step``: the loaded steps it holds were
        flushed by the process that wrote them after its checkpoint (only a process that died before its next
        flush left them unstored). They still go through the detectors and the engine (the state they resume
        had not seen them), but not to the store again (:meth:`take_stored`)."""
        if last_step is not None:
            self._stored = {id(r) for r in self._ready if r.step <= last_step}

    def take_stored(self) -> set[int]:
        """The ids of the drained records the store holds already (see :meth:`mark_stored`), once."""
        stored, self._stored = self._stored, set()
        return stored

    def drain(self) -> list[StepRecord]:
        """One device-to-host copy of everything queued by closed steps; returns their records, oldest
        first (those :meth:`settle` read already first of all)."""
        ready, self._ready = self._ready, []
        return ready + self._drain()

    def _drain(self) -> list[StepRecord]:
        steps, self._steps = self._steps, []
        n_values = sum(len(p.names) for p in steps)
        tensors = self._tensors[: len(self._tensors)]
        if self._current is not None and self._current.names:
            # values of the still-open step stay queued
            keep = len(self._current.names)
            tensors, self._tensors = _split_tail(self._tensors, keep)
        else:
            self._tensors = []
        extra = self._gathered(tensors, steps)
        flags = [self.maxed(n) for p in steps for n in p.names] if self.maxed is not None else []
        values = self._to_host_or_each(tensors, flags) if n_values else []
        records, i = [], 0
        for p, more in zip(steps, extra, strict=True):
            metrics = dict(p.host)
            metrics.update(more)
            metrics.update(_means(p.names, values[i : i + len(p.names)]))
            i += len(p.names)
            records.append(StepRecord(step=p.step, metrics=metrics, batch_index=p.batch_index, time=p.time))
        return records

    def _gathered(self, tensors: list[torch.Tensor], steps: list[_Pending]) -> list[dict[str, float]]:
        if self.gather is None:
            return [{} for _ in steps]
        device = tensors[0].device if tensors else torch.device("cpu")
        flat = _flat(tensors, device) if tensors else torch.zeros(0)
        return self.gather.gather(flat, [p.names for p in steps], [p.host for p in steps],
                                  steps=[p.step for p in steps])

    def _to_host_or_each(self, tensors: list[torch.Tensor], flags: Sequence[bool]) -> list[float | None]:
        """All values in one copy; if that fails (one unreadable tensor), tensor by tensor, with None for the
        values that cannot be read."""
        try:
            return list(self._to_host(tensors, flags))
        except Exception:  # noqa: BLE001 - one bad tensor must not cost the whole flush
            if self.reduce is not None:
                raise  # under torch.distributed every rank must take part in the same collective
            log.exception("stabmon: one copy of this flush's metrics failed; reading them one by one")
        out: list[float | None] = []
        for t in tensors:
            try:
                out.extend(t.detach().to("cpu", torch.float64).reshape(-1).tolist())
            except Exception:  # noqa: BLE001
                out.extend([None] * t.numel())
        return out

    def _to_host(self, tensors: list[torch.Tensor], flags: Sequence[bool] = ()) -> list[float]:
        device = tensors[0].device
        # float64 when any value is float64, so a finite value beyond float32's range does not become inf
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
        flat = torch.cat([t.to(device=device, dtype=dtype) for t in tensors])
        if self.reduce is not None:
            flat = self.reduce(flat, flags)
        if device.type != "cuda":
            return flat.tolist()
        if self._pinned is None or self._pinned.numel() < flat.numel() or self._pinned.dtype != dtype:
            self._pinned = torch.empty(max(flat.numel(), 1024), dtype=dtype, pin_memory=True)
        host = self._pinned[: flat.numel()]
        host.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return host.tolist()


def _means(names: Sequence[str], values: Sequence[float | None]) -> dict[str, float]:
    """Each name's value; a name queued more than once in a step (one loss per micro-batch) gets the mean. A
    value that could not be read (None) costs that value only."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for name, value in zip(names, values, strict=True):
        if value is not None:
            sums[name] = sums.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1
    return {name: total if counts[name] == 1 else total / counts[name] for name, total in sums.items()}


def _flat(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.cat([t.to(device=device, dtype=torch.float32) for t in tensors])


class Gather(Protocol):
    def gather(
        self, flat: torch.Tensor, names: Sequence[Sequence[str]], host: Sequence[Mapping[str, float]],
        steps: Sequence[int] = (),
    ) -> list[dict[str, float]]: ...


def _split_tail(tensors: list[torch.Tensor], n_values: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Split off the trailing tensors holding the last ``n_values`` values."""
    count, cut = 0, len(tensors)
    while count < n_values and cut > 0:
        cut -= 1
        count += tensors[cut].numel()
    return tensors[:cut], tensors[cut:]
