"""Second-moment ratio of Adam/AdamW: ``RMS over elements of g² / v̂`` per tensor, the max over tensors, and
which tensor.

``v̂`` is the optimizer's ``exp_avg_sq`` before this step's update (under amsgrad its running max
``max_exp_avg_sq``, the one the step divides by), bias-corrected with its own step count (``v / (1 - β2^t)``)
and floored at ``eps²`` (the group's ``eps``: Adam adds it to ``sqrt(v)``). A sparse gradient (SparseAdam) is
measured on the rows it has: the others add nothing to the sum. On a healthy
tensor the ratio stays near 1 (its gradient is what its second moment expects); a tensor whose gradient is
suddenly far larger than the average of its recent squares (a rare token's row, a layer that has been quiet)
reads 10-1000x. Adam then takes steps of up to ``1/sqrt(1-β2)`` times the learning rate on it until the second
moment catches up (β2 = 0.999: ~30x), which is the under-estimation StableAdamW (arXiv 2304.13013) found
1-8 iterations before loss spikes, and what SPAM's spike-aware clipping (g² > θ·v) acts on.

An update signal (:class:`~stabmon.collect.step.optim.UpdateSignal`) measured inside the optimizer's pre-hook
(:class:`~stabmon.collect.step.optim.OptimizerHooks`), after unscaling and clipping and before the skip guard hands
its flag to the kernel: the gradients the update will use. With a fused optimizer under a GradScaler the
gradients are still scaled there and are divided by the scale handed to the kernel (the clip folded in); a step
the scaler skips (its ``found_inf``) reads 0. Nothing is read back to the host: per tensor, the sum over its
local elements of ``g²/v̂`` and its element count are stacked on the device. Under FSDP2/FSDP1 both vectors
are summed over ranks (the ranks' shards of a tensor together hold its elements) before the square root, so the
value is the unsharded one on every rank.

Cost: on a sampled step only (``config.moments.every``), one read of each gradient and ``exp_avg_sq`` with
one tensor's fp32 transient at a time (plus one ``all_reduce`` of two small vectors when sharded); unsampled
steps pay nothing. A tensor without a gradient or without optimizer state yet reads 0.

>>> import torch
>>> torch.manual_seed(0) and None
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
>>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999))
>>> ratios = MomentRatios(opt, list(model.named_parameters()))
>>> for _ in range(20):
...     opt.zero_grad(); model(torch.randn(8, 4)).pow(2).mean().backward(); opt.step()
>>> opt.zero_grad(); model(torch.randn(8, 4)).pow(2).mean().backward()
>>> _ = model[0].weight.grad.mul_(100.0)          # a sudden gradient in one tensor
>>> names, values = ratios.measure()
>>> names[0], names[values[1:].argmax() + 1], bool(values[0] > 30)
('moment_ratio', 'moment_ratio/0.weight', True)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from stabmon.collect.cluster.sharding import ShardedSquares, clean_name, local
from stabmon.collect.signals.grads import gradient_entries
from stabmon.events import Metric

log = logging.getLogger(__name__)

SECOND_MOMENT = "exp_avg_sq"
"""The optimizer-state key of Adam's second moment (torch's Adam, AdamW, NAdam, RAdam, SparseAdam; fused and
foreach)."""
RUNNING_MAX = "max_exp_avg_sq"
"""The state key of amsgrad's running max of the second moment: what an amsgrad step divides by."""

_KEEPS_SECOND_MOMENT = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam,
                        torch.optim.SparseAdam)


