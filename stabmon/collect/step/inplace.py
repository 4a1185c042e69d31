"""State-level fixes applied inside ``optimizer.step()`` while an intervention has them on.

Three per-step mechanisms, each off (and free) until an override turns it on:

* :class:`AdaptiveClip` (``overrides.adaptive_clip``, AdaGC arXiv 2502.11034): each gradient tensor is clipped to
  ``lambda x`` the running mean of its own clipped norm, ``ema = beta ema + (1 - beta) min(norm, lambda ema)``.
  The per-tensor norms are the ones :class:`~stabmon.collect.signals.grads.GradNorms` computed anyway (summed over ranks
  under FSDP, so every rank scales its shard by the same coefficient); the only extra work is one
  ``_foreach_mul_``. The running mean starts at the norms of the step it is turned on (no clipping on that step)
  and lives on the device; it is not part of ``state_dict`` (a resumed run starts it again).
* :class:`ElementSkip` (``overrides.skip_theta``, SPAM arXiv 2501.06842): gradient elements with
  ``g^2 > theta x v`` (``v``: Adam's ``exp_avg_sq``, where non-zero) are zeroed before the step, one tensor at a
  time (temporaries of the largest tensor only). Element-wise, so a shard is judged on its own elements alike on
  every rank, and a sparse gradient (SparseAdam) on the rows it has. ``v`` is the moving average even under
  amsgrad, not its running max: a spike judged against the max would be let into the moments, and into the max
  for good.
* :class:`UpdateCap` (``overrides.update_rms_cap``, StableAdamW arXiv 2304.13013, Levanter's update clipping):
  after an Adam/AdamW step, each tensor whose update direction ``u = m^ / (sqrt(v^) + eps)`` has an RMS above
  ``cap`` is moved back so that it took ``lr x s`` instead of ``lr``, with ``s = cap / RMS(u)``:
  ``p += lr (1 - s) (wd p_old + u)``, ``p_old`` recovered from the step's own arithmetic (no copy). Under FSDP
  the RMS is formed from sums over ranks. Skipped steps (the guard, a GradScaler's overflow) are left alone.

>>> import torch
>>> clip = AdaptiveClip()
>>> g = [torch.ones(4), torch.ones(4)]
>>> _ = clip.apply(g, torch.tensor([4.0, 4.0]), lam=1.05, beta=0.98)  # seeds the running mean at 2.0
>>> g = [torch.full((4,), 10.0), torch.ones(4)]
>>> _ = clip.apply(g, torch.tensor([400.0, 4.0]), lam=1.05, beta=0.98)
>>> round(float(g[0].norm()), 3), round(float(g[1].norm()), 3)
(2.1, 2.0)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from stabmon.collect.cluster.distributed import world
from stabmon.collect.cluster.sharding import local
from stabmon.collect.signals.grads import gradient_entries

ADAM_STATE = ("exp_avg", "exp_avg_sq")
"""State keys the element skip and the update cap read (torch's Adam/AdamW, fused or not)."""


class AdaptiveClip:
    """Per-tensor clipping against each tensor's own running norm; see the module docstring."""

    def __init__(self) -> None:
        self._ema: torch.Tensor | None = None

    def off(self) -> None:
        self._ema = None

    def apply(self, grads: list[torch.Tensor], tensor_sq: torch.Tensor, *, lam: float, beta: float) -> torch.Tensor:
        """Clip ``grads`` in place (``tensor_sq``: their squared norms; a GradScaler's scale still in the
        gradients does not matter, the coefficients are ratios). Returns the squared norms after clipping."""
        norms = tensor_sq.sqrt()
        ema = self._ema
        if ema is None or ema.shape != norms.shape:
            ema = torch.where(torch.isfinite(norms), norms, torch.zeros_like(norms))
        bound = lam * ema
        over = norms > bound
        coef = torch.where(over, bound / (norms + 1e-12), torch.ones_like(norms))
        clipped = norms * coef
        self._ema = torch.where(torch.isfinite(norms), beta * ema + (1 - beta) * clipped, ema)
        _mul_each(grads, coef)
        return clipped.square()


class ElementSkip:
    """Zero gradient elements far above their second moment; see the module docstring."""

    @staticmethod
    def apply(optimizer: torch.optim.Optimizer, theta: float, scale: torch.Tensor | None = None) -> torch.Tensor | None:
        """Zero the spiking elements in place; returns the count of zeroed elements (device tensor) or None when
        no parameter has a second moment yet."""
        counts = []
        with torch.no_grad():
            for p, state in _adam_params(optimizer):
                g, v = gradient_entries(p, local(state["exp_avg_sq"]))  # a sparse gradient: the rows it has
                g = local(g)
                limit = v * theta if scale is None else v * (theta * scale.to(v.device).square())
                mask = (g.float().square() > limit) & (v > 0)
                g.masked_fill_(mask, 0)
                counts.append(mask.sum())
        if not counts:
            return None
        return torch.stack([c.to(counts[0].device) for c in counts]).sum()


class UpdateCap:
    """Cap each tensor's Adam update RMS after the step; see the module docstring."""

    def __init__(self, *, sharded: bool = False) -> None:
        self.sharded = sharded
        """This rank holds shards: the RMS is formed from sums over ranks (a replicated tensor adds to both sums
        alike, so its RMS is unchanged)."""
        self._lrs: list[Any] = []

    def before(self, optimizer: torch.optim.Optimizer) -> None:
        """Remember the learning rate in force for each param group (overrides applied)."""
        self._lrs = [g["lr"] for g in optimizer.param_groups]  # a float, or a tensor (never read back)

    def after(self, optimizer: torch.optim.Optimizer, cap: float, skipped: torch.Tensor | None) -> torch.Tensor | None:
        """Move each over-cap tensor back to a step of ``lr x cap / RMS(u)``; returns the largest RMS seen."""
        items = list(adam_params_by_group(optimizer))
        if not items:
            return None
        with torch.no_grad():
            sums, counts, us = [], [], []
            for i, _, st in items:
                u = _direction(optimizer.param_groups[i], st)
                us.append(u)
                sums.append(u.float().square().sum())
                counts.append(float(u.numel()))
            ss = torch.stack([s.to(sums[0].device) for s in sums])
            n = torch.tensor(counts, device=ss.device)
            if self.sharded and world()[1] > 1:
                both = torch.cat([ss, n])
                torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.SUM)
                ss, n = both[: len(items)], both[len(items):]
            rms = (ss / n.clamp(min=1)).sqrt()
            shrink = (cap / rms).clamp(max=1.0)
            if skipped is not None:
                shrink = torch.where(skipped.to(shrink.device), torch.ones_like(shrink), shrink)
            shrink = torch.where(torch.isfinite(shrink), shrink, torch.ones_like(shrink))
            for (i, p, _), u, s in zip(items, us, shrink.unbind(), strict=True):
                _move_back(optimizer.param_groups[i], local(p), u, self._lrs[i], s.to(u.device))
        return rms.max()


