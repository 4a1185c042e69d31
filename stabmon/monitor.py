"""The live monitor: collectors -> StepRecord -> detectors -> runbook engine -> interventions, recorded in
SQL.

A plain PyTorch loop needs four lines::

    monitor = stabmon.Monitor(model, optimizer, scheduler=scheduler, runbook="default", mode="propose",
                              config=MonitorConfig(clip=1.0), checkpoint_dir="ckpt")
    for step, batch in monitor.steps(loader, max_steps=10_000):
        loss = model(batch)
        loss.backward()
        monitor.observe(loss=loss)          # tensors only; nothing is read back here
        optimizer.step()                    # the monitor's hooks: unscale, norms, clip, overrides
        scheduler.step(); optimizer.zero_grad()
    monitor.close()
    sys.exit(monitor.exit_code)             # 0, or STOP_EXIT_CODE after checkpoint-and-stop / kill switch

Everything measured stays on the device until a flush (every ``config.flush_every`` steps and at close): one
stacked copy to the host, then StepRecords go through the :class:`~stabmon.pipeline.Pipeline`, to the store
and the notifier (:class:`~stabmon.collect.flushing.Flusher`). Decisions are applied at flushes through
:class:`~stabmon.interventions.Executor`, whose target is a :class:`~stabmon.collect.target.LiveTarget`
(the overrides, rollback and checkpoint-and-stop; :class:`~stabmon.pipeline.InterventionTarget`).

A framework that runs backward inside ``optimizer.step(closure)`` (Lightning) takes the optimizer hooks off
(:meth:`Monitor.remove_optimizer_hooks`) and calls :meth:`Monitor.before_optimizer_step` and
:meth:`Monitor.after_optimizer_step` itself; :meth:`Monitor.sync_step` follows a framework's step count.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from stabmon.collect.activations import ActivationNorms
from stabmon.collect.batches import batch_log_for
from stabmon.collect.buffer import StepBuffer
from stabmon.collect.config import ActivationConfig, EmbeddingConfig, GradConfig, MonitorConfig
from stabmon.collect.data import DataCursor
from stabmon.collect.distributed import RankFollower, broadcast, mean_across_ranks, world
from stabmon.collect.embeddings import EmbeddingDrift
from stabmon.collect.failsafe import Failsafe
from stabmon.collect.flushing import Flusher, Outbox
from stabmon.collect.grads import GradNorms
from stabmon.collect.interrupts import INTERRUPTED, ExitGuard
from stabmon.collect.memory import DeviceMemory
from stabmon.collect.optim import OptimizerHooks
from stabmon.collect.ranks import RankGather, RankProbe
from stabmon.collect.record import StepRecorder
from stabmon.collect.rerun_ranks import CrossRank, RankChannel
from stabmon.collect.restore import TrainingState
from stabmon.collect.resume import ResumeCheck
from stabmon.collect.sharding import ShardedSquares, embedding_counted, layout_of
from stabmon.collect.target import LiveTarget
from stabmon.collect.updates import UpdateNorms
from stabmon.collect.vocab import untrained_loss
from stabmon.collect.wiring import (
    DEFAULT_STORE,
    MODES,
    build_pipeline,
    check_model_and_optimizer,
    resolve_notifier,
    resolve_store,
)
from stabmon.events import Anomaly, Event, Metric, StepRecord
from stabmon.overrides import Overrides
from stabmon.recipe import check_recipe, run_recipe
from stabmon.store.limits import check_name

log = logging.getLogger(__name__)

__all__ = ["ActivationConfig", "EmbeddingConfig", "GradConfig", "Monitor", "MonitorConfig"]


class Monitor:
    """Watch one model/optimizer pair in a plain training loop; see the module docstring.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> data = [torch.randn(16, 4, generator=torch.Generator().manual_seed(i)) for i in range(30)]
    >>> with Monitor(model, opt, store=None, config=MonitorConfig(clip=1.0, flush_every=10)) as mon:
    ...     for step, x in mon.steps(data):
    ...         loss = model(x).pow(2).mean()
    ...         loss.backward()
    ...         mon.observe(loss=loss)
    ...         opt.step(); opt.zero_grad()
    >>> mon.step, len(mon.records), sorted(mon.records[0].metrics)[:3]
    (30, 30, ['act_rms/0', 'act_rms/1', 'act_rms/2'])
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scaler: Any = None,
        scheduler: Any = None,
        store: Any = DEFAULT_STORE,
        runbook: Any = None,
        mode: str | None = "propose",
        detectors: Any = None,
        notifier: Any = None,
        alerts: Iterable[str] | None = None,
        config: MonitorConfig | None = None,
        run_name: str | None = None,
        checkpoint_dir: str | None = None,
        checkpoints: Any = None,
        resume_run_id: str | None = None,
        resume: dict[str, Any] | None = None,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        sample_ids: Callable[[Any], Any] | None = None,
        recipe: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config if config is not None else MonitorConfig()
        if not isinstance(self.config, MonitorConfig):
            raise ValueError(f"config: expected a MonitorConfig, got {type(self.config).__name__}")
        self.config.validate()
        self.config = _with_cadence(self.config, checkpoint_dir=checkpoint_dir, checkpoints=checkpoints)
        check_model_and_optimizer(model, optimizer)
        user_recipe = check_recipe(recipe)
        if run_name is not None:
            check_name("run_name", run_name)
        if mode not in MODES:
            raise ValueError(f"mode: must be one of {', '.join(map(str, MODES))}, got {mode!r}")
        self.model, self.optimizer, self.scaler, self.scheduler, self.mode = model, optimizer, scaler, scheduler, mode
        overrides = Overrides()
        self.cursor = DataCursor()
        self.buffer = StepBuffer()
        self._step = 0
        self.failsafe = Failsafe(step=lambda: self._step)
        self.errors: Counter[str] = self.failsafe.errors
        cfg = self.config
        self.layout = layout_of(model)
        sharded = ShardedSquares(self.layout.counted) if self.layout.sharded else None
        self._grads = GradNorms(model, cfg.grads.layers, sharded=sharded)
        self._acts = ActivationNorms(model, cfg.activations.modules) if cfg.activations.every else None
        emb_counted = embedding_counted(model, self.layout)
        self._emb = (
            EmbeddingDrift(model, rows=cfg.embeddings.rows, reference=cfg.embeddings.reference, counted=emb_counted)
            if cfg.embeddings.every
            else None
        )
        self._hooks = OptimizerHooks(
            optimizer,
            self._grads,
            buffer=self.buffer,
            overrides=lambda: overrides,
            clip=cfg.clip,
            scaler=scaler,
            embeddings=self._emb,
            ema_decay=cfg.grads.skip_ema,
            updates=UpdateNorms(self._grads) if cfg.updates.every else None,
        )
        self.rank, self.world_size = world()
        self._probe: RankProbe | None = None
        self._rank_values: RankGather | None = None
        if self.world_size > 1:
            self.buffer.reduce = mean_across_ranks
            replicated = self.layout.kind == "ddp"
            self.buffer.gather = self._rank_values = RankGather(replicated=replicated, keep=cfg.diagnose.batches)
            self._probe = RankProbe(model, self._grads.params, replicated=replicated)
        self.recorder = StepRecorder(self.buffer, self._hooks, config=cfg, failsafe=self.failsafe, scaler=scaler,
                                     activations=self._acts, probe=self._probe)
        self.run_name = run_name or time.strftime("run-%Y%m%d-%H%M%S")
        self.outbox = self._open_outbox(store, notifier, alerts)
        self.target = LiveTarget(
            hparams=self._hooks.hparams,
            step=lambda: self._step,
            state=TrainingState(model, optimizer, scaler, scheduler, monitor=self),
            cursor=self.cursor,
            outbox=self.outbox,
            failsafe=self.failsafe,
            stop_code=cfg.exit_code,
            overrides=overrides,
            rank=self.rank,
        )
        self.pipeline, self.executor = build_pipeline(self.target, detectors=detectors, runbook=runbook, mode=mode)
        self.batches = batch_log_for(self.pipeline.engine, sample_ids, capacity=cfg.diagnose.batches)
        #: ln(output classes), recorded once with the first step observed (None: unknown, or recorded)
        self._untrained: float | None = untrained_loss(model)
        self._loss_fn = loss_fn  # diagnose's loss of a batch (None: stabmon.collect.rerun.call_model)
        diagnosing = self.batches is not None and self.world_size > 1
        self._channel = RankChannel(rank=self.rank, world_size=self.world_size if diagnosing else 1,
                                    timeout=cfg.diagnose.timeout)
        cross = CrossRank(self.diagnose, rank=self.rank, world_size=self.world_size)
        self.target.diagnoser = cross
        self._follower = RankFollower()
        self.flusher = Flusher(
            self.pipeline,
            self.outbox,
            target=self.target,
            failsafe=self.failsafe,
            mode=mode,
            follower=self._follower,
            kill_switch=_kill_switch(cfg.kill_switch),
            rank=self.rank,
            world_size=self.world_size,
        )
        self.flusher.joiners["diagnose"] = cross.join
        if resume and resume_run_id is None:  # a saved monitor state names its run: reopen that one
            resume_run_id = resume.get("run_id")
        run_id = self.outbox.start_run(config=self._run_config(user_recipe), resume_run_id=resume_run_id)
        if self.world_size > 1:
            self.outbox.run_id = broadcast(run_id)
        self.target.checkpoints = checkpoints if checkpoints is not None else self._manager(checkpoint_dir)
        if checkpoints is not None and hasattr(checkpoints, "attach"):
            checkpoints.attach(sink=self.outbox.store, run_id=self.run_id)
        last = self.outbox.last_step() if resume_run_id is not None else None
        self._resume = ResumeCheck(resume_run_id, last_step=broadcast(last) if self.world_size > 1 else last)
        self.records: deque[StepRecord] = deque(maxlen=cfg.history)
        self._closed = False
        self._initial_saved = False
        self._pauses: list[str] = []  # monitor.paused(...) stretches in progress
        self._loop_ended = False
        self._watchdog = self._start_watchdog(store) if cfg.hang_timeout is not None else None
        self._hooks.install()
        self._exit_guard = ExitGuard(self.close)  # Ctrl-C, SIGTERM or an exit without close(): run interrupted
        if resume:
            self.load_state_dict(resume)
        if self.rank == 0:
            self._warn_unfit()

    def _run_config(self, user_recipe: dict[str, Any] | None) -> dict[str, Any]:
        """What the store keeps as the run's config: the monitor's config, the mode and the recipe."""
        recipe = run_recipe(optimizer=type(self.optimizer).__name__, hparams=self.hparams(),
                            runbook=getattr(self.pipeline.engine, "runbook", None), user=user_recipe)
        return {"monitor": self.config.to_dict(), "mode": self.mode, "recipe": recipe}

    def _warn_unfit(self) -> None:
        """Say at start which runbook rungs cannot act on this optimizer (they would be skipped or fail)."""
        runbook = getattr(self.pipeline.engine, "runbook", None)
        if runbook is None:
            return
        from stabmon.runbook.fit import fit_warnings

        for line in fit_warnings(runbook, self.hparams(), checkpoints=self.checkpoints is not None,
                                 facts=self.target.facts()):
            log.warning("stabmon: runbook %s: %s", runbook.name, line)
        rolls_back = any(rung.action == "rollback" for rule in runbook.rules for rung in rule.ladder)
        if rolls_back and self.checkpoints is not None and not self.config.checkpoint_every \
                and not self.checkpoints.checkpoints:
            log.warning(
                "stabmon: config.checkpoint_every=0 and no checkpoint registered in %s: a rollback fails until "
                "you save one (monitor.save_checkpoint() or checkpoints.register)", self.checkpoints.directory
            )

    def _open_outbox(self, store: Any, notifier: Any, alerts: Iterable[str] | None) -> Outbox:
        """Rank 0's store and notifier (only rank 0 writes to the store and sends alerts)."""
        leader = self.rank == 0
        sink, owns_store = resolve_store(store if leader else None)
        alerter, owns_notifier = resolve_notifier(notifier, alerts, sink) if leader else (None, False)
        return Outbox(sink, alerter, failsafe=self.failsafe, run_name=self.run_name, owns_store=owns_store,
                      owns_notifier=owns_notifier)

    def _manager(self, checkpoint_dir: str | None) -> Any:
        if checkpoint_dir is None:
            return None
        from stabmon.checkpoints import CheckpointManager

        return CheckpointManager(
            checkpoint_dir, keep=self.config.checkpoint_keep, sink=self.outbox.store, run_id=self.run_id
        )

    # -- what the monitor is made of ---------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps completed (the index the next step will get)."""
        return self._step

    @property
    def overrides(self) -> Overrides:
        """LR / clip / beta2 / weight-decay / skip overrides in force (the intervention target's)."""
        return self.target.overrides

    @property
    def checkpoints(self) -> Any:
        """The :class:`~stabmon.checkpoints.CheckpointManager`, or None."""
        return self.target.checkpoints

    @property
    def should_stop(self) -> bool:
        """True once checkpoint-and-stop, the kill switch or rank 0 asked the run to stop."""
        return self.target.should_stop

    @property
    def stop_reason(self) -> str | None:
        return self.target.stop_reason

    @property
    def exit_code(self) -> int:
        """0, or after a requested stop its code: ``config.exit_code`` (:data:`stabmon.checkpoints.STOP_EXIT_CODE`)
        unless the stopping rung named another (``HARDWARE_EXIT_CODE`` after a hardware-suspect diagnosis)."""
        return self.target.exit_code

    @property
    def store(self) -> Any:
        """The store sink (None without a store, and on ranks other than 0); assignable."""
        return self.outbox.store

    @store.setter
    def store(self, sink: Any) -> None:
        self.outbox.store = sink

    @property
    def notifier(self) -> Any:
        return self.outbox.notifier

    @property
    def run_id(self) -> str:
        return self.outbox.run_id

    @property
    def events(self) -> list[Event]:
        """Every anomaly, decision, intervention and outcome published in this run."""
        return self.flusher.events

    @property
    def anomalies(self) -> list[Anomaly]:
        return self.flusher.anomalies

    def hparams(self) -> dict[str, float]:
        """lr, beta2, weight_decay and clip in force for the next step (overrides included)."""
        return self.target.hparams()

    def rollback(
        self, *, onset_step: int, lookback: int, skip_batches: int, checkpoint_dir: str | None = None
    ) -> dict[str, Any]:
        """Restore the last-known-good checkpoint and skip data (:meth:`LiveTarget.rollback`)."""
        return self.target.rollback(
            onset_step=onset_step, lookback=lookback, skip_batches=skip_batches, checkpoint_dir=checkpoint_dir
        )

    def checkpoint_and_stop(self, *, reason: str, exit_code: int | None = None) -> dict[str, Any]:
        """Save a checkpoint and ask the loop to stop with ``exit_code`` (default ``config.exit_code``)."""
        return self.target.checkpoint_and_stop(reason=reason, exit_code=exit_code)

    def diagnose(self, **params: Any) -> dict[str, Any]:
        """Re-run and replay the incident's steps (see :mod:`stabmon.collect.rerun`); the verdict and its
        evidence. Under torch.distributed every rank must call it at the same point (a runbook's ``diagnose``
        rung does: rank 0 calls the others in, :mod:`stabmon.collect.rerun_ranks`)."""
        from stabmon.collect.rerun import diagnose

        own = self._rank_values.own if self._rank_values is not None else None
        return diagnose(self, self._grads, self._hooks, loss_fn=self._loss_fn, own=own, channel=self._channel,
                        **params)

    def device_memory(self) -> DeviceMemory:
        """Bytes the monitor holds on the device right now, per signal (activation norms hold a few scalars
        of the sampled step only, already counted in ``pending`` once collected)."""
        return DeviceMemory(
            embeddings=self._emb.device_bytes() if self._emb else 0,
            skip_guard=self._hooks.guard.nbytes(),
            pending=self.buffer.nbytes(),
        )

    # -- for training frameworks -------------------------------------------------------------------------
    def remove_optimizer_hooks(self) -> None:
        """Take the optimizer step pre/post hooks off, for a framework that runs backward inside
        ``optimizer.step(closure)``; it then calls :meth:`before_optimizer_step` and
        :meth:`after_optimizer_step` itself."""
        self._hooks.remove()

    def before_optimizer_step(self) -> None:
        """The pre-step work (unscale, norms, skip guard, clip, overrides): after backward, before the update."""
        self._hooks.before_step()

    def after_optimizer_step(self, *, skipped: bool = False) -> None:
        """The post-step work (scheduler-visible values back, the skip guard finished): after the update.
        ``skipped=True``: the optimizer did not step after all (a loss scaler's overflow). The step is then
        recorded with ``overflow = 1``, even when the scaler is not one the monitor was given (an engine's own
        loss scaling), so a non-finite grad norm on it reads as the routine skip it is; it may be called
        without :meth:`before_optimizer_step` when the skip came before the optimizer was reached."""
        self._hooks.after_step(skipped=skipped)

    def sync_step(self, step: int) -> None:
        """Set the step counter to a framework's optimizer-step count (after a resume without saved monitor
        state, or when the framework restored another step). Call it between steps."""
        try:
            value = operator.index(step)
        except TypeError:
            raise ValueError(f"sync_step: step must be an integer >= 0, got {type(step).__name__}") from None
        if value < 0:
            raise ValueError(f"sync_step: step must be an integer >= 0, got {value}")
        self._step = value
        self._resume.settle()


    # -- the loop ----------------------------------------------------------------------------------------
    def steps(
        self, loader: Iterable[Any], *, max_steps: int | None = None, epochs: int | None = None
    ) -> Iterator[tuple[int, Any]]:
        """Yield ``(step, batch)``: one pass over ``loader`` (``epochs`` passes; with ``max_steps`` and no
        ``epochs``, as many passes as needed). Stops early when the monitor asks to stop."""
        if epochs is None and max_steps is not None:
            passes: int | None = None
        else:
            passes = 1 if epochs is None else epochs
        if self.should_stop or (max_steps is not None and self._step >= max_steps):
            return
        self._loop_ended = False
        try:
            yield from self._loop(loader, passes, max_steps)
        finally:
            self._loop_ended = True  # what follows the loop (a final evaluation, saving, close) is not a hang

    def _loop(self, loader: Iterable[Any], passes: int | None, max_steps: int | None) -> Iterator[tuple[int, Any]]:
        for index, batch in self.cursor.batches(loader, passes):
            self.begin_step(batch_index=index, batch=batch)
            try:
                yield self._step, batch
            except GeneratorExit:  # the loop was left (break) during this step
                if self.recorder.trained:
                    self.end_step()
                else:  # left before training on the batch: no step happened
                    self.recorder.discard()
                raise
            self.end_step()
            if self.should_stop or (max_steps is not None and self._step >= max_steps):
                return

    def begin_step(self, *, batch_index: int | None = None, batch: Any = None) -> None:
        """Open the record of the next step (done by :meth:`steps`; call it yourself in a hand-written
        loop, with the ``batch`` when a runbook diagnoses or ``sample_ids`` is given)."""
        if self.buffer.open:
            self.end_step()
        self._resume.first_step(self._step)  # a resumed run must not start over at step 0
        if not self._initial_saved and self.config.checkpoint_every:
            # the first step of a run not restored from a state (its first step may be 1, as in HF Trainer):
            # the initial state is known-good, so a rollback can always reach it
            self._initial_saved = True
            if self.checkpoints is not None:
                self._timed_save()
        self.recorder.begin(step=self._step, batch_index=batch_index)
        if self.batches is not None and batch is not None:
            self.batches.remember(step=self._step, batch_index=batch_index, batch=batch)

    def observe(self, loss: Any = None, *, tokens: int | None = None, **metrics: Any) -> None:
        """Record this step's loss (and any other named scalars) as device tensors: no host sync.
        ``tokens`` (a host int: tokens in this step's batch) adds ``tokens_per_sec`` at the end of the step."""
        if not self.buffer.open:
            self.begin_step()
        if self._untrained is not None:  # a host float, once: what the no_progress detector calls untrained
            metrics = {**metrics, Metric.UNTRAINED_LOSS: self._untrained}
            self._untrained = None
        self.recorder.observe((("loss", loss), *metrics.items()), tokens=tokens, step=self._step)

    def end_step(self) -> None:
        """Close the step's record; flush when ``config.flush_every`` steps are waiting."""
        if not self.buffer.open:
            return
        self.recorder.end()
        self._step += 1
        if self._watchdog is not None:
            self._watchdog.beat(self._step - 1)
        every = self.config.checkpoint_every
        if every and self.checkpoints is not None and self._step % every == 0:
            self._timed_save()
        if len(self.buffer) >= self.config.flush_every:
            self.flush()
        self.recorder.restart_clock()  # flush and checkpoint time stay out of the next step's time

    # -- flush -------------------------------------------------------------------------------------------
    def flush(self) -> list[StepRecord]:
        """Copy waiting metrics to the host once, run them through the pipeline, hand events to the sinks."""
        # a failed read-back is logged and counted; every rank still reaches the flush's collective
        records: list[StepRecord] = self.failsafe.call("collect", self.buffer.drain) or []
        for r in records:
            self._hooks.learn_host(r.get(Metric.GRAD_NORM), bool(r.get(Metric.SKIPPED)))
        self.records.extend(records)
        self.flusher.flush(records)
        return records

    def _start_watchdog(self, store: Any) -> Any:
        """The hang watchdog (a thread): rank 0 publishes without waiting for a flush (never at the same time
        as one); another rank writes its own report into the run; ``config.hang.exit_code`` then ends the
        process."""
        from stabmon.collect.hangs import HangReporter, start_watchdog

        outbox = self.outbox
        reporter = HangReporter(
            rank=self.rank,
            publish=self.flusher.publish_from_thread,
            settle=outbox.settle,
            open_store=lambda: resolve_store(store),
            run_id=lambda: outbox.run_id,
            run_name=self.run_name,
            exit_code=self.config.hang.exit_code,
            quiet=self._hang_quiet,
            last_words=self._hang_last_words,
            alarm=self._hang_alarm(),
        )
        return start_watchdog(self.config, reporter, label=f"rank {self.rank}: " if self.world_size > 1 else "")

    def _hang_alarm(self) -> Any:
        """Under torch.distributed, the alarm that makes every rank report its stacks when one rank hangs."""
        if self.world_size <= 1:
            return None
        from stabmon.collect.hang_alarm import PeerAlarm

        return PeerAlarm.of_default_group(self.world_size)

    def heartbeat(self) -> None:
        """A sign of life between steps (inside a long evaluation): re-arms the hang watchdog without
        teaching it that steps are this slow."""
        if self._watchdog is not None:
            self._watchdog.beat(self._step - 1, learn=False)

    @contextmanager
    def paused(self, reason: str) -> Iterator[None]:
        """A stretch of the loop that is not a step and may take long (an evaluation, a checkpoint, reloading
        data): the hang watchdog does not fire inside it, and its time is not learned as a step.

        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> mon = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=None, detectors=False)
        >>> with mon.paused("eval"):
        ...     mon._hang_quiet()
        "paused for 'eval'"
        >>> mon.close()
        """
        self._pauses.append(reason)
        try:
            yield
        finally:
            self._pauses.remove(reason)
            self.heartbeat()

    def _hang_quiet(self) -> str | None:
        """Why no step for a while is not a hang now (read by the watchdog thread); None: it is."""
        if self._pauses:
            return f"paused for {self._pauses[-1]!r}"
        if self._loop_ended:
            return "the training loop has ended"
        return None

    def _hang_last_words(self) -> None:
        """Before a hang exit, on the watchdog thread (the training thread is stuck): the steps waiting in the
        buffer go to the store as recorded (the pipeline is not run) and the run is marked ``hung``. The
        read-back is bounded: a hung device may never answer."""
        records = self.failsafe.call_within("collect", self.buffer.drain, timeout=10.0) or []
        self.outbox.write_steps(records)
        self.outbox.mark("hung")

    # -- state -------------------------------------------------------------------------------------------
    def _timed_save(self) -> None:
        """A checkpoint at the cadence, its seconds on the next step's record (the goodput ledger's)."""
        started = time.perf_counter()
        self.save_checkpoint()
        self.recorder.note(Metric.CHECKPOINT_TIME, time.perf_counter() - started)

    def save_checkpoint(self) -> Any:
        """Save :meth:`training_state` through the checkpoint manager; failures are logged and counted. A save
        is a declared pause (:meth:`paused`): a long one is not a hang, and its time is not learned as a step."""
        with self.paused("checkpoint"):
            return self.target.save_checkpoint()

    def training_state(self) -> dict[str, Any]:
        """Everything a checkpoint holds: model, optimizer, scaler, scheduler and the monitor's own state."""
        return self.target.state.state_dict()

    def load_training_state(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`training_state` (all or nothing; ``ValueError`` when it does not fit)."""
        self.target.state.load(state)

    def state_dict(self) -> dict[str, Any]:
        """Step counter, data position, overrides, detector/engine/executor state, guard and embedding
        baselines."""
        return {
            "version": 1,
            "step": self._step,
            "data": self.cursor.state_dict(),
            "overrides": self.overrides.state_dict(),
            "pipeline": self.failsafe.call("pipeline", self.pipeline.state_dict),
            "executor": self.executor.state_dict() if hasattr(self.executor, "state_dict") else None,
            "follower": self._follower.state_dict(),
            "hooks": self._hooks.state_dict(),
            "embeddings": self._emb.state_dict() if self._emb else None,
            "notifier": self.outbox.notifier_state(),
            "run_id": self.run_id,
            "run_name": self.run_name,
            "checkpoints": self.checkpoints.state_dict() if self.checkpoints is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any], *, pipeline: bool = True) -> None:
        """Restore a :meth:`state_dict` (``pipeline=False`` keeps the detectors, engine and executor)."""
        self._step = int(state["step"])
        self._initial_saved = True  # a resumed run's first step is not its initial state
        self.cursor.load_state_dict(state["data"])
        self.overrides.load_state_dict(state["overrides"])
        self._hooks.load_state_dict(state.get("hooks", {}))
        if self._emb and state.get("embeddings"):
            self._emb.load_state_dict(state["embeddings"])
        if pipeline:
            self._load_pipeline_state(state)
            if self.checkpoints is not None and state.get("checkpoints"):  # a resume, maybe into another directory
                self.checkpoints.adopt(state["checkpoints"])
        self.outbox.load_notifier_state(state.get("notifier"))
        self._resume.settle()

    def _load_pipeline_state(self, state: dict[str, Any]) -> None:
        if state.get("pipeline") is not None:
            self.pipeline.load_state_dict(state["pipeline"])
            reseed = getattr(self.pipeline.engine, "reseed", None)
            if reseed is not None:  # another run may continue from this same state: never share an id
                reseed()
            self.failsafe.call("pipeline", lambda: self.pipeline.detectors.enter_grace(self.config.grace_steps))
        if state.get("executor") is not None and hasattr(self.executor, "load_state_dict"):
            self.executor.load_state_dict(state["executor"])
        if state.get("follower") is not None:
            self._follower.load_state_dict(state["follower"])

    # -- lifecycle ---------------------------------------------------------------------------------------
    def close(self, status: str | None = None) -> None:
        """Flush what is left, end the run in the store, remove the hooks. Idempotent."""
        if self._closed:
            return
        self._exit_guard.release()
        if status == INTERRUPTED and self.buffer.open and not self._hooks.stepped:
            self.recorder.discard()  # interrupted before its update: the step did not happen
        self.end_step()
        self.flush()
        if status == INTERRUPTED and self.rank == 0 and self.target.can_save and self._step > 0:
            self.save_checkpoint()  # a resume from here repeats no step
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.stop()
        self._hooks.remove()
        if self._probe is not None:
            self._probe.remove()
        if self._acts is not None:
            self._acts.disarm()
        self.outbox.close(status or ("stopped" if self.should_stop else "finished"))

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
            self.close(status=INTERRUPTED)
        else:
            self.close(status="failed" if exc_type is not None else None)


def _with_cadence(config: MonitorConfig, *, checkpoint_dir: str | None, checkpoints: Any) -> MonitorConfig:
    """``config`` with the checkpoint cadence in force (``checkpoint_every=None`` resolved), the value stored
    with the run."""
    can_save = checkpoint_dir is not None or bool(checkpoints is not None and getattr(checkpoints, "can_save", True))
    return dataclasses.replace(config, checkpoint_every=config.checkpoint_cadence(can_save=can_save))


def _kill_switch(path: str | None) -> Any:
    if not path:
        return None
    from stabmon.checkpoints import KillSwitch

    return KillSwitch(path, every=1)
