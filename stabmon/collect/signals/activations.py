"""Activation RMS of selected modules' outputs, through forward hooks that exist only on sampled steps.

Hooks are registered when a sampled step begins and removed after its forward pass, so unsampled steps pay
nothing. Each hook stores ``||y|| / sqrt(numel(y))`` of the module's first tensor output as a device tensor.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
>>> acts = ActivationNorms(model)
>>> acts.names
['0', '1']
>>> acts.arm()
>>> _ = model(torch.ones(2, 4))
>>> names, values = acts.collect()
>>> names, values.shape
(['0', '1'], torch.Size([2]))
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from stabmon.collect.cluster.sharding import clean_name
from stabmon.collect.signals.grads import default_blocks


def select_modules(
    model: nn.Module, patterns: Sequence[str] | None, *, path: str
) -> list[tuple[str, nn.Module]]:
    """Modules to watch: pattern matches (full match on the module name), else the default blocks."""
    named: dict[str, nn.Module] = {}
    for n, m in model.named_modules():  # names without DDP/FSDP wrapper prefixes; the outer wrapper wins
        named.setdefault(clean_name(n), m)
    if patterns is None:
        names = default_blocks(model) or [n for n, _ in model.named_children()]
        return [(n, named[n]) for n in names]
    out: dict[str, nn.Module] = {}
    for pat in patterns:
        try:
            rx = re.compile(pat)
        except re.error as exc:
            raise ValueError(f"{path}: invalid pattern {pat!r}: {exc}") from None
        hits = [n for n in named if n and rx.fullmatch(n)]
        if not hits:
            raise ValueError(f"{path}: pattern {pat!r} matches no module of the model")
        for n in hits:
            out.setdefault(n, named[n])
    return list(out.items())


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor):
                return item
    if isinstance(output, dict):
        for item in output.values():
            if isinstance(item, torch.Tensor):
                return item
    return None


CHUNK = 1 << 22
"""Elements per fp32 chunk when a low-precision CPU tensor's norm is taken piecewise."""


def rms(y: torch.Tensor) -> torch.Tensor:
    """``||y|| / sqrt(numel(y))`` accumulated in fp32 without an fp32 copy of ``y``: CUDA reduces bf16/fp16 in
    fp32 on the fly; on CPU, where the norm would first convert the whole tensor, it goes by chunks of
    :data:`CHUNK` elements (at most 16 MiB transient).

    >>> rms(torch.full((3, 4), 2.0, dtype=torch.bfloat16)).item()
    2.0
    """
    if y.dtype == torch.float32 or y.is_cuda or y.numel() <= CHUNK:
        norm = torch.linalg.vector_norm(y, dtype=torch.float32)
    else:
        parts = [torch.linalg.vector_norm(c, dtype=torch.float32) for c in y.reshape(-1).split(CHUNK)]
        norm = torch.linalg.vector_norm(torch.stack(parts))
    return norm / math.sqrt(y.numel())


class ActivationNorms:
    """RMS of each selected module's output on armed (sampled) steps; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        patterns: Sequence[str] | None = None,
        *,
        path: str = "config.activations.modules",
    ) -> None:
        self._modules = select_modules(model, patterns, path=path)
        self.names = [n for n, _ in self._modules]
        self._handles: list[Any] = []
        self._values: dict[int, torch.Tensor] = {}

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        """Register the forward hooks for the coming forward pass."""
        self.disarm()
        self._values = {}
        for i, (_, module) in enumerate(self._modules):
            self._handles.append(module.register_forward_hook(self._hook(i)))

    def disarm(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, i: int):  # noqa: ANN202 - torch hook signature
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            y = _first_tensor(output)
            if y is None or i in self._values or y.numel() == 0:
                return
            with torch.no_grad():
                self._values[i] = rms(y.detach())

        return hook

    def collect(self) -> tuple[list[str], torch.Tensor | None]:
        """Disarm and return (names, stacked RMS values) of the modules that ran."""
        self.disarm()
        if not self._values:
            return [], None
        keys = sorted(self._values)
        device = self._values[keys[0]].device
        values = torch.stack([self._values[k].to(device) for k in keys])
        self._values = {}
        return [self.names[k] for k in keys], values
