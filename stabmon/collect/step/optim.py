"""Optimizer step pre/post hooks: unscale, norms, clipping, overrides and the skip_step guard.

The pre-hook runs inside ``optimizer.step()``:

1. with a GradScaler: a non-fused optimizer gets here only when the scaler found no inf/NaN, with gradients
   already unscaled by ``scaler.step``. A fused one (``fused=True``) gets here on every step with the gradients
   still scaled and the scaler's ``grad_scale`` / ``found_inf`` handed to its kernel; the hook then measures
   the scaled gradients, divides the norms by the scale, and folds the clip coefficient into ``grad_scale``
   (the kernel unscales and clips in the pass it makes anyway): no extra pass over the gradients. Only when
   ``optimizer.step()`` is called directly on still-scaled gradients does the hook ``scaler.unscale_`` them;
2. one fused foreach norm over all gradients (:class:`~stabmon.collect.signals.grads.GradNorms`) gives the global,
   per-layer and non-finite counts, queued as device tensors;
3. the skip_step guard (``overrides.skip_factor``, :class:`~stabmon.collect.step.guard.SkipGuard`): ``skip = norm >
   k x running mean`` (or non-finite) on the device;
4. clipping with the clamped coefficient, reusing that norm;
5. overrides: effective ``lr = scheduler lr x lr_scale`` (at most ``lr_cap``) and ``beta2`` written into the
   param groups; ``weight_decay`` sets the decaying groups' value, scaling each from its own (groups at 0 stay
   at 0).
6. the state-level fixes an intervention turned on (:mod:`stabmon.collect.step.inplace`): element skip
   (``skip_theta``) and per-tensor adaptive clipping (``adaptive_clip``) before the global clip, the update-RMS cap
   (``update_rms_cap``) after the step; the LR re-warm-up (``rewarm_left``) counts down one step each time;
7. on a step sampled for an update signal (:class:`UpdateSignal`: embedding drift, the update norm of
   :class:`~stabmon.collect.signals.updates.UpdateNorms`, the second-moment ratio of
   :class:`~stabmon.collect.signals.moment_ratio.MomentRatios`), its work before the update on the final gradients
   (after clipping, before the skip guard hands its flag to the kernel), measured again or returned in the
   post-hook once the update (or the guard's discard) is done. Each signal has its own sampling period
   (:meth:`OptimizerHooks.sample`).

The post-hook restores the scheduler-visible values (so a scheduler keeps its own trajectory and can never
undo an override) and lets the guard finish: with fused Adam/AdamW the flagged update never happened (the flag
was the kernel's ``found_inf``); with any other optimizer the guard restores parameters and state from its
preallocated snapshot. A value the pre-hook writes replaces the group's entry for the step (a tensor LR by a
tensor on its device, so fused and capturable kernels get what they expect) and the post-hook puts the group's
own object back: a tensor LR is the same tensor after every step, its value untouched.

When ``optimizer.step()`` raises after the pre-hook (inside the optimizer, in a hook after the monitor's, in a
closure), the post-hook never runs; :meth:`OptimizerHooks.abandon_unfinished` then does its work when the step's
record closes or, at the latest, before the next step's pre-hook: each group gets its scheduler's value back
where it still holds the one written for the failed step (a value a scheduler wrote since is kept), the guard's
handoff to the kernel is withdrawn. An override is never applied on top of itself.

Learning rates held as tensors (``Adam(params, lr=torch.tensor(0.01))``, filled in place by schedulers): the
LR in force is computed on the tensor's device. Where the schedule must be known on the host (lifting a
released LR cap or layer cut, the ``lr`` of :meth:`OptimizerHooks.hparams`), a CPU tensor's value is read (host
memory: no sync); a tensor on an accelerator is never read between flushes: a released cap or cut is then held,
not lifted on a guess (logged once), and the recorded ``lr`` is queued as a device value
(:meth:`OptimizerHooks.lr_on_device`) and copied with the step's other values at the flush.

>>> import torch
>>> from stabmon.collect.signals.buffer import StepBuffer
>>> from stabmon.collect.signals.grads import GradNorms
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
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from stabmon.collect.interrupts import InterruptHold
from stabmon.collect.signals.buffer import StepBuffer
from stabmon.collect.signals.grads import GradNorms, GradResult
from stabmon.collect.signals.updates import AdamUpdateNorms
from stabmon.collect.step.guard import SkipGuard
from stabmon.collect.step.inplace import AdaptiveClip, ElementSkip, UpdateCap
from stabmon.events import Metric
from stabmon.overrides import Overrides

log = logging.getLogger(__name__)


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
        self.loss_seen = False
        """The loop observed this step's loss (so far)."""
        self._loss_sum: Any = None  # while a screen is on: this step's observed losses summed (micro-batches)
        self._losses = 0
        self.screen_bar: float | None = None
        """The data screen's loss bar for this step (``Overrides.screening``), or None."""
        self.loss_first: bool | None = None
        """Whether the loop observed the loss before ``optimizer.step()`` on its last step (None: no step yet): a
        data screen can discard an update only on a loss it has before the update."""
        self._post_pending = False  # before_step ran and after_step has not yet undone its changes
        self._cut = False  # this step's optimizer.step() raised after its pre-step work (reset as a step begins)
        self.interrupts = InterruptHold()
        """Ctrl-C and SIGTERM wait from a monitored step's ``optimizer.step()`` until the step ends (the monitor's
        ``end_step`` releases them): a step is interrupted before its update or after its end, never between."""
        self.found_inf: torch.Tensor | None = None
        """The GradScaler's overflow flag handed to a fused optimizer this step (device tensor), else None."""
        self._swaps: list[dict[str, _Swap]] = []
        """Per param group, the entries the pre-hook replaced for this step."""
        self._rewarm_taken = False  # the pre-hook counted a step of the re-warm-up down
        self._unread_logged = False
        self._abandon_logged = False
        self.lrs_used: list[Any] = []
        """Each param group's learning rate in force for this step (overrides applied: a float or a tensor)."""
        self.skipped_now: torch.Tensor | None = None
        """This step's update did not happen (:meth:`_skipped_flag`), for the update signals that read it."""
        self._handles: list[Any] = []
        self.last_hparams: dict[str, float] = {}
        self.last_lr_on_device: torch.Tensor | None = None
        """This step's :meth:`lr_on_device` (a tensor LR on an accelerator), else None."""

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
        """Effective values for param group 0 as the next step will use them, as host floats. A value held as a
        tensor on an accelerator is left out (reading it would wait for the device; the recorded ``lr`` then comes
        from :meth:`lr_on_device`)."""
        o = self.overrides
        group = self.optimizer.param_groups[0]
        out: dict[str, float] = {}
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor):
            if on_host(lr):
                out["lr"] = float(o.scaled_lr(lr, ref=lr))
        elif isinstance(lr, (int, float)):
            out["lr"] = float(o.scaled_lr(float(lr)))
        betas = group.get("betas")
        beta2 = o.beta2 if o.beta2 is not None else (host_value(betas[1]) if betas is not None else None)
        if beta2 is not None:
            out["beta2"] = float(beta2)
        decaying = _decaying_group(self.optimizer.param_groups)
        decay = o.weight_decay if o.weight_decay is not None else (
            host_value(decaying["weight_decay"]) if decaying is not None else None)
        if decay is not None:
            out["weight_decay"] = float(decay)
        mn = self.max_norm()
        out["clip"] = float(mn) if mn is not None else float("inf")
        return out

    def lr_on_device(self) -> torch.Tensor | None:
        """Param group 0's learning rate in force as a one-element tensor on its device when the group holds a
        tensor LR on an accelerator (which :meth:`hparams` leaves out), computed there with no host read; else
        None."""
        lr = self.optimizer.param_groups[0].get("lr")
        if not isinstance(lr, torch.Tensor) or on_host(lr):
            return None
        return self.overrides.scaled_lr(lr, ref=lr).detach().reshape(1)

    # -- hooks -------------------------------------------------------------------------------------------
    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.before_step()

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.after_step()

    def new_step(self) -> None:
        """A step begins: nothing stepped, skipped or cut in it yet."""
        self.stepped = self.skip_reported = self._cut = self.loss_seen = False
        self._loss_sum, self._losses = None, 0

    def observed_loss(self, value: Any) -> None:
        """The loop observed a loss for this step (one per micro-batch where it observes each): kept, summed on
        its device, only while a data screen is on."""
        self.loss_seen = True
        if self.screen_bar is None:
            return
        v = value.detach().to(torch.float32).reshape(()) if isinstance(value, torch.Tensor) else float(value)
        self._loss_sum = v if self._loss_sum is None else self._loss_sum + v
        self._losses += 1

    def before_step(self) -> None:
        """The pre-step work (steps 1-5 of the module docstring); the step pre-hook, or called by a framework
        that runs backward inside ``optimizer.step(closure)``."""
        self.abandon_unfinished()
        if self.buffer.open:
            self.interrupts.hold()
        self.stepped = True
        self.loss_first = self.loss_seen
        self._post_pending = True
        grad_scale = self._scaled_handoff()
        self.last_hparams = self.hparams()
        self.last_lr_on_device = self.lr_on_device()
        result = self.grads.compute()
        skip = None
        if result is not None:
            if grad_scale is not None:
                result = _unscaled(result, grad_scale)
            names = [Metric.GRAD_NORM, Metric.NONFINITE]
            self.buffer.add(names, torch.stack([result.total, result.nonfinite.to(result.total.dtype)]))
            if result.layers is not None:
                self.buffer.add([Metric.GRAD_NORM_PREFIX + n for n in self.grads.layer_names], result.layers)
            skip = self.guard.decide(result.total, self.overrides.skip_factor, also=self._screened(result.total))
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

    def _screened(self, total: torch.Tensor) -> torch.Tensor | None:
        """The data screen's flag for this step (0-d bool on ``total``'s device, no host read): the loss above the
        screen's bar (the mean of the step's micro-batch losses, as its record has it). None when no screen is in
        force, or the loss was not observed before the update."""
        bar, total_loss = self.screen_bar, self._loss_sum
        if bar is None or total_loss is None:
            return None
        mean = total_loss / self._losses
        if isinstance(mean, torch.Tensor):
            return (mean.to(total.device) > bar).reshape(())
        return torch.tensor(mean > bar, device=total.device)

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

    @property
    def cut(self) -> bool:
        """This step's ``optimizer.step()`` began and did not finish (it raised, or it is still running): the
        update may be half-applied."""
        return self._post_pending or self._cut

    def abandon_unfinished(self) -> None:
        """Undo the pre-step work of a step whose post-step work never ran (``optimizer.step()`` raised after
        the pre-hook): each param group gets its scheduler's value back where it still holds the one written for
        that step (a value a scheduler wrote since, by assignment or a tensor's ``fill_``, is kept), the skip
        guard finishes (its handoff to a fused kernel withdrawn, its snapshot restored where it flagged the
        step), and the re-warm-up step counted down is given back. No host read. Nothing to do after a step that
        finished; called before each step's pre-step work and when a step's record closes."""
        if not self._post_pending:
            return
        self._post_pending = False
        self._cut = True
        if not self._abandon_logged:
            self._abandon_logged = True
            log.warning("stabmon: optimizer.step() did not finish (it raised after the monitor's pre-step work): "
                        "the param groups get their scheduled values back; overrides apply afresh next step")
        for group, swaps in zip(self.optimizer.param_groups, self._swaps, strict=False):
            for key, swap in swaps.items():
                swap.undo(group, key)
        self._swaps = []
        self.guard.after_update()
        self._capping = False
        if self._rewarm_taken:
            o = self.overrides
            o.rewarm_left = min(o.rewarm_left + 1, o.rewarm_steps)
        self._rewarm_taken = False

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
        for group, swaps in zip(self.optimizer.param_groups, self._swaps, strict=False):
            for key, swap in swaps.items():
                group[key] = swap.saved
        self._swaps = []
        self._rewarm_taken = False
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
        groups = self.optimizer.param_groups
        lr = groups[0].get("lr")
        if o.cap_until is not None:
            self._settle_cap(lr)  # a released cap lifted once the schedule is below where the trouble began
        self._swaps = []
        if o.layer_lr:
            o.settle_layers(self._schedule_on_host(groups))  # a released layer cut lifted once its group's LR is low
        decaying = _decaying_group(groups) if o.weight_decay is not None else None
        base = decaying["weight_decay"] if decaying is not None else 0.0
        for i, group in enumerate(groups):
            swaps: dict[str, _Swap] = {}
            if o.lr_changed and "lr" in group:
                swaps["lr"] = _Swap.of(group["lr"], o.scaled_lr(group["lr"], group=i, ref=lr))
            if o.beta2 is not None and "betas" in group:
                swaps["betas"] = _Swap.of(group["betas"], _with_beta2(group["betas"], o.beta2))
            if o.weight_decay is not None and "weight_decay" in group and (group["weight_decay"] or not base):
                # relative to each group's own value; groups without decay (norms, biases) keep 0 unless no
                # group decays at all
                wd = group["weight_decay"] * o.weight_decay / base if base else o.weight_decay
                swaps["weight_decay"] = _Swap.of(group["weight_decay"], wd)
            for key, swap in swaps.items():
                group[key] = swap.written
            self._swaps.append(swaps)
        if self.sampled:
            self.lrs_used = [g.get("lr") for g in groups]
        self._rewarm_taken = o.rewarm_left > 0
        if o.rewarm_left:
            o.rewarm_left -= 1

    def _settle_cap(self, lr: Any) -> None:
        """:meth:`~stabmon.overrides.Overrides.settle` on the schedule's LR read on the host; a tensor LR on an
        accelerator is not read: the released cap is held."""
        value = host_value(lr)
        if value is None:
            self._not_read(lr, "a released LR cap")
            return
        self.overrides.settle(value)

    def _schedule_on_host(self, groups: list[dict[str, Any]]) -> list[float | None]:
        """Each group's scheduled LR as a host float (None: a tensor on an accelerator, not read: its released
        layer cut is held)."""
        values = [host_value(g.get("lr")) for g in groups]
        for group, value in zip(groups, values, strict=True):
            if value is None:
                self._not_read(group.get("lr"), "a released layer cut")
        return values

    def _not_read(self, lr: Any, what: str) -> None:
        """Say once why a release waits: the schedule is a tensor the hooks do not read."""
        if self._unread_logged or not isinstance(lr, torch.Tensor):
            return
        self._unread_logged = True
        log.warning("stabmon: the learning rate is a tensor on %s: reading it between flushes would wait for the "
                    "device, so %s is held, not lifted, while it is; give the optimizer a float or CPU tensor "
                    "lr for releases to follow the schedule", lr.device, what)

    def learn_host(self, grad_norm: float | None, skipped: bool) -> None:
        """Keep the guard's host running mean of the grad norm (updated at flushes)."""
        self.guard.learn_host(grad_norm, skipped)

    def learned(self, state: Mapping[str, Any], records: Iterable[tuple[float | None, bool]]) -> dict[str, Any]:
        """What :meth:`state_dict` would say after loading ``state`` and learning ``records`` ((grad norm,
        skipped) of each flushed step, in order); nothing here is touched."""
        ema = state.get("ema_host")
        for grad_norm, skipped in records:
            ema = SkipGuard.folded(ema, grad_norm, skipped, self.guard.ema_decay)
        return {**state, "ema_host": ema}

    def state_dict(self) -> dict[str, Any]:
        return self.guard.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.guard.load_state_dict(state)


