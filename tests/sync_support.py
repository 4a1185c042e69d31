"""Counting host reads of tensors: the no-host-sync tests share one TorchFunctionMode."""

from __future__ import annotations

from typing import Any

from torch.overrides import TorchFunctionMode

SYNCS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy"}


class SyncCounter(TorchFunctionMode):
    """Counts host reads (``.item()``, ``bool()``, ``.tolist()``, ...) by name, and separates those made while
    ``in_flush`` is set (a test sets it around the monitor's flush), those made while ``in_landed`` is set (around
    the nonfinite alarm's read of a host slot whose copy has landed: host memory, no device to wait for) and all
    others."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}
        self.in_flush = 0
        self.in_landed = 0
        self.landed: list[str] = []
        self.outside: list[str] = []
        self.inside: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in SYNCS:
            self.calls[name] = self.calls.get(name, 0) + 1
            (self.inside if self.in_flush else self.landed if self.in_landed else self.outside).append(name)
        return func(*args, **(kwargs or {}))


def count_alarm_reads(monitor: Any, counter: SyncCounter) -> None:
    """Put the monitor's nonfinite alarm reads (a host slot whose copy has landed: no device to wait for) in
    ``counter.landed`` instead of with the others."""
    alarm = monitor._alarm
    if alarm is None:
        return
    real = alarm._read

    def read(host: Any) -> float:
        assert host.device.type == "cpu"
        counter.in_landed += 1
        try:
            return float(real(host))
        finally:
            counter.in_landed -= 1

    alarm._read = read


def without_landed(counter: SyncCounter) -> dict[str, int]:
    """``counter.calls`` less the reads counted in ``counter.landed``."""
    calls = dict(counter.calls)
    for name in counter.landed:
        calls[name] -= 1
    return {name: n for name, n in calls.items() if n}
