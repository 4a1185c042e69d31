"""The update norm ``||Δθ|| / ||θ||``, global and per layer: the step the optimizer actually applied, against
the weights as they were before it. A layer whose weights were all zero before the step (LoRA's ``B``, a
zero-initialised output head) has no ratio on that step (``inf``): measured against the weights after it, its
first step read exactly 1, thousands of times the other layers', and warned on every such run's first sample.

On a sampled step the optimizer pre-hook, after clipping, the skip guard and the overrides have been applied,
copies the parameters with one fused ``torch._foreach_mul`` (:meth:`UpdateNorms.before_update`); the post-hook,
after the skip guard restored a discarded update, takes the copy's norms, subtracts the new parameters in place
from it and takes the norms of ``Δθ`` (two fused ``torch._foreach_norm``), scatter-added into the same layers as
the gradient norms (:class:`~stabmon.collect.signals.grads.GradNorms`). Nothing is read back to the host; a skipped
update (skip
guard, GradScaler overflow) reads 0. Under FSDP the squared norms of the shards are summed over ranks the way
the gradient norms are.

Cost: on a sampled step only, one transient copy of the parameters (their own dtype) from the pre-hook to the
post-hook, and three fused passes over them; unsampled steps pay nothing (``config.updates.every``). With torch's
Adam/AdamW, :class:`AdamUpdateNorms` recomputes the step from the optimizer state instead, with no copy: that one
is on by default.

>>> import torch
>>> from stabmon.collect.signals.grads import GradNorms
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> upd = UpdateNorms(GradNorms(model))
>>> model(torch.ones(1, 2)).sum().backward()
>>> upd.before_update(); opt.step(); names, values = upd.after_update()
>>> names[:2], values.shape, bool((values > 0).all())
(['update_ratio', 'update_ratio/0'], torch.Size([3]), True)
"""

from __future__ import annotations

from typing import Any

import torch

from stabmon.collect.cluster.sharding import local
from stabmon.collect.signals.grads import GradNorms
from stabmon.events import Metric