def _direction(group: dict[str, Any], state: dict[str, Any]) -> torch.Tensor:
    """Adam's update direction ``m^ / (sqrt(v^) + eps)`` from the state after the step."""
    beta1, beta2 = group["betas"]
    step = local(state["step"]).to(torch.float32) if isinstance(state["step"], torch.Tensor) else state["step"]
    m, v = local(state["exp_avg"]), local(state["exp_avg_sq"])
    bc1 = 1 - torch.pow(torch.as_tensor(beta1, dtype=torch.float32), step)
    bc2 = 1 - torch.pow(torch.as_tensor(beta2, dtype=torch.float32), step)
    bc1, bc2 = torch.as_tensor(bc1).to(m.device), torch.as_tensor(bc2).to(m.device)
    return (m / bc1) / ((v / bc2).sqrt() + group["eps"])


def _taken_step(group: dict[str, Any], p: torch.Tensor, u: torch.Tensor, lr: Any) -> torch.Tensor:
    """What Adam's step of ``lr`` along ``u`` subtracted from ``p`` (``p`` as it is after the step): ``lr u``,
    plus ``lr wd p_before`` with decoupled weight decay, where ``p_before = (p + lr u) / (1 - lr wd)``."""
    wd = float(group.get("weight_decay", 0.0)) if group.get("decoupled_weight_decay", True) else 0.0
    if not wd:
        return lr * u
    before = (p + lr * u) / (1 - lr * wd)
    return lr * (wd * before + u)


def _move_back(group: dict[str, Any], p: torch.Tensor, u: torch.Tensor, lr: Any, shrink: torch.Tensor) -> None:
    """Turn a step of ``lr`` into one of ``lr x shrink`` in place."""
    p.add_((1 - shrink) * _taken_step(group, p, u, lr))


def _adam_params(optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
    for _, p, state in adam_params_by_group(optimizer):
        yield p, state


def adam_params_by_group(optimizer: torch.optim.Optimizer) -> Iterator[tuple[int, torch.Tensor, dict[str, Any]]]:
    """(group index, parameter, state) of every parameter with a gradient and Adam moments."""
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            state = optimizer.state.get(p)
            if p.grad is not None and state and all(k in state for k in ADAM_STATE):
                yield i, p, state


def adam_like(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the update cap cannot act on ``optimizer`` (None: it can): only Adam/AdamW without amsgrad or
    maximize, whose step the cap recomputes."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return f"{type(optimizer).__name__} is not Adam/AdamW"
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("maximize"):
            return "amsgrad/maximize Adam is not supported"
    return None


def _mul_each(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    if not grads:
        return
    device = grads[0].device
    if all(g.device == device for g in grads):
        torch._foreach_mul_(grads, list(coef.to(device).unbind()))
        return
    for g, c in zip(grads, coef.unbind(), strict=True):
        g.mul_(c.to(g.device))

