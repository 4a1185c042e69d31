"""Which samples made each recent step: the evidence :mod:`stabmon.diagnose` re-runs and replays.

:class:`BatchLog` keeps, for the last ``capacity`` steps, the step's batch index (the data cursor's), the batch
object the loader yielded (a reference: nothing is copied), the torch RNG state at the start of the step (so
a re-run draws the same random numbers) and the sample ids a user's ``sample_ids(batch)`` hook gives. The hook
runs on the host when the batch is drawn and must return host values (ints or strings: a dataset's indices,
a document id with an offset); a tensor is refused (reading it back would stall a GPU step).

It exists only when a runbook rung uses ``diagnose`` (and the monitor has checkpoints to diagnose from) or a
``sample_ids`` hook is given. Cost: at most ``capacity`` batch references kept alive (the loader's own
batches, before the loop moves them to a device), and never more than ``max_bytes`` of their tensors (the
oldest entries are dropped first; the newest is always kept), plus ~5 KiB of CPU RNG state per step (and the
CUDA generator's seed and offset when CUDA is in use). A tensor's size is its metadata (``nbytes``): nothing is
read or synchronised.

>>> log = BatchLog(capacity=2, sample_ids=lambda batch: [f"doc{i}" for i in batch])
>>> for step, batch in enumerate([[1, 2], [3, 4], [5, 6]]):
...     log.remember(step=step, batch_index=10 + step, batch=batch)
>>> sorted(log.entries), log.entries[2].sample_ids, log.entries[2].batch_index
([1, 2], ('doc5', 'doc6'), 12)
>>> small = BatchLog(capacity=8, max_bytes=100)
>>> for step in range(3):
...     small.remember(step=step, batch_index=step, batch=(torch.zeros(10), {"y": torch.zeros(2)}))
>>> sorted(small.entries), small.bytes  # 48 bytes a batch: two fit under 100
([1, 2], 96)
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stabmon.interventions.traits import traits_of
from stabmon.pipeline import RunbookEngine

log = logging.getLogger(__name__)

SampleIds = Callable[[Any], Sequence[Any]]
"""``sample_ids(batch) -> the ids of the samples in it`` (host ints or strings)."""


@dataclass(frozen=True)
class BatchEntry:
    """One step's batch: its data position, the batch itself, the RNG state it started with, its sample ids."""

    step: int
    batch_index: int | None
    batch: Any
    rng: torch.Tensor
    cuda_rng: tuple[torch.Tensor, ...] | None = None
    sample_ids: tuple[Any, ...] | None = None
    nbytes: int = 0

    def describe(self) -> dict[str, Any]:
        """Plain values for the record (the batch itself is not stored)."""
        out: dict[str, Any] = {"step": self.step, "batch_index": self.batch_index}
        if self.sample_ids is not None:
            out["sample_ids"] = list(self.sample_ids)
        return out


class BatchLog:
    """The last ``capacity`` steps' batches; see the module docstring."""

    def __init__(self, capacity: int = 256, sample_ids: SampleIds | None = None, *,
                 max_bytes: int | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"diagnose.batches must be >= 1, got {capacity}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"diagnose.max_bytes must be >= 1 (or None: no bound), got {max_bytes}")
        if sample_ids is not None and not callable(sample_ids):
            raise ValueError(f"sample_ids: expected a callable batch -> ids, got {type(sample_ids).__name__}")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0
        self._ids = sample_ids
        self.entries: OrderedDict[int, BatchEntry] = OrderedDict()
        self.errors = 0

    def remember(self, *, step: int, batch_index: int | None, batch: Any) -> None:
        """Keep this step's batch (a step run again after a rollback replaces its old entry)."""
        self._drop(step)
        cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else None
        entry = BatchEntry(step, batch_index, batch, torch.get_rng_state(), cuda, self._sample_ids(batch),
                           tensor_bytes(batch))
        self.entries[step] = entry
        self.bytes += entry.nbytes
        self._bound()

    def _bound(self) -> None:
        while len(self.entries) > self.capacity or (
                self.max_bytes is not None and self.bytes > self.max_bytes and len(self.entries) > 1):
            self._drop(next(iter(self.entries)))

    def _drop(self, step: int) -> None:
        gone = self.entries.pop(step, None)
        if gone is not None:
            self.bytes -= gone.nbytes

    def _sample_ids(self, batch: Any) -> tuple[Any, ...] | None:
        if self._ids is None or batch is None:
            return None
        try:
            ids = self._ids(batch)
            if isinstance(ids, torch.Tensor):
                raise TypeError("sample_ids returned a tensor; return host ints or strings (ids.tolist())")
            return tuple(i if isinstance(i, (int, str)) else str(i) for i in ids)
        except Exception:  # noqa: BLE001 - a broken hook costs the ids, never the step
            self.errors += 1
            if self.errors == 1:
                log.exception("stabmon: sample_ids hook failed (ids not recorded)")
            return None

    def get(self, step: int) -> BatchEntry | None:
        """Step ``step``'s entry, when its batch was handed over."""
        entry = self.entries.get(step)
        return entry if entry is not None and entry.batch is not None else None

    def steps(self) -> list[int]:
        """The steps whose batch was handed over, oldest first."""
        return [step for step, entry in self.entries.items() if entry.batch is not None]

    def handed(self, step: int) -> bool:
        """Whether the loop handed step ``step``'s batch over."""
        return self.get(step) is not None

    def complete(self, *, step: int, batch: Any) -> None:
        """Hand over step ``step``'s batch after :meth:`remember` (a framework that learns it only in the
        forward): the entry keeps the RNG state it started with. No entry for that step: remembered now."""
        entry = self.entries.get(step)
        if entry is None:
            self.remember(step=step, batch_index=None, batch=batch)
            return
        self.bytes -= entry.nbytes
        entry = dataclasses.replace(entry, batch=batch, sample_ids=self._sample_ids(batch), nbytes=tensor_bytes(batch))
        self.entries[step] = entry
        self.bytes += entry.nbytes
        self._bound()

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0


def tensor_bytes(batch: Any, _depth: int = 0) -> int:
    """Bytes of the tensors in a batch (nested tuples, lists and mappings; other objects count 0).

    >>> tensor_bytes({"x": torch.zeros(4, dtype=torch.int64), "meta": ["a", (torch.zeros(2),)]})
    40
    """
    if isinstance(batch, torch.Tensor):
        return batch.nbytes
    if _depth > 8:
        return 0
    if isinstance(batch, Mapping):
        return sum(tensor_bytes(v, _depth + 1) for v in batch.values())
    if isinstance(batch, (tuple, list)):
        return sum(tensor_bytes(v, _depth + 1) for v in batch)
    return 0


def uses_diagnose(engine: Any) -> bool:
    """Does the engine's runbook have a rung that diagnoses?"""
    if not isinstance(engine, RunbookEngine):
        return False
    runbook = engine.runbook
    return runbook is not None and any(traits_of(a).diagnoses for rule in runbook.rules for a in rule.actions)


def batch_log_for(engine: Any, sample_ids: SampleIds | None, *, capacity: int,
                  max_bytes: int | None = None, checkpoints: bool = True) -> BatchLog | None:
    """A batch log when sample ids are asked for, or when the runbook diagnoses and there are checkpoints to
    diagnose from (without them every diagnosis is inconclusive); else None (nothing is kept)."""
    if sample_ids is None and not (checkpoints and uses_diagnose(engine)):
        return None
    return BatchLog(capacity, sample_ids, max_bytes=max_bytes)