class UpdateNorms:
    """Per-layer ``||Δθ|| / ||θ||`` of one optimizer step; see the module docstring."""

    def __init__(self, grads: GradNorms) -> None:
        self._params = grads.params
        self._squares = grads.sharded
        self.names = [Metric.UPDATE_RATIO] + [Metric.UPDATE_RATIO_PREFIX + n for n in grads.layer_names]
        self._n_layers = len(grads.layer_names)
        self._layer_idx = grads.layer_index
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None
        self._saved: list[torch.Tensor] | None = None

    def before_update(self) -> None:
        """Inside ``optimizer.step()``, once the gradients are final: keep the parameters as they are."""
        with torch.no_grad():
            self._saved = list(torch._foreach_mul([local(p.detach()) for p in self._params], 1.0))

    def after_update(self) -> tuple[list[str], torch.Tensor | None]:
        """After the update: (names, stacked ratios on the device), global first; (names, None) when
        :meth:`before_update` was not called this step."""
        saved, self._saved = self._saved, None
        if saved is None or not saved:
            return self.names, None
        live = [local(p.detach()) for p in self._params]
        with torch.no_grad():
            theta = _squares(saved)
            torch._foreach_sub_(saved, live)  # saved now holds -Δθ
            delta = _squares(saved)
        if self._squares is not None:
            delta, theta = self._squares(delta), self._squares(theta)
        return self.names, self._ratios(delta, theta)

    def _ratios(self, delta: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        """sqrt(delta / theta), global first then per layer, from per-tensor squared norms of the step and of the
        weights before it. A layer whose weights were all zero before the step (zero-initialised: LoRA's B, a
        zero-init output head) has no ratio: ``inf`` where it moved (:data:`FROM_ZERO`), 0 where it did not."""
        ratios = [_ratio(delta.sum(), theta.sum())]
        if self._n_layers:
            ratios.append(_ratio(self._per_layer(delta), self._per_layer(theta)))
        return torch.cat([r.reshape(-1) for r in ratios])

    def _per_layer(self, sq: torch.Tensor) -> torch.Tensor:
        if self._index is None:
            pos = [i for i, layer in enumerate(self._layer_idx) if layer >= 0]
            self._index = (
                torch.tensor(pos, dtype=torch.long, device=sq.device),
                torch.tensor([self._layer_idx[i] for i in pos], dtype=torch.long, device=sq.device),
            )
        out = torch.zeros(self._n_layers, device=sq.device, dtype=sq.dtype)
        return out.index_add_(0, self._index[1], sq.index_select(0, self._index[0]))


class AdamUpdateNorms(UpdateNorms):
    """The same ratios with no copy of the parameters, for torch's Adam/AdamW: after the step, each tensor's
    ``Δθ`` is recomputed from the optimizer's state, ``-lr (m^ / (sqrt(v^) + eps))`` and, with decoupled weight
    decay, ``- lr wd θ_prev`` where ``θ_prev = (θ + lr u) / (1 - lr wd)``: exact for the step torch's kernels
    (for-loop, foreach, fused) take; ``θ_prev`` is also the ratio's denominator. ``lr`` is the learning rate in
    force (overrides applied); a skipped update (the skip guard, a fused GradScaler overflow) reads 0. Cost on a
    sampled step: foreach kernels over each param group's tensors in chunks of :data:`CHUNK` elements (a larger
    tensor alone), a few passes over their moments and weights and the chunk's fp32 transients; nothing on other
    steps, nothing kept.

    Changes made to the weights after the kernel (``clip_update``'s cap, a standing QK-clip's rescale) are not in
    it: it is the optimizer's step. Under FSDP2 each rank recomputes its own shards (DTensor parameters and state
    alike) and the per-tensor squares are summed over ranks with one ``all_reduce`` on a sampled step, as the
    gradient norms are; FSDP1's flat parameters use the copy (:class:`UpdateNorms`).

    >>> import torch
    >>> from stabmon.collect.signals.grads import GradNorms
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    >>> exact, cheap = UpdateNorms(GradNorms(model)), AdamUpdateNorms(GradNorms(model), opt)
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> exact.before_update(); cheap.before_update(); opt.step()
    >>> cheap.step_taken([0.1], None)
    >>> bool(torch.allclose(exact.after_update()[1], cheap.after_update()[1], rtol=1e-4))
    True
    """

    def __init__(self, grads: GradNorms, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(grads)
        self._optimizer = optimizer
        self._position = {id(p): k for k, p in enumerate(self._params)}
        self._lrs: list[Any] = []
        self._skipped: torch.Tensor | None = None
        self._sampled = False

    def before_update(self) -> None:
        self._sampled = True

    def step_taken(self, lrs: list[Any], skipped: torch.Tensor | None) -> None:
        """What the optimizer hooks know of the step just taken: each group's LR in force, and the skip flag."""
        self._lrs, self._skipped = lrs, skipped

    def after_update(self) -> tuple[list[str], torch.Tensor | None]:
        if not self._sampled or not self._params:
            return self.names, None
        self._sampled = False
        from stabmon.collect.step.inplace import adam_params_by_group

        live = [local(p.detach()) for p in self._params]
        groups = self._optimizer.param_groups
        with torch.no_grad():
            now = _squares(live)
            rows: list[int] = []
            steps: list[torch.Tensor] = []
            befores: list[torch.Tensor] = []
            chunk: list[tuple[int, dict[str, Any]]] = []
            size, at = 0, -1  # elements in the chunk, and its param group
            for i, p, state in adam_params_by_group(self._optimizer):
                k = self._position.get(id(p))
                if k is None or i >= len(self._lrs):
                    continue
                if chunk and (i != at or size + live[k].numel() > CHUNK):
                    _adam_step_squares(groups[at], self._lrs[at], chunk, live, rows, steps, befores)
                    chunk, size = [], 0
                chunk.append((k, state))
                size, at = size + live[k].numel(), i
            if chunk:
                _adam_step_squares(groups[at], self._lrs[at], chunk, live, rows, steps, befores)
            delta = torch.zeros_like(now)
            theta = now  # a tensor the step left alone is as it was before
            if rows:
                where = torch.tensor(rows, device=now.device)
                delta[where] = torch.stack(steps).to(now.device).square()
                theta = now.index_copy(0, where, torch.stack(befores).to(now.device).square())
            if self._skipped is not None:
                skipped = self._skipped.to(delta.device)
                delta = torch.where(skipped, torch.zeros_like(delta), delta)
                theta = torch.where(skipped, now, theta)
        if self._squares is not None:  # FSDP2: each rank recomputed its own shards; sum them over ranks
            delta, theta = self._squares(delta), self._squares(theta)
        return self.names, self._ratios(delta, theta)


CHUNK = 1 << 23
"""Elements recomputed together (one set of fp32 transients, foreach kernels over them); a larger tensor alone."""


def _adam_step_squares(group: dict[str, Any], lr: Any, chunk: list[tuple[int, dict[str, Any]]],
                       live: list[torch.Tensor], rows: list[int], steps: list[torch.Tensor],
                       befores: list[torch.Tensor]) -> None:
    """Append the norms of the step Adam took on each tensor of ``chunk`` (position, state) and of the tensor
    before it, recomputed as torch's kernels take it: ``θ_prev (1 - lr wd) - lr m^ / (sqrt(v^) + eps)``, so the
    step is ``lr (u + wd θ_prev)`` with ``θ_prev = (θ + lr u) / (1 - lr wd)``. Foreach kernels over the chunk:
    a few dozen dispatches for it, not a few dozen per tensor."""
    beta1, beta2 = group["betas"]
    wd = float(group.get("weight_decay", 0.0)) if group.get("decoupled_weight_decay", True) else 0.0
    m = [local(state["exp_avg"]) for _, state in chunk]
    counts = [state["step"] for _, state in chunk]
    theta = [live[k] for k, _ in chunk]
    n = [local(c).to(torch.float32) if isinstance(c, torch.Tensor) else torch.tensor(float(c)) for c in counts]
    bc1 = list(torch._foreach_pow(beta1, n))  # tensor math, never read back: the counters may be on the device
    torch._foreach_neg_(bc1)
    torch._foreach_add_(bc1, 1)
    bc2 = list(torch._foreach_pow(beta2, n))
    torch._foreach_neg_(bc2)
    torch._foreach_add_(bc2, 1)
    torch._foreach_sqrt_(bc2)
    if n[0].device != m[0].device:  # torch's default kernels keep the counters on the host: copy them over
        bc1, bc2 = [b.to(m[0].device) for b in bc1], [b.to(m[0].device) for b in bc2]
    u = torch._foreach_sqrt([local(state["exp_avg_sq"]) for _, state in chunk])
    torch._foreach_div_(u, bc2)
    torch._foreach_add_(u, group["eps"])
    torch._foreach_div_(u, m)  # denominator / m: inverted below, so that m is read once and not copied
    torch._foreach_reciprocal_(u)
    torch._foreach_div_(u, bc1)
    torch._foreach_mul_(u, lr)  # lr u: what the kernel subtracted besides the decay
    before = torch._foreach_add(theta, u)
    if wd:
        torch._foreach_mul_(before, 1 / (1 - lr * wd))
        torch._foreach_add_(u, torch._foreach_mul(before, lr * wd))
    rows.extend(k for k, _ in chunk)
    steps.extend(torch._foreach_norm(u, 2, dtype=torch.float32))
    befores.extend(torch._foreach_norm(before, 2, dtype=torch.float32))


FROM_ZERO = 1e3
"""A ratio above this reads ``inf``: the weights before the step were under 1/1000 of the step, i.e. zero but for
the rounding of recomputing them (``θ + Δθ`` in fp32 leaves ~1e-6 of the step)."""


def _ratio(delta: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """sqrt(delta / theta); ``inf`` where the weights were (all but) zero before a step that moved them, 0 where
    nothing moved."""
    moved_from_zero = delta > theta * FROM_ZERO**2
    return torch.where(moved_from_zero, torch.inf, delta / theta.clamp_min(torch.finfo(theta.dtype).tiny)).sqrt()


def _squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Squared fp32 L2 norm of each tensor (one fused kernel per device), stacked on the first's device."""
    device = tensors[0].device
    if all(t.device == device for t in tensors):
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square()
    return torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32).to(device) for t in tensors]).square()