def on_host(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s value costs no device sync (a CPU tensor)."""
    return t.device.type == "cpu"


def host_value(value: Any) -> float | None:
    """A param-group value as a host float without waiting for a device: a number as it is, a one-element CPU
    tensor's value; None for a tensor elsewhere (reading it would wait for the device) or anything else.

    >>> host_value(0.1), host_value(torch.tensor(0.5)), host_value(torch.tensor(0.5, device="meta")), host_value(None)
    (0.1, 0.5, None, None)
    """
    if isinstance(value, torch.Tensor):
        return float(value.detach().reshape(())) if on_host(value) and value.numel() == 1 else None
    if isinstance(value, (int, float)):
        return float(value)
    return None


@dataclass
class _Swap:
    """One param-group entry the pre-hook replaced for a step: the group's own value, the one written, and for
    a written tensor a copy of its value (a scheduler fills a tensor LR in place, so the object alone cannot
    say whether it was written to since)."""

    saved: Any
    written: Any
    copy: torch.Tensor | None = None

    @classmethod
    def of(cls, saved: Any, written: Any) -> _Swap:
        copy = written.detach().clone() if isinstance(written, torch.Tensor) else None
        return cls(saved, written, copy)

    def undo(self, group: dict[str, Any], key: str) -> None:
        """After a step that never finished: the group's own value back where the group still holds the one
        written; a value assigned since is kept, and a written tensor filled since hands its new value to the
        group's own tensor (on the device: no host read)."""
        current = group.get(key)
        if current is not self.written:
            return
        if self.copy is not None and isinstance(self.saved, torch.Tensor) and isinstance(current, torch.Tensor):
            with torch.no_grad():
                self.saved.copy_(torch.where(current == self.copy, self.saved, current))
        group[key] = self.saved


def _with_beta2(betas: Any, beta2: float) -> tuple[Any, Any]:
    """``betas`` with the second replaced by ``beta2``, a tensor like the group's own where it holds tensors
    (torch's Adam takes both as floats or both as tensors)."""
    old = betas[1]
    return (betas[0], torch.full_like(old, beta2) if isinstance(old, torch.Tensor) else beta2)


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
