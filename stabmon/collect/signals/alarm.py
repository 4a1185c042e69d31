"""The nonfinite alarm: a NaN or inf loss makes the monitor flush at the end of the step it is read in, not up to
``flush_every`` steps later, so the runbook answers before the run trains on for the rest of the interval.

It reads without waiting for the device. Each step's flag (``isfinite`` of the loss, one small kernel) is copied
into one of a few host slots (pinned, ``non_blocking=True``, behind a CUDA event on an accelerator; a plain copy on
the CPU), and the end of the step reads the slots whose copy has landed (``Event.query()`` never blocks): on the
CPU at once, on an accelerator a step or two after the NaN instead of at the next flush. When every slot is still
in flight, a step is not watched (the flush at ``flush_every`` still sees it). A loss given as a Python number is
read as it is.

One process only: under torch.distributed a flush is a collective that every rank must reach on the same step,
and the ranks would not read their flags on the same step, so the monitor leaves the alarm off there.

>>> import torch
>>> alarm = NonfiniteAlarm()
>>> alarm.watch(torch.tensor(2.5)); alarm.rang()
False
>>> alarm.watch(torch.tensor(float("nan"))); alarm.rang(), alarm.rang()
(True, False)
>>> alarm.watch(float("inf")); alarm.rang()
True
"""

from __future__ import annotations

import math
from typing import Any

import torch

_SLOTS = 4


class NonfiniteAlarm:
    """See the module docstring: :meth:`watch` each step's loss, :meth:`rang` at the step's end."""

    def __init__(self) -> None:
        self._rung = False
        self._slots: list[tuple[torch.Tensor, Any]] = []  # (pinned host flag, CUDA event or None: free)
        self._busy: list[int] = []  # slot indices in flight, oldest first

    def watch(self, loss: Any) -> None:
        """This step's loss (a tensor on any device, or a number); never waits for the device."""
        if loss is None:
            return
        if not isinstance(loss, torch.Tensor):
            self._rung |= not math.isfinite(float(loss))
            return
        if loss.device.type == "meta":
            return
        self._drain()
        on_device = loss.device.type == "cuda"
        free = [i for i in range(len(self._slots)) if i not in self._busy]
        if not free and len(self._slots) < _SLOTS:
            self._slots.append((torch.zeros(1, dtype=torch.bool, pin_memory=on_device), None))
            free = [len(self._slots) - 1]
        if not free:
            return  # every slot in flight: the device is more than _SLOTS steps behind; the flush sees it
        i = free[0]
        host, _ = self._slots[i]
        host.copy_(torch.isfinite(loss.detach()).all().logical_not().reshape(1), non_blocking=on_device)
        event = None
        if on_device:
            event = torch.cuda.Event()
            event.record()
        self._slots[i] = (host, event)
        self._busy.append(i)

    def _drain(self) -> None:
        """Read the slots whose copy has landed, oldest first; stop at the first still in flight."""
        while self._busy:
            host, event = self._slots[self._busy[0]]
            if event is not None and not event.query():
                return
            self._rung |= self._read(host)
            self._busy.pop(0)

    @staticmethod
    def _read(host: torch.Tensor) -> bool:
        """A landed slot's flag: host memory the copy has finished writing (no device to wait for)."""
        return bool(host)

    def rang(self) -> bool:
        """Whether a loss read since the last call was NaN or inf (and forget it)."""
        self._drain()
        rung, self._rung = self._rung, False
        return rung
