"""Optimizer step pre/post hooks: unscale, norms, clipping, overrides and the skip_step guard.

The pre-hook runs inside ``optimizer.step()`` (and therefore only when a GradScaler found no inf/NaN):

1. with a GradScaler whose gradients are still scaled, ``scaler.unscale_(optimizer)`` (``scaler.step``
   normally did that already);
2. one fused foreach norm over all gradients (:class:`~stabmon.collect.grads.GradNorms`) gives the global,
   per-layer and non-finite counts, queued as device tensors;
3. the skip_step guard (``overrides.skip_factor``): ``skip = norm > k x running mean`` on the device;
4. clipping with the clamped coefficient, reusing that norm;
5. overrides: effective ``lr = scheduler lr x lr_scale``, ``beta2`` and ``weight_decay`` written into the
   param groups.

The post-hook restores the scheduler-visible values (so a scheduler keeps its own trajectory and can never
undo an override) and, when the guard fired, restores parameters and optimizer moments saved by the pre-hook
with ``torch.where`` on the device: the update is discarded, not just shrunk. Caveat: a step counter held on
another device than the gradients (Adam's CPU ``step`` with CUDA parameters) still advances, since undoing it
would need a host sync; the effect on bias correction after warm-up is negligible.

>>> import torch
>>> from stabmon.collect.buffer import StepBuffer
>>> from stabmon.collect.grads import GradNorms
>>> from stabmon.overrides import Overrides
>>> model = torch.nn.Linear(2, 1)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> buf = StepBuffer()
>>> half = Overrides(lr_scale=0.5)
>>> hooks = OptimizerHooks(opt, GradNorms(model), buffer=buf, overrides=lambda: half, clip=1.0)
>>> hooks.install()
>>> buf.begin(step=0, batch_index=0)
>>> model(torch.ones(1, 2)).sum().backward()
>>> opt.step(); buf.end(time=None)
>>> rec = buf.drain()[0]
>>> hooks.last_hparams["lr"], opt.param_groups[0]["lr"], round(rec.metrics["grad_norm"], 4)
(0.05, 0.1, 1.7321)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from stabmon.collect.buffer import StepBuffer
from stabmon.collect.embeddings import EmbeddingDrift
from stabmon.collect.grads import GradNorms
from stabmon.collect.sharding import local
from stabmon.events import Metric
from stabmon.overrides import Overrides


class OptimizerHooks:
    """The monitor's optimizer hooks; see the module docstring."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        grads: GradNorms,
        *,
        buffer: StepBuffer,
        overrides: Callable[[], Overrides],
        clip: float | None = None,
        scaler: Any = None,
        embeddings: EmbeddingDrift | None = None,
        ema_decay: float = 0.98,
    ) -> None:
        self.optimizer = optimizer
        self.grads = grads
        self.buffer = buffer
        self._overrides = overrides
        self.clip = clip
        self.scaler = scaler
        self.embeddings = embeddings
        self.ema_decay = ema_decay
        self.stepped = False
        self.sample_embeddings = False
        self.ema_host: float | None = None
        self._ema: torch.Tensor | None = None
        self._saved_groups: list[dict[str, Any]] = []
        self._saved_tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._skip: torch.Tensor | None = None
        self._handles: list[Any] = []
        self.last_hparams: dict[str, float] = {}

    def install(self) -> None:
        self._handles = [
            self.optimizer.register_step_pre_hook(self._pre),
            self.optimizer.register_step_post_hook(self._post),
        ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- values in force ---------------------------------------------------------------------------------
    def max_norm(self) -> float | None:
        o = self._overrides()
        return o.max_norm if o.max_norm is not None else self.clip

    def hparams(self) -> dict[str, float]:
        """Effective values for param group 0 as the next step will use them."""
        o = self._overrides()
        group = self.optimizer.param_groups[0]
        out: dict[str, float] = {}
        lr = group.get("lr")
        if isinstance(lr, (int, float)):
            out["lr"] = float(lr) * o.lr_scale
        betas = group.get("betas")
        if betas is not None:
            out["beta2"] = float(o.beta2 if o.beta2 is not None else betas[1])
        if "weight_decay" in group:
            out["weight_decay"] = float(
                o.weight_decay if o.weight_decay is not None else group["weight_decay"]
            )
        mn = self.max_norm()
        out["clip"] = float(mn) if mn is not None else float("inf")
        return out

    # -- hooks -------------------------------------------------------------------------------------------
    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.stepped = True
        self._unscale_if_needed()
        self.last_hparams = self.hparams()
        result = self.grads.compute()
        skip = None
        if result is not None:
            names = [Metric.GRAD_NORM, Metric.NONFINITE]
            self.buffer.add(names, torch.stack([result.total, result.nonfinite.to(result.total.dtype)]))
            if result.layers is not None:
                self.buffer.add([Metric.GRAD_NORM_PREFIX + n for n in self.grads.layer_names], result.layers)
            skip = self._skip_guard(result.total)
            max_norm = self.max_norm()
            if max_norm is not None:
                GradNorms.clip_(result, max_norm, skip)
        self._apply_overrides()
        if self.sample_embeddings and self.embeddings:
            self.embeddings.before_update()

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group, saved in zip(self.optimizer.param_groups, self._saved_groups, strict=False):
            group.update(saved)
        self._saved_groups = []
        if self._skip is not None:
            with torch.no_grad():
                for t, old in self._saved_tensors:
                    t.copy_(torch.where(self._skip.to(t.device), old, t))
            self._saved_tensors = []
            self._skip = None
        if self.sample_embeddings and self.embeddings:
            names, values = self.embeddings.after_update()
            if values is not None:
                self.buffer.add(names, values)

    def _unscale_if_needed(self) -> None:
        scaler = self.scaler
        if scaler is None or not scaler.is_enabled():
            return
        state = getattr(scaler, "_per_optimizer_states", {}).get(id(self.optimizer))
        if state is not None and getattr(state.get("stage"), "name", "") == "READY":
            scaler.unscale_(self.optimizer)

    def _apply_overrides(self) -> None:
        o = self._overrides()
        self._saved_groups = []
        for group in self.optimizer.param_groups:
            saved: dict[str, Any] = {}
            if o.lr_scale != 1.0 and "lr" in group:
                saved["lr"] = group["lr"]
                group["lr"] = group["lr"] * o.lr_scale
            if o.beta2 is not None and "betas" in group:
                saved["betas"] = group["betas"]
                group["betas"] = (group["betas"][0], o.beta2)
            if o.weight_decay is not None and "weight_decay" in group:
                saved["weight_decay"] = group["weight_decay"]
                group["weight_decay"] = o.weight_decay
            self._saved_groups.append(saved)

    # -- skip_step guard ---------------------------------------------------------------------------------
    def _skip_guard(self, total: torch.Tensor) -> torch.Tensor | None:
        factor = self._overrides().skip_factor
        if factor is None:
            self._ema = None
            return None
        if self._ema is None:
            seed = self.ema_host if self.ema_host is not None else float("nan")
            self._ema = torch.tensor(seed, device=total.device, dtype=total.dtype)
        ema = self._ema
        finite = torch.isfinite(total)
        skip = torch.isfinite(ema) & ((total > factor * ema) | ~finite)
        learned = torch.where(torch.isfinite(ema), self.ema_decay * ema + (1 - self.ema_decay) * total, total)
        self._ema = torch.where(skip | ~finite, ema, learned)
        self.buffer.add([Metric.SKIPPED], skip.to(total.dtype))
        self._save_for_discard(skip.device)
        self._skip = skip
        return skip

    def _save_for_discard(self, device: torch.device) -> None:
        saved = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                mine = local(p.detach())  # a DTensor's shard: restored in place on every rank alike
                saved.append((mine, mine.clone()))
                for v in self.optimizer.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor) and local(v).device == device:
                        saved.append((local(v), local(v).clone()))
        self._saved_tensors = saved

    def learn_host(self, grad_norm: float | None, skipped: bool) -> None:
        """Keep a host running mean of the grad norm (updated at flushes) to seed the guard when it turns
        on."""
        if (
            grad_norm is None
            or skipped
            or grad_norm != grad_norm
            or grad_norm in (float("inf"), float("-inf"))
        ):
            return
        d = self.ema_decay
        self.ema_host = grad_norm if self.ema_host is None else d * self.ema_host + (1 - d) * grad_norm

    def state_dict(self) -> dict[str, Any]:
        return {"ema_host": self.ema_host}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema_host = state.get("ema_host")
        self._ema = None
