"""Scale of the output logits on a sub-batch of sampled steps: ``logit_max`` (max |logit|) and ``logit_logz``
(max over positions of |log Z|, ``log Z = logsumexp`` of a position's logits, what z-loss penalises).

Without z-loss, a high learning rate lets the output logits drift far from log Z = 0 until the softmax's
gradients vanish or explode (output-logit divergence, Wortsman et al. 2023, arXiv 2309.14322). A forward hook
on the output layer, registered only for a sampled step's forward, reduces the first ``sub_batch`` rows of its
output to the two values on the device; unsampled steps run no hook.

The output layer is ``config.logits.module`` when given, else the model's last ``nn.Linear`` when it maps onto
the vocabulary (:func:`stabmon.collect.signals.vocab.output_classes`); a model without one gets a one-line warning at
start (not applicable) and no signal.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5))
>>> out = OutputLogits(model)
>>> out.name, out.names
('1', ['logit_max', 'logit_logz'])
>>> out.arm(); _ = model(torch.tensor([[0, 1, 2]])); names, values = out.collect()
>>> values.shape, bool(values[0] > 0)
(torch.Size([2]), True)
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from stabmon.collect.cluster.sharding import clean_name
from stabmon.collect.signals.activations import _first_tensor
from stabmon.collect.signals.vocab import output_classes
from stabmon.events import Metric

log = logging.getLogger(__name__)


def output_layer(model: nn.Module, name: str | None, *, path: str = "config.logits.module") -> tuple[str, nn.Module]:
    """(name, module) of the output layer; ``ValueError`` naming ``path`` when ``name`` is no module, or when
    none is given and the model has no vocabulary head (the caller reports it as not applicable)."""
    named = {clean_name(n): m for n, m in model.named_modules()}
    if name is not None:
        if name not in named:
            raise ValueError(f"{path}: {name!r} is not a module of the model")
        return name, named[name]
    classes = output_classes(model)
    last = [(n, m) for n, m in named.items() if isinstance(m, nn.Linear)]
    if classes is None or not last or last[-1][1].out_features != classes:
        raise ValueError(f"{path}: the model has no output layer over its vocabulary (not applicable); name one")
    return last[-1]


class OutputLogits:
    """``logit_max`` and ``logit_logz`` of the output layer on armed steps; see the module docstring."""

    names = [Metric.LOGIT_MAX, Metric.LOGIT_LOGZ]

    def __init__(self, model: nn.Module, module: str | None = None, *, sub_batch: int = 1) -> None:
        self.name, self._module = output_layer(model, module)
        self._sub_batch = sub_batch
        self._handle: Any = None
        self._value: torch.Tensor | None = None

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def arm(self) -> None:
        self.disarm()
        self._value = None
        self._handle = self._module.register_forward_hook(self._hook)

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        y = _first_tensor(output)
        if y is None or self._value is not None or y.numel() == 0:
            return
        with torch.no_grad():
            z = y.detach()[: self._sub_batch].float() if y.dim() > 1 else y.detach().float()
            logz = torch.logsumexp(z, dim=-1).abs().amax()
            self._value = torch.stack([z.abs().amax(), logz])

    def collect(self) -> tuple[list[str], torch.Tensor | None]:
        self.disarm()
        value, self._value = self._value, None
        return (list(self.names), value) if value is not None else ([], None)
