"""Counting host reads of tensors: the no-host-sync tests share one TorchFunctionMode."""

from __future__ import annotations

from typing import Any

from torch.overrides import TorchFunctionMode

SYNCS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy"}


class SyncCounter(TorchFunctionMode):
    """Counts host reads (``.item()``, ``bool()``, ``.tolist()``, ...) by name, and separates those made while
    ``in_flush`` is set (a test sets it around the monitor's flush) from all others."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}
        self.in_flush = 0
        self.outside: list[str] = []
        self.inside: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in SYNCS:
            self.calls[name] = self.calls.get(name, 0) + 1
            (self.inside if self.in_flush else self.outside).append(name)
        return func(*args, **(kwargs or {}))
