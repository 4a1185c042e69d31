"""The skip_step guard: decide on the device whether to discard an update, and discard it without a host sync.

:meth:`SkipGuard.decide` keeps a running mean of the grad norm on the device and flags a step whose norm exceeds
``factor x`` that mean, or is NaN/inf. How the flagged update is then discarded depends on the optimizer:

* **fused** Adam/AdamW (``fused=True``): the flag is handed to the fused kernel as ``found_inf``, the very
  argument a GradScaler uses on an overflow step. The kernel then leaves parameters, both moments and the step
  counter untouched: no copy, no extra pass over any tensor, and NaN-safe because nothing is computed at all
  (folding the flag into ``lr x (1 - skip)`` would not be: ``0 x NaN`` is NaN).
* **torch's default Adam/AdamW** (foreach or for-loop, not fused): while the guard is on, the step goes through
  torch's fused kernel instead (the param groups' ``fused`` flag is set for the step and restored after it, and
  ``found_inf`` handed to it as above): zero-copy too. Same algorithm; the last bit of rounding may differ from
  the foreach kernel's while the guard is on. The optimizer must be one the fused kernel takes (floating
  parameters on a device it supports, not ``differentiable``); on CUDA the step counters move to the device
  while the guard is on and back when it turns off.
* **any other optimizer**: the fallback. Parameters and optimizer state tensors are copied with one
  ``torch._foreach_copy_`` into buffers allocated once, when the guard first acts, and restored after the step
  with ``torch.where(skip, saved, current, out=current)`` per tensor: bit-identical, NaN-safe, no per-step
  allocation; while the guard is on, it holds one copy of the parameters and optimizer state
  (:meth:`SkipGuard.nbytes`), released when the guard turns off. Sparse optimizer state (SGD's momentum buffer
  of a parameter with sparse gradients) cannot be restored in place without a host sync (its size changes): on a
  flagged step the sparse gradients of those parameters are zeroed before the update instead (``masked_fill``,
  NaN-safe), so that state takes nothing of the discarded step and only decays (logged once).

>>> import torch
>>> p = torch.nn.Parameter(torch.ones(3))
>>> opt = torch.optim.AdamW([p], lr=0.1, fused=True)
>>> guard = SkipGuard(opt)
>>> guard.ema_host = 1.0  # the running mean so far (from the flushed history)
>>> guard.zero_copy
True
>>> p.grad = torch.full((3,), float("nan"))
>>> skip = guard.decide(torch.linalg.vector_norm(p.grad), factor=5.0)
>>> guard.before_update(skip); opt.step(); guard.after_update()
>>> bool(skip), p.detach().tolist(), guard.nbytes()
(True, [1.0, 1.0, 1.0], 0)
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from stabmon.collect.cluster.sharding import local
from stabmon.collect.signals.grads import dense_view

log = logging.getLogger(__name__)

_FUSED_FOUND_INF = (torch.optim.Adam, torch.optim.AdamW)
"""Optimizers whose fused step honours ``found_inf`` by leaving parameters, moments and step untouched."""

_UNSET = object()


def supports_zero_copy(optimizer: torch.optim.Optimizer) -> bool:
    """True for Adam/AdamW built with ``fused=True`` (every param group fused)."""
    return isinstance(optimizer, _FUSED_FOUND_INF) and all(g.get("fused") for g in optimizer.param_groups)


def fusable(optimizer: torch.optim.Optimizer) -> bool:
    """True for a non-fused Adam/AdamW whose step torch's fused kernel can take instead."""
    if not isinstance(optimizer, _FUSED_FOUND_INF) or supports_zero_copy(optimizer):
        return False
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        devices = set(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - older torch
        return False
    for group in optimizer.param_groups:
        if group.get("differentiable") or group.get("capturable"):
            return False
        for p in group["params"]:
            t = local(p)
            if t.device.type not in devices or not torch.is_floating_point(t) or t.is_sparse:
                return False
    return True


class SkipGuard:
    """Device-side skip decision and update discard; see the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, ema_decay: float = 0.98) -> None:
        self.optimizer = optimizer
        self.ema_decay = ema_decay
        self.ema_host: float | None = None
        """Host running mean of the grad norm (updated at flushes), the seed of the device mean."""
        self.fusable = fusable(optimizer)
        """A default Adam/AdamW stepped through the fused kernel while the guard is on (see the module)."""
        self.zero_copy = supports_zero_copy(optimizer) or self.fusable
        self._flipped: list[dict[str, Any]] = []
        self._steps_moved = False
        self._ema: torch.Tensor | None = None
        self._skip: torch.Tensor | None = None
        self._found_inf: Any = _UNSET
        self._snapshot = _Snapshot()
        self._warned = False
        self._warned_sparse = False

    # -- decision ----------------------------------------------------------------------------------------
    def decide(self, total: torch.Tensor, factor: float | None,
               also: torch.Tensor | None = None) -> torch.Tensor | None:
        """The skip flag (0-d bool on ``total``'s device) for this step, or None when the guard is off. ``also``:
        another reason to discard this update, already decided on the device (the data screen's loss bar); it
        does not enter the running mean."""
        if factor is None:
            if also is None:
                self.off()
            return also
        if self._ema is None:
            seed = self.ema_host if self.ema_host is not None else float("nan")
            self._ema = torch.tensor(seed, device=total.device, dtype=total.dtype)
        ema = self._ema
        finite = torch.isfinite(total)
        known = torch.isfinite(ema)
        skip = known & ((total > factor * ema) | ~finite)
        learned = torch.where(known, self.ema_decay * ema + (1 - self.ema_decay) * total, total)
        self._ema = torch.where(skip | ~finite, ema, learned)
        return skip if also is None else skip | also

    def off(self) -> None:
        """The guard is off: forget the device mean and free the fallback's buffers."""
        self._ema = None
        self._snapshot.release()
        if self._steps_moved:
            self._move_steps(torch.device("cpu"))
            self._steps_moved = False

    @property
    def pending(self) -> torch.Tensor | None:
        """This step's skip flag between :meth:`before_update` and :meth:`after_update`, else None."""
        return self._skip

    # -- discard -----------------------------------------------------------------------------------------
    def before_update(self, skip: torch.Tensor | None) -> None:
        """Inside ``optimizer.step()``, before the update: hand the flag to the fused kernel, or snapshot."""
        self._skip = skip
        if skip is None:
            return
        if self.zero_copy:
            if self.fusable:
                self._flip_to_fused()
            self._fold_into_found_inf(skip)
            return
        if not self._warned:
            self._warned = True
            log.info(
                "stabmon: skip_step guard on %s (not fused Adam/AdamW): keeping a copy of parameters and "
                "optimizer state while it is on; construct the optimizer with fused=True for a zero-copy guard",
                type(self.optimizer).__name__,
            )
        self._snapshot.save(self.optimizer, skip.device)
        self._hold_sparse_state(skip)

    def _hold_sparse_state(self, skip: torch.Tensor) -> None:
        """Zero, where ``skip``, the sparse gradients of parameters whose optimizer state is sparse (see the
        module docstring)."""
        held = _sparse_state_params(self.optimizer)
        if not held:
            return
        if not self._warned_sparse:
            self._warned_sparse = True
            log.info("stabmon: skip_step guard on %s: its sparse optimizer state cannot be restored without a host "
                     "sync; on a skipped step the sparse gradients it is built from are zeroed instead",
                     type(self.optimizer).__name__)
        with torch.no_grad():
            for p in held:
                values = dense_view(p)  # coalesced: its values are the gradient's
                if values is not None:
                    values.masked_fill_(skip.to(values.device), 0)

    def after_update(self) -> None:
        """After the update: restore the optimizer's own ``found_inf``, or the snapshot where skipped."""
        skip, self._skip = self._skip, None
        if skip is None:
            return
        if self.zero_copy:
            if self._found_inf is _UNSET:
                self.optimizer.__dict__.pop("found_inf", None)
            else:
                self.optimizer.found_inf = self._found_inf  # type: ignore[attr-defined]
            self._found_inf = _UNSET
            for group, saved in zip(self.optimizer.param_groups, self._flipped, strict=False):
                group.update(saved)
            self._flipped = []
            return
        self._snapshot.restore(skip)

    def _flip_to_fused(self) -> None:
        """This step through the fused kernel (restored in :meth:`after_update`)."""
        self._flipped = [{"fused": g.get("fused"), "foreach": g.get("foreach")} for g in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["fused"], group["foreach"] = True, False
        if not self._steps_moved:
            self._move_steps(None)
            self._steps_moved = True

    def _move_steps(self, device: torch.device | None) -> None:
        """Step counters to their parameter's device (``None``) or back to ``device``, where they differ (the
        foreach kernel keeps them on the CPU, the fused one needs them beside the parameters)."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p)
                step = state.get("step") if state else None
                if state is None or not isinstance(step, torch.Tensor):
                    continue
                where = local(p).device if device is None else device
                if step.device != where:
                    state["step"] = step.to(where, torch.float32 if device is None else step.dtype)

    def _fold_into_found_inf(self, skip: torch.Tensor) -> None:
        """``found_inf = max(found_inf, skip)``: a GradScaler's overflow flag (fused path) is kept."""
        prior = getattr(self.optimizer, "found_inf", None)
        self._found_inf = self.optimizer.__dict__.get("found_inf", _UNSET)
        flag = skip.to(torch.float32)
        if prior is not None:
            flag = torch.maximum(prior, flag.to(prior.device))
        self.optimizer.found_inf = flag  # type: ignore[attr-defined]

    def nbytes(self) -> int:
        """Bytes the fallback's buffers hold (0 on the zero-copy path and while the guard is off)."""
        return self._snapshot.nbytes()

    # -- state -------------------------------------------------------------------------------------------
    def learn_host(self, grad_norm: float | None, skipped: bool) -> None:
        """Update the host running mean from one flushed record (seeds the device mean when the guard turns
        on)."""
        self.ema_host = self.folded(self.ema_host, grad_norm, skipped, self.ema_decay)

    @staticmethod
    def folded(ema: float | None, grad_norm: float | None, skipped: bool, decay: float) -> float | None:
        """The host running mean ``ema`` after one flushed record (a skipped or non-finite one leaves it).

        >>> SkipGuard.folded(None, 2.0, False, 0.5), SkipGuard.folded(2.0, 4.0, False, 0.5)
        (2.0, 3.0)
        >>> SkipGuard.folded(2.0, float("nan"), False, 0.5), SkipGuard.folded(2.0, 4.0, True, 0.5)
        (2.0, 2.0)
        """
        if grad_norm is None or skipped or grad_norm != grad_norm or grad_norm in (float("inf"), float("-inf")):
            return ema
        return grad_norm if ema is None else decay * ema + (1 - decay) * grad_norm

    def state_dict(self) -> dict[str, Any]:
        return {"ema_host": self.ema_host}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema_host = state.get("ema_host")
        self._ema = None


class _Snapshot:
    """The fallback: one preallocated copy of the tensors an optimizer step changes."""

    def __init__(self) -> None:
        self._key: tuple[int, ...] = ()
        self._live: list[torch.Tensor] = []
        self._saved: list[torch.Tensor] = []

    def save(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        live = _updated_tensors(optimizer, device)
        key = tuple(t.data_ptr() for t in live)  # stable across a DTensor's fresh local views
        if key != self._key or any(a.shape != b.shape for a, b in zip(live, self._saved, strict=True)):
            self._saved = [torch.empty_like(t) for t in live]  # once, and again only if the set changes
            self._key = key
        self._live = live
        with torch.no_grad():
            if live:
                torch._foreach_copy_(self._saved, live)

    def restore(self, skip: torch.Tensor) -> None:
        flags = {skip.device: skip}
        with torch.no_grad():
            for t, old in zip(self._live, self._saved, strict=True):
                flag = flags.get(t.device)
                if flag is None:
                    flag = flags[t.device] = skip.to(t.device, non_blocking=True)
                torch.where(flag, old, t, out=t)
        self._live = []

    def release(self) -> None:
        self._key, self._live, self._saved = (), [], []

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._saved)


def _updated_tensors(optimizer: torch.optim.Optimizer, device: torch.device) -> list[torch.Tensor]:
    """Parameters with a gradient and their strided state tensors on ``device`` (a state tensor elsewhere, such
    as Adam's CPU step counter beside CUDA parameters, or a sparse one, cannot be restored without a host sync)."""
    out: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            out.append(local(p))  # a DTensor's shard: restored in place on every rank alike
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, torch.Tensor) and v.layout == torch.strided and local(v).device == device:
                    out.append(local(v))
    return out


def _sparse_state_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters with a sparse gradient whose optimizer state holds a sparse tensor."""
    out: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None or p.grad.layout != torch.sparse_coo:
                continue
            state = optimizer.state.get(p, {})
            if any(isinstance(v, torch.Tensor) and v.layout != torch.strided for v in state.values()):
                out.append(p)
    return out
