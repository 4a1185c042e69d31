"""Optimizer step pre/post hooks: unscale, norms, clipping, overrides and the skip_step guard.

The pre-hook runs inside ``optimizer.step()``:

1. with a GradScaler: a non-fused optimizer gets here only when the scaler found no inf/NaN, with gradients
   already unscaled by ``scaler.step``. A fused one (``fused=True``) gets here on every step with the gradients
   still scaled and the scaler's ``grad_scale`` / ``found_inf`` handed to its kernel; the hook then measures
   the scaled gradients, divides the norms by the scale, and folds the clip coefficient into ``grad_scale``
   (the kernel unscales and clips in the pass it makes anyway): no extra pass over the gradients. Only when
   ``optimizer.step()`` is called directly on still-scaled gradients does the hook ``scaler.unscale_`` them;
2. one fused foreach norm over all gradients (:class:`~stabmon.collect.grads.GradNorms`) gives the global,
   per-layer and non-finite counts, queued as device tensors;
3. the skip_step guard (``overrides.skip_factor``, :class:`~stabmon.collect.guard.SkipGuard`): ``skip = norm >
   k x running mean`` (or non-finite) on the device;
4. clipping with the clamped coefficient, reusing that norm;
5. overrides: effective ``lr = scheduler lr x lr_scale`` (at most ``lr_cap``) and ``beta2`` written into the
   param groups; ``weight_decay`` sets the decaying groups' value, scaling each from its own (groups at 0 stay
   at 0).
6. the state-level fixes an intervention turned on (:mod:`stabmon.collect.inplace`): element skip
   (``skip_theta``) and per-tensor adaptive clipping (``adaptive_clip``) before the global clip, the update-RMS cap
   (``update_rms_cap``) after the step; the LR re-warm-up (``rewarm_left``) counts down one step each time;
7. on a step sampled for an update signal (:class:`UpdateSignal`: embedding drift, the update norm of
   :class:`~stabmon.collect.updates.UpdateNorms`, the second-moment ratio of
   :class:`~stabmon.collect.moment_ratio.MomentRatios`), its work before the update on the final gradients
   (after clipping, before the skip guard hands its flag to the kernel), measured again or returned in the
   post-hook once the update (or the guard's discard) is done. Each signal has its own sampling period
   (:meth:`OptimizerHooks.sample`).

The post-hook restores the scheduler-visible values (so a scheduler keeps its own trajectory and can never
undo an override) and lets the guard finish: with fused Adam/AdamW the flagged update never happened (the flag
was the kernel's ``found_inf``); with any other optimizer the guard restores parameters and state from its
preallocated snapshot.

>>> import torch
>>> from stabmon.collect.buffer import StepBuffer
>>> from stabmon.collect.grads import GradNorms
>>> from stabmon.overrides import Overrides
>>> model = torch.nn.Linear(2, 1)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> buf = StepBuffer()
>>> half = Overrides(lr_scale=0.5)
>>> hooks = OptimizerHooks(opt, GradNorms(model), buffer=buf, overrides=half, clip=1.0)
>>> hooks.install()
>>> buf.begin(step=0, batch_index=0)
>>> model(torch.ones(1, 2)).sum().backward()
>>> opt.step(); buf.end(time=None)
>>> rec = buf.drain()[0]
>>> hooks.last_hparams["lr"], opt.param_groups[0]["lr"], round(rec.metrics["grad_norm"], 4)
(0.05, 0.1, 1.7321)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from stabmon.collect.buffer import StepBuffer
from stabmon.collect.grads import GradNorms, GradResult
from stabmon.collect.guard import SkipGuard
from stabmon.collect.inplace import AdaptiveClip, ElementSkip, UpdateCap
from stabmon.collect.updates import AdamUpdateNorms
from stabmon.events import Metric
from stabmon.overrides import Overrides


class UpdateSignal(Protocol):
    """A collector measured around the optimizer's update on the steps it samples: what it needs before the
    update, then its named device values after it (None: nothing this step)."""

    def before_update(self) -> None: ...

    def after_update(self) -> tuple[list[str], torch.Tensor | None]: ...


class OptimizerHooks:
    """The monitor's optimizer hooks; see the module docstring."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        grads: GradNorms,
        *,
        buffer: StepBuffer,
        overrides: Overrides,
        clip: float | None = None,
        scaler: Any = None,
        ema_decay: float = 0.98,
        signals: Sequence[tuple[int, UpdateSignal]] = (),
    ) -> None:
        self.optimizer = optimizer
        self.grads = grads
        self.buffer = buffer
        self.overrides = overrides
        """The overrides in force (the run state's: interventions change this object)."""
        self.clip = clip
        self.scaler = scaler
        self.signals = tuple(signals)
        """(sampling period in steps, signal) for each update signal."""
        self.sampled: tuple[UpdateSignal, ...] = ()
        """The update signals measured this step (:meth:`sample`)."""
        self.guard = SkipGuard(optimizer, ema_decay=ema_decay)
        self.adaptive = AdaptiveClip()
        self.update_cap = UpdateCap(sharded=grads.sharded is not None)
        self._capping = False
        self.stepped = False
        self.skip_reported = False
        """The caller said this step's update was skipped (``after_step(skipped=True)``): a loss scaler's
        overflow, recorded as such even without a GradScaler the monitor knows of."""
        self._post_pending = False  # before_step ran and after_step has not yet undone its changes
        self.found_inf: torch.Tensor | None = None
        """The GradScaler's overflow flag handed to a fused optimizer this step (device tensor), else None."""
        self._saved_groups: list[dict[str, Any]] = []
        self.lrs_used: list[Any] = []
        """Each param group's learning rate in force for this step (overrides applied: a float or a tensor)."""
        self.skipped_now: torch.Tensor | None = None
        """This step's update did not happen (:meth:`_skipped_flag`), for the update signals that read it."""
        self._handles: list[Any] = []
        self.last_hparams: dict[str, float] = {}

    def sample(self, step: int) -> None:
        """Choose the update signals measured at ``step``: each on the steps its period divides."""
        self.sampled = tuple(signal for every, signal in self.signals if step % every == 0)

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
        o = self.overrides
        return o.max_norm if o.max_norm is not None else self.clip

    def hparams(self) -> dict[str, float]:
        """Effective values for param group 0 as the next step will use them."""
        o = self.overrides
        group = self.optimizer.param_groups[0]
        out: dict[str, float] = {}
        lr = group.get("lr")
        if isinstance(lr, (int, float)):
            out["lr"] = float(o.scaled_lr(float(lr)))
        betas = group.get("betas")
        if betas is not None:
            out["beta2"] = float(o.beta2 if o.beta2 is not None else betas[1])
        decaying = _decaying_group(self.optimizer.param_groups)
        if decaying is not None:
            out["weight_decay"] = float(o.weight_decay if o.weight_decay is not None else decaying["weight_decay"])
        mn = self.max_norm()
        out["clip"] = float(mn) if mn is not None else float("inf")
        return out

    # -- hooks -------------------------------------------------------------------------------------------
    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.before_step()

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.after_step()

    def before_step(self) -> None:
        """The pre-step work (steps 1-5 of the module docstring); the step pre-hook, or called by a framework
        that runs backward inside ``optimizer.step(closure)``."""
        self.stepped = True
        self._post_pending = True
        grad_scale = self._scaled_handoff()
        self.last_hparams = self.hparams()
        result = self.grads.compute()
        skip = None
        if result is not None:
            if grad_scale is not None:
                result = _unscaled(result, grad_scale)
            names = [Metric.GRAD_NORM, Metric.NONFINITE]
            self.buffer.add(names, torch.stack([result.total, result.nonfinite.to(result.total.dtype)]))
            if result.layers is not None:
                self.buffer.add([Metric.GRAD_NORM_PREFIX + n for n in self.grads.layer_names], result.layers)
            skip = self.guard.decide(result.total, self.overrides.skip_factor)
            if skip is not None:
                self.buffer.add([Metric.SKIPPED], skip.to(result.total.dtype))
            self._clip(self._state_level(result, grad_scale), grad_scale)
        for signal in self.sampled:  # the final gradients, before the guard folds its flag into found_inf
            signal.before_update()
        self.guard.before_update(skip)
        self._apply_overrides()
        self._capping = self.overrides.update_rms_cap is not None
        if self._capping:
            self.update_cap.before(self.optimizer)

    def after_step(self, *, skipped: bool = False) -> None:
        """The post-step work: scheduler-visible values back, the guard finished, embeddings measured.
        ``skipped``: the optimizer did not step after all (a loss scaler's overflow, seen only at batch end);
        the step then counts as not stepped and as skipped by the scaler. Without a :meth:`before_step` this
        step (the scaler skipped before the optimizer was reached) there is nothing to undo, only that."""
        if self._post_pending:
            self._post_pending = False
            self._finish_update()
        if skipped:
            self.stepped = False
            self.skip_reported = True

    def _state_level(self, result: GradResult, grad_scale: torch.Tensor | None) -> GradResult:
        """Element skip and adaptive clipping, when on; the result's global norm then is the clipped one."""
        o = self.overrides
        if o.skip_theta is not None:
            ElementSkip.apply(self.optimizer, o.skip_theta, grad_scale)
        if o.adaptive_clip is None or result.tensor_sq is None:
            self.adaptive.off()
            return result
        sq = self.adaptive.apply(result.grads, result.tensor_sq, lam=o.adaptive_clip, beta=o.adaptive_clip_beta)
        return dataclasses.replace(result, total=sq.sum().sqrt(), tensor_sq=sq)

    def _finish_update(self) -> None:
        self.skipped_now = self._skipped_flag() if self.sampled else None
        if self._capping:
            self._capping = False
            cap = self.overrides.update_rms_cap
            if cap is not None:
                self.update_cap.after(self.optimizer, cap, self._skipped_flag())
        for group, saved in zip(self.optimizer.param_groups, self._saved_groups, strict=False):
            group.update(saved)
        self._saved_groups = []
        self.overrides.advance()  # a release's re-warm-up counts optimizer steps taken
        self.guard.after_update()
        for signal in self.sampled:
            if isinstance(signal, AdamUpdateNorms):  # it recomputes the step: tell it the LR and the skip
                signal.step_taken(self.lrs_used, self.skipped_now)
            names, values = signal.after_update()
            if values is not None:
                self.buffer.add(names, values)

    def _skipped_flag(self) -> torch.Tensor | None:
        """This step's update did not happen: the guard's flag or a GradScaler's overflow (fused path)."""
        flags = [f.to(torch.bool) for f in (self.guard.pending, self.found_inf) if f is not None]
        if not flags:
            return None
        return flags[0] if len(flags) == 1 else flags[0] | flags[1].to(flags[0].device)

    def _clip(self, result: GradResult, grad_scale: torch.Tensor | None) -> None:
        max_norm = self.max_norm()
        if max_norm is None:
            return
        if grad_scale is None:
            GradNorms.clip_(result, max_norm)
            return
        # the fused kernel divides the gradients by grad_scale: dividing by scale / coef also clips them
        coef = (max_norm / (result.total + 1e-6)).clamp(max=1.0)
        self.optimizer.grad_scale = grad_scale / coef.to(grad_scale.device)  # type: ignore[attr-defined]

    def _scaled_handoff(self) -> torch.Tensor | None:
        """The scale a fused optimizer's kernel will divide by (gradients still scaled), else None; unscales
        still-scaled gradients of a direct ``optimizer.step()`` call."""
        self.found_inf = None
        scaler = self.scaler
        if scaler is None or not scaler.is_enabled():
            return None
        grad_scale = getattr(self.optimizer, "grad_scale", None)
        if grad_scale is not None:
            self.found_inf = getattr(self.optimizer, "found_inf", None)
            return grad_scale
        state = getattr(scaler, "_per_optimizer_states", {}).get(id(self.optimizer))
        if state is not None and getattr(state.get("stage"), "name", "") == "READY":
            scaler.unscale_(self.optimizer)
        return None

    def _apply_overrides(self) -> None:
        o = self.overrides
        lr = self.optimizer.param_groups[0].get("lr")
        if o.cap_until is not None and isinstance(lr, (int, float)):
            o.settle(float(lr))  # a released cap lifted once the schedule is below where the trouble began
        self._saved_groups = []
        groups = self.optimizer.param_groups
        if o.layer_lr:
            o.settle_layers([g.get("lr") for g in groups])  # a released layer cut lifted once its group's LR is low
        decaying = _decaying_group(groups) if o.weight_decay is not None else None
        base = decaying["weight_decay"] if decaying is not None else 0.0
        for i, group in enumerate(groups):
            saved: dict[str, Any] = {}
            if o.lr_changed and "lr" in group:
                saved["lr"] = group["lr"]
                group["lr"] = o.scaled_lr(group["lr"], group=i, ref=lr)
            if o.beta2 is not None and "betas" in group:
                saved["betas"] = group["betas"]
                group["betas"] = (group["betas"][0], o.beta2)
            if o.weight_decay is not None and "weight_decay" in group and (group["weight_decay"] or not base):
                # relative to each group's own value; groups without decay (norms, biases) keep 0 unless no
                # group decays at all
                saved["weight_decay"] = group["weight_decay"]
                group["weight_decay"] = group["weight_decay"] * o.weight_decay / base if base else o.weight_decay
            self._saved_groups.append(saved)
        if self.sampled:
            self.lrs_used = [g.get("lr") for g in groups]
        if o.rewarm_left:
            o.rewarm_left -= 1

    def learn_host(self, grad_norm: float | None, skipped: bool) -> None:
        """Keep the guard's host running mean of the grad norm (updated at flushes)."""
        self.guard.learn_host(grad_norm, skipped)

    def state_dict(self) -> dict[str, Any]:
        return self.guard.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.guard.load_state_dict(state)


def _decaying_group(groups: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The param group whose weight decay is the run's (the first with a non-zero one; else the first that has
    one): the value ``weight_decay`` reports and overrides replace. The others scale with it."""
    having = [g for g in groups if "weight_decay" in g]
    return next((g for g in having if g["weight_decay"]), having[0] if having else None)


def _unscaled(result: GradResult, grad_scale: torch.Tensor) -> GradResult:
    """Norms of still-scaled gradients divided by the scale (the gradients themselves are left as they are)."""
    scale = grad_scale.to(result.total.device, result.total.dtype)
    layers = result.layers / scale if result.layers is not None else None
    tensor_sq = result.tensor_sq / scale.square() if result.tensor_sq is not None else None
    return dataclasses.replace(result, total=result.total / scale, layers=layers, tensor_sq=tensor_sq)
