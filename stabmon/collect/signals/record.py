"""One step's record beyond the norms the optimizer hooks queue: observed values, activation norms, the
forward signals (:class:`ForwardSignal`: attention logits, :mod:`stabmon.collect.signals.attention`; output-logit scale,
:mod:`stabmon.collect.signals.logits`), the GradScaler's overflow flag and scale, the hyper-parameters in force,
per-rank values, step time and throughput.

The :class:`~stabmon.monitor.Monitor` opens each step with :meth:`StepRecorder.begin`, hands ``observe()``'s
values to :meth:`StepRecorder.observe` and closes the step with :meth:`StepRecorder.end`. Values stay on the
device until the flush; host values (step time, the hyper-parameters; on a process's first step its start,
``segment_start``; the seconds of a checkpoint saved or of loop work done since the previous step) are queued
as floats.

>>> import torch
>>> from stabmon.collect.config import MonitorConfig
>>> from stabmon.collect.failsafe import Failsafe
>>> from stabmon.collect.signals.grads import GradNorms
>>> from stabmon.overrides import Overrides
>>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> buffer = StepBuffer()
>>> hooks = OptimizerHooks(opt, GradNorms(model), buffer=buffer, overrides=Overrides())
>>> recorder = StepRecorder(buffer, hooks, config=MonitorConfig(), failsafe=Failsafe())
>>> recorder.begin(step=0, batch_index=0)
>>> recorder.observe([("loss", torch.tensor(2.0)), ("phase", torch.tensor(1j))], tokens=None, step=0)
>>> recorder.end()
>>> sorted(buffer.drain()[0].metrics), recorder.failsafe.errors["observe"]
(['clip', 'loss', 'lr', 'segment_start', 'startup_time', 'step_time', 'weight_decay'], 1)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from stabmon.collect.cluster.distributed import world
from stabmon.collect.cluster.ranks import RankProbe
from stabmon.collect.config import MonitorConfig
from stabmon.collect.failsafe import Failsafe
from stabmon.collect.signals.activations import ActivationNorms
from stabmon.collect.signals.buffer import StepBuffer
from stabmon.collect.signals.observe import value_problem
from stabmon.collect.step.optim import OptimizerHooks
from stabmon.collect.step.qk import StandingQkClip
from stabmon.events import Metric
from stabmon.store.limits import name_problem

log = logging.getLogger(__name__)

OUTSIDE_MIN = 1e-3
"""Seconds between one step's end and the next step's begin from which the record keeps them as
``outside_time`` (a loop that calls ``begin_step`` right after ``end_step`` adds no metric)."""


class ForwardSignal(Protocol):
    """A collector hooked on the forward pass of the steps it samples: :meth:`arm` registers its hooks for the
    step, :meth:`collect` returns its named device values (None: nothing measured) and removes them."""

    @property
    def armed(self) -> bool: ...

    def arm(self) -> None: ...

    def disarm(self) -> None: ...

    def collect(self) -> tuple[list[str], torch.Tensor | None]: ...


class StepRecorder:
    """What a step's record holds besides the hooks' norms; see the module docstring."""

    def __init__(
        self,
        buffer: StepBuffer,
        hooks: OptimizerHooks,
        *,
        config: MonitorConfig,
        failsafe: Failsafe,
        scaler: Any = None,
        activations: ActivationNorms | None = None,
        probe: RankProbe | None = None,
        forward: Sequence[tuple[int, ForwardSignal]] = (),
        standing_qk: StandingQkClip | None = None,
    ) -> None:
        self.buffer, self.hooks, self.config, self.failsafe = buffer, hooks, config, failsafe
        self.scaler, self.activations, self.probe = scaler, activations, probe
        self.forward = tuple(forward)
        """(sampling period in steps, signal) for each forward signal."""
        self.standing_qk = standing_qk
        """The standing QK-clip (``overrides.qk_tau``): its attention collector is armed on every step while it is
        on (only sampled steps are recorded), and it clips after the step."""
        self._clip_only = False  # the open step's attention is measured for the standing clip alone
        self.started: float | None = None
        """When the step being recorded began (``time.perf_counter``); flushes and checkpoints stay out."""
        self.created = time.time()
        self._created_clock = time.perf_counter()  # durations come from a monotonic clock; wall times only show
        self._ended: float | None = None
        """UNIX time the recorder (the process's monitor) was made: the next record's ``segment_start``."""
        self._carry: dict[str, float] = {}
        self._scale_snapshot: torch.Tensor | None = None
        self._hp_snapshot: dict[str, float] | None = None
        self._lr_snapshot: torch.Tensor | None = None
        self._tokens: int | None = None

    @property
    def trained(self) -> bool:
        """The open step observed something or stepped the optimizer."""
        return self.hooks.stepped or bool(self.buffer.pending_values)

    def begin(self, *, step: int, batch_index: int | None) -> None:
        if self.started is None:
            self.started = time.perf_counter()
            self._carry[Metric.SEGMENT_START] = self.created
            self._carry[Metric.STARTUP_TIME] = self.started - self._created_clock
        elif (outside := time.perf_counter() - self.started) >= OUTSIDE_MIN:
            self._carry[Metric.OUTSIDE_TIME] = outside  # the loop's own work between steps (an evaluation)
        self.buffer.begin(step=step, batch_index=batch_index)
        for name, value in self._carry.items():
            self.buffer.add_host(name, value)
        self._carry.clear()
        self.hooks.new_step()
        entered = self.hooks.overrides.at_step(step)  # a remembered fault's range: its cap from its first step
        self.hooks.screen_bar = self.hooks.overrides.screening(step)
        if entered is not None and world()[0] == 0:  # every rank enters it together: said once, by rank 0
            log.warning("stabmon: steps %d-%d broke down before; the learning rate is capped at %.4g until step %d",
                        entered["start"], entered["end"] - 1, entered["lr_cap"], entered["end"])
        self._scale_snapshot = None
        self._hp_snapshot = None
        self._lr_snapshot = None
        self._tokens = None
        if self.activations is not None and step % self.config.activations.every == 0:
            self.activations.arm()
        for every, signal in self.forward:
            if step % every == 0:
                signal.arm()
        standing = self.standing_qk
        self._clip_only = standing is not None and self.hooks.overrides.qk_tau is not None \
            and not standing.attention.armed
        if self._clip_only:
            standing.attention.arm()  # type: ignore[union-attr]
        self.hooks.sample(step)

    def discard(self) -> None:
        """Drop the open step (it never trained)."""
        self.buffer.discard()
        if self.activations is not None:
            self.activations.disarm()
        for _, signal in self.forward:
            signal.disarm()
        if self.standing_qk is not None and self.standing_qk.built:
            self.standing_qk.attention.disarm()

    def observe(self, values: Iterable[tuple[str, Any]], *, tokens: int | None, step: int) -> None:
        if tokens is not None:
            self._tokens = int(tokens)
        for name, value in values:
            if value is not None:
                self._observe_one(name, value, step)
        self._collect_forward()
        scaler = self.scaler
        if scaler is not None and scaler.is_enabled():
            # an overflow step never reaches the pre-hook: keep the values in force before scheduler.step()
            self._hp_snapshot = self.hooks.hparams()
            self._lr_snapshot = self.hooks.lr_on_device()
            if getattr(scaler, "_scale", None) is not None:
                self._scale_snapshot = scaler._scale.detach().clone()

    def _observe_one(self, name: str, value: Any, step: int) -> None:
        """Queue one observed value. A value that cannot be a metric (meta tensor, complex, a name the store
        cannot hold) is dropped alone, logged once per name and counted in ``errors``; never raised."""
        problem = name_problem("observe: metric name", name) or value_problem(name, value)
        if problem is None and name == Metric.LOSS:
            self.hooks.observed_loss(value)
        if problem is None and isinstance(value, torch.Tensor):
            self.buffer.add([name], value.detach())
        elif problem is None:
            self.buffer.add_host(name, float(value.item() if hasattr(value, "item") else value))
        else:
            errors = self.failsafe.errors
            errors["observe"] += 1
            if errors[f"observe:{name[:64]}"] == 0:
                log.error("stabmon: %s (dropped at step %d; counted in monitor.errors)", problem, step)
            errors[f"observe:{name[:64]}"] += 1

    def end(self) -> None:
        """Close the step's record: activations, scaler, hyper-parameters in force, per-rank values, time. A
        step whose ``optimizer.step()`` raised after the pre-hook has that hook's changes undone here
        (:meth:`~stabmon.collect.step.optim.OptimizerHooks.abandon_unfinished`)."""
        self.hooks.abandon_unfinished()
        self._collect_forward()
        self._record_scaler()
        hooks = self.hooks
        hp = hooks.last_hparams if hooks.stepped else (self._hp_snapshot or hooks.hparams())
        for name, value in hp.items():
            self.buffer.add_host(name, value)
        if Metric.LR not in hp and (lr := self._device_lr()) is not None:
            self.buffer.add([Metric.LR], lr)  # a tensor LR on an accelerator: copied with the rest at the flush
        if self.probe is not None:
            local_norm = hooks.grads.last_local_total if hooks.stepped else None
            before_flush = len(self.buffer) + 1 >= self.config.flush_every
            self.probe.record(self.buffer, started=self.started, local_norm=local_norm, before_flush=before_flush)
        now = self._ended = time.perf_counter()
        elapsed = now - (self.started or now)
        self.buffer.add_host(Metric.STEP_TIME, elapsed)
        if self._tokens is not None and elapsed > 0:
            self.buffer.add_host(Metric.TOKENS_PER_SEC, self._tokens / elapsed)
        self.buffer.end(time=time.time())
        if self.standing_qk is not None and hooks.stepped and hooks.overrides.qk_tau is not None:
            tau = hooks.overrides.qk_bound()  # a release in progress raises it step by step, then turns it off
            if tau is not None:
                self.standing_qk.apply(tau=tau)  # after the optimizer step, as Kimi K2 does

    def _device_lr(self) -> torch.Tensor | None:
        """The step's LR in force as a device value where the host values leave it out (a tensor LR on an
        accelerator: :meth:`~stabmon.collect.step.optim.OptimizerHooks.lr_on_device`), taken when the host values
        were."""
        hooks = self.hooks
        if hooks.stepped:
            return hooks.last_lr_on_device
        return self._lr_snapshot if self._hp_snapshot is not None else hooks.lr_on_device()

    def note(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to the host value ``name`` of the next step's record (a checkpoint saved between
        steps: :data:`~stabmon.events.Metric.CHECKPOINT_TIME`)."""
        self._carry[name] = self._carry.get(name, 0.0) + seconds

    def restart_clock(self) -> None:
        """The next step's time starts now (after the flush and the checkpoint of the step that ended); the time
        since that step's end goes on the next record (``monitor_time``, 1 ms or more)."""
        self.started = time.perf_counter()
        if self._ended is not None and (between := self.started - self._ended) >= OUTSIDE_MIN:
            self._carry[Metric.MONITOR_TIME] = between
        self._ended = None

    def _collect_forward(self) -> None:
        acts = self.activations
        if acts is not None and acts.armed:
            names, values = acts.collect()
            if values is not None:
                self.buffer.add([Metric.ACT_RMS_PREFIX + n for n in names], values)
        if self._clip_only and self.standing_qk is not None and self.standing_qk.attention.armed:
            # first: the collector may be the sampled one, and this is not a sampled step (kept for the clip only)
            self.standing_qk.attention.collect()
        for _, signal in self.forward:
            if signal.armed:
                names, values = signal.collect()
                if values is not None:
                    self.buffer.add(names, values)

    def _record_scaler(self) -> None:
        scaler = self.scaler
        if scaler is None or not scaler.is_enabled():
            if self.hooks.skip_reported:  # a loss scaler the monitor does not hold (an engine's own) skipped it
                self.buffer.add_host(Metric.OVERFLOW, 1.0)
            return
        # scaler.step() skips a non-fused optimizer.step() (and so the pre-hook) when it found inf/NaN
        # gradients; a fused optimizer steps anyway and its kernel skips on the scaler's found_inf
        found_inf = self.hooks.found_inf if self.hooks.stepped else None
        if found_inf is not None:
            self.buffer.add([Metric.OVERFLOW], found_inf)
        else:
            self.buffer.add_host(Metric.OVERFLOW, 0.0 if self.hooks.stepped else 1.0)
        scale = self._scale_snapshot
        if scale is None and getattr(scaler, "_scale", None) is not None:
            scale = scaler._scale.detach().clone()
        if scale is not None:
            self.buffer.add([Metric.LOSS_SCALE], scale)
