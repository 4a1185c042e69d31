"""The loss alarm: a NaN or inf loss, or one that jumps far above its running mean, makes the monitor flush at the
end of the step it is read in, not up to ``flush_every`` steps later, so the detectors see it and the runbook
answers before the run trains on for the rest of the interval.

The jump (``rise``, ``MonitorConfig.flush_on_rise``; judged on the host by
:class:`~stabmon.collect.signals.jump.LossJump`): a finite loss above ``rise`` times the running mean of the losses
before it, and above that mean by ``z`` (6) times their running absolute deviation from it (exponential means,
decay ``0.95``, plain averages while they hold fewer than 20 losses; a positive mean; nothing rings over the first
``warmup`` losses): a small batch's loss that moves +-50% from step to step does not ring on its noise.
The means take in every finite loss, the jump's too, so a loss that stays up rings for a few steps while they
catch up, not for ever. The alarm only moves a flush earlier: what the detectors report on the records, and so
every decision, is theirs; on a healthy run it costs at most a few extra flushes.

It reads without waiting for the device. Each step's loss (one value; the mean of a loss that is not a scalar) is
copied into one of a few host slots (pinned, ``non_blocking=True``, behind a CUDA event on an accelerator; a plain
copy on the CPU), and the end of the step reads the slots whose copy has landed (``Event.query()`` never blocks)
and judges them on the host: on the CPU at once, on an accelerator a step or two after the NaN instead of at the
next flush. When every slot is still in flight, a step is not watched (the flush at ``flush_every`` still sees
it). A loss given as a Python number is read as it is.

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
>>> alarm = NonfiniteAlarm(rise=1.5, warmup=3)
>>> rang = []
>>> for loss in (2.0, 2.0, 2.0, 2.1, 3.5, 2.0): alarm.watch(torch.tensor(loss)); rang.append(alarm.rang())
>>> rang   # the fifth loss is 1.75x the mean of the four before it, which hardly moved
[False, False, False, False, True, False]
"""

from __future__ import annotations

from typing import Any

import torch

from stabmon.collect.signals.jump import LossJump

_SLOTS = 4


class NonfiniteAlarm:
    """See the module docstring: :meth:`watch` each step's loss, :meth:`rang` at the step's end."""

    def __init__(self, rise: float | None = None, *, z: float = 6.0, warmup: int = 20, decay: float = 0.95) -> None:
        self._jump = LossJump(rise, z=z, warmup=warmup, decay=decay)
        self._rung = False
        self._slots: list[tuple[torch.Tensor, Any]] = []  # (pinned host value, CUDA event or None: free)
        self._busy: list[int] = []  # slot indices in flight, oldest first

    def watch(self, loss: Any) -> None:
        """This step's loss (a tensor on any device, or a number); never waits for the device."""
        if loss is None:
            return
        if not isinstance(loss, torch.Tensor):
            self._rung |= self._jump.judge(float(loss))
            return
        if loss.device.type == "meta":
            return
        self._drain()
        on_device = loss.device.type == "cuda"
        free = [i for i in range(len(self._slots)) if i not in self._busy]
        if not free and len(self._slots) < _SLOTS:
            self._slots.append((torch.zeros(1, dtype=torch.float32, pin_memory=on_device), None))
            free = [len(self._slots) - 1]
        if not free:
            return  # every slot in flight: the device is more than _SLOTS steps behind; the flush sees it
        i = free[0]
        host, _ = self._slots[i]
        value = loss.detach()
        if value.numel() != 1:  # (its metadata: no device read) a NaN or inf anywhere makes the mean one
            value = value.float().mean()
        host.copy_(value.reshape(1), non_blocking=on_device)
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
            self._rung |= self._jump.judge(self._read(host))
            self._busy.pop(0)

    @staticmethod
    def _read(host: torch.Tensor) -> float:
        """A landed slot's loss: host memory the copy has finished writing (no device to wait for)."""
        return float(host)

    def rang(self) -> bool:
        """Whether a loss read since the last call was NaN or inf, or jumped (and forget it)."""
        self._drain()
        rung, self._rung = self._rung, False
        return rung
