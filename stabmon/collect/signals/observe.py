"""What :meth:`stabmon.monitor.Monitor.observe` accepts, checked from metadata only (no host sync).

>>> import torch
>>> value_problem("loss", torch.tensor(1.0)) is None, value_problem("n", 3) is None
(True, True)
>>> value_problem("loss", torch.empty((), device="meta"))
"observe: loss is a tensor on the 'meta' device, which holds no value"
>>> value_problem("loss", torch.ones(3))
Traceback (most recent call last):
...
ValueError: observe: loss must hold exactly one value, got shape (3,)
"""

from __future__ import annotations

import numbers
from typing import Any

import torch


def value_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be recorded as metric ``name`` (a dropped value), or None when it can.

    Raises ``ValueError`` for a usage error that would repeat at every step (a tensor of several values, or
    an object that is not a number at all)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"observe: {name} must hold exactly one value, got shape {tuple(value.shape)}")
        if value.is_meta:
            return f"observe: {name} is a tensor on the 'meta' device, which holds no value"
        if value.is_complex():
            return f"observe: {name} is a complex tensor ({value.dtype}); record a real part or a magnitude"
        return None
    if isinstance(value, numbers.Real):  # int, float, bool and numpy scalars
        return None
    if isinstance(value, numbers.Complex):
        return f"observe: {name} is a complex number"
    if hasattr(value, "item") and getattr(value, "shape", None) in ((), (1,)):  # a 0-d / 1-element array
        return value_problem(name, value.item())
    raise ValueError(f"observe: {name} must be a tensor or a number, got {type(value).__name__}")