def not_applicable(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the moment ratio cannot be measured for ``optimizer`` (one line), or None. A torch optimizer
    outside the Adam family keeps no ``exp_avg_sq``; any other class is trusted until its state says otherwise.

    >>> not_applicable(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
    'config.moments: SGD keeps no exp_avg_sq (not applicable): moment ratios are off'
    """
    cls = type(optimizer)
    if isinstance(optimizer, _KEEPS_SECOND_MOMENT) or not cls.__module__.startswith("torch.optim"):
        return None
    return f"config.moments: {cls.__name__} keeps no {SECOND_MOMENT} (not applicable): moment ratios are off"


class MomentRatios:
    """Per-tensor ``RMS(g² / v̂)`` from the optimizer's second moment; see the module docstring."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_params: Sequence[tuple[str, nn.Parameter]],
        *,
        per_tensor: bool = True,
        sharded: ShardedSquares | None = None,
    ) -> None:
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        watched = [(clean_name(n), p) for n, p in named_params if p.requires_grad]
        self._params = [(p, group_of.get(id(p))) for _, p in watched]
        self._optimizer = optimizer
        self._state = optimizer.state
        self._sharded = sharded
        self._per_tensor = per_tensor
        self.names = [Metric.MOMENT_RATIO] + ([Metric.MOMENT_RATIO_PREFIX + n for n, _ in watched] if per_tensor
                                              else [])
        self.off = False
        """Set when the optimizer's state turned out to hold no ``exp_avg_sq`` (logged once)."""
        self._measured: tuple[list[str], torch.Tensor] | None = None

    def before_update(self) -> None:
        """Inside ``optimizer.step()``, once the gradients are final: measure them against ``exp_avg_sq``. A
        GradScaler hands a fused optimizer its divisor and overflow flag as the attributes ``grad_scale`` and
        ``found_inf`` for the step (torch's handoff)."""
        grad_scale = getattr(self._optimizer, "grad_scale", None)
        found_inf = getattr(self._optimizer, "found_inf", None) if grad_scale is not None else None
        self._measured = self.measure(grad_scale, found_inf)

    def after_update(self) -> tuple[list[str], torch.Tensor | None]:
        """(names, the values :meth:`before_update` measured), or (names, None) when nothing was measured."""
        measured, self._measured = self._measured, None
        return measured if measured is not None else (self.names, None)

    def measure(
        self, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None
    ) -> tuple[list[str], torch.Tensor] | None:
        """(names, values on the device: the max first, then one per tensor) for the gradients as the update
        will see them (``grad_scale``: the divisor a fused kernel applies), or None when there is no state yet
        (the first step) or no second moment at all."""
        if self.off or not self._params:
            return None
        sums: list[torch.Tensor] = []
        counts: list[float] = []
        found = False
        for p, group in self._params:
            state = self._state.get(p)
            v = _second_moment(state, group) if state and group is not None else None
            if p.grad is None or v is None or group is None or not state:
                sums.append(torch.zeros((), device=local(p.detach()).device))
                counts.append(0.0)
                continue
            found = True
            g, v = gradient_entries(p, local(v))  # a sparse gradient: the rows it has (the others add 0)
            sums.append(_ratio_sum(local(g.detach()), v, state.get("step"), group))
            counts.append(float(local(p.detach()).numel()))
        if not found:
            self._check_state()
            return None
        return self._finish(sums, counts, grad_scale, found_inf)

    def _finish(self, sums: list[torch.Tensor], counts: list[float], grad_scale: torch.Tensor | None,
                found_inf: torch.Tensor | None) -> tuple[list[str], torch.Tensor]:
        device = sums[0].device
        total = torch.stack([s.to(device) for s in sums])
        n = torch.tensor(counts, device=device)
        if self._sharded is not None:  # shards of one tensor on several ranks: sum both before dividing
            total, n = self._sharded(total), self._sharded(n)
        if grad_scale is not None:  # the gradients are still scaled: g² / scale²
            total = total / grad_scale.to(device, total.dtype).square()
        rms = (total / n.clamp(min=1.0)).sqrt()
        if found_inf is not None:  # the scaler skips this step: nothing is under-estimated
            rms = torch.where(found_inf.to(device) > 0, torch.zeros_like(rms), rms)
        head = rms.max().reshape(1)
        return self.names, torch.cat([head, rms]) if self._per_tensor else head

    def _check_state(self) -> None:
        """No tensor had a second moment: once the optimizer has state, it never will (logged once)."""
        if any(self._state.get(p) for p, _ in self._params):
            self.off = True
            log.warning("stabmon: config.moments: the optimizer's state holds no %s (not applicable): moment "
                        "ratios are off", SECOND_MOMENT)


def _second_moment(state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor | None:
    """The second moment the update divides by: amsgrad's running max where the group uses it, else
    ``exp_avg_sq`` (None: the state keeps neither)."""
    if group.get("amsgrad") and state.get(RUNNING_MAX) is not None:
        return state[RUNNING_MAX]
    return state.get(SECOND_MOMENT)


def _ratio_sum(g: torch.Tensor, v: torch.Tensor, step: object, group: dict[str, Any]) -> torch.Tensor:
    """``sum(g² / max(v / (1 - β2^t), eps²))`` in fp32, on the device (``t``: the state's step count)."""
    beta2 = float(group.get("betas", (0.9, 0.999))[1])
    eps = float(group.get("eps", 1e-8))
    with torch.no_grad():
        vf = v.float()
        if isinstance(step, torch.Tensor):
            vf = vf / (1.0 - beta2 ** step.to(vf.device, torch.float32)).clamp(min=1e-12)
        elif isinstance(step, (int, float)) and step > 0:
            vf = vf / (1.0 - beta2**step)
        return (g.float().square() / vf.clamp(min=eps * eps)).sum()
