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
:class:`~stabmon.interventions.Executor`, which hands each intervention the run's
:class:`~stabmon.interventions.handle.Handle` (the overrides, the step, the model and optimizer, and the verbs of
:class:`~stabmon.collect.checkpoint.recovery.Recovery`: rollback and checkpoint-and-stop, joint across ranks).

A framework that runs backward inside ``optimizer.step(closure)`` (Lightning) takes the optimizer hooks off
(:meth:`Monitor.remove_optimizer_hooks`) and calls :meth:`Monitor.before_optimizer_step` and
:meth:`Monitor.after_optimizer_step` itself; :meth:`Monitor.sync_step` follows a framework's step count.
"""

from __future__ import annotations

import logging
import operator
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from stabmon.checkpoints import CheckpointStore
from stabmon.collect.batches import batch_log_for
from stabmon.collect.build import (
    build_checkpoints,
    build_outbox,
    build_pipeline,
    build_signals,
    build_snapshots,
    build_training_state,
    kill_switch,
)
from stabmon.collect.checkpoint.landing import RerunLanding
from stabmon.collect.checkpoint.monitor_state import build_monitor_state
from stabmon.collect.checkpoint.recovery import Recovery
from stabmon.collect.checkpoint.resume import ResumeCheck
from stabmon.collect.checkpoint.snapshots import TieredCheckpoints
from stabmon.collect.cluster.distributed import PeerLost, RankFollower, broadcast, world
from stabmon.collect.cluster.joint import RankChannel
from stabmon.collect.cluster.rank_policy import SavePath, rank_policy
from stabmon.collect.config import ActivationConfig, EmbeddingConfig, GradConfig, MonitorConfig
from stabmon.collect.data import DataCursor
from stabmon.collect.failsafe import Failsafe
from stabmon.collect.flushing import Flusher
from stabmon.collect.hangs import HangReporter, LoopActivity, start_watchdog, write_last_words
from stabmon.collect.interrupts import INTERRUPTED, ExitGuard, InterruptHold, deliver_held
from stabmon.collect.run_state import RunState
from stabmon.collect.signals.alarm import NonfiniteAlarm
from stabmon.collect.signals.buffer import StepBuffer
from stabmon.collect.signals.memory import DeviceMemory
from stabmon.collect.signals.vocab import untrained_loss
from stabmon.collect.wiring import check_model_and_optimizer, resolve_decisions, resolve_store
from stabmon.diagnose import Diagnosis
from stabmon.diagnose.build import HookSwitch, build_diagnoser
from stabmon.events import Anomaly, Event, Metric, StepRecord
from stabmon.interventions._state import run_facts
from stabmon.interventions.diagnose import Diagnose
from stabmon.interventions.handle import Training
from stabmon.overrides import Overrides
from stabmon.pipeline import LadderEngine, calls_for_closer_flushes, open_onset
from stabmon.recipe import run_recipe
from stabmon.runbook.fit import dropped_as_config
from stabmon.spec import MonitorSpec, spec_of

log = logging.getLogger(__name__)

__all__ = ["ActivationConfig", "EmbeddingConfig", "GradConfig", "Monitor", "MonitorConfig", "MonitorSpec"]


class Monitor:
    """Watch one model/optimizer pair in a plain training loop; see the module docstring.

    The keyword arguments are :class:`~stabmon.spec.MonitorSpec`'s fields (or pass a ready ``spec``).

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
        spec: MonitorSpec | None = None,
        *,
        scaler: Any = None,
        scheduler: Any = None,
        **options: Any,
    ) -> None:
        self.spec = spec = spec_of(spec, options)
        check_model_and_optimizer(model, optimizer)
        self.config = cfg = spec.config_in_force
        self.model, self.optimizer, self.scaler, self.scheduler = model, optimizer, scaler, scheduler
        self.run = run = RunState()
        self.failsafe = Failsafe(run)
        self.rank, self.world_size = world()
        self.signals = build_signals(model, optimizer, config=cfg, run=run, failsafe=self.failsafe,
                                     world_size=self.world_size, scaler=scaler)
        # a flush is a collective under torch.distributed: only one process may flush off the cadence
        self._alarm = (NonfiniteAlarm(rise=cfg.flush_on_rise) if cfg.flush_on_nonfinite and self.world_size == 1
                       else None)
        layout = self.signals.layout
        where = spec.checkpoints.directory if spec.checkpoints is not None else spec.checkpoint_dir
        self.policy = rank_policy(self.rank, self.world_size, sharded=layout.sharded,
                                  replicated=layout.kind == "ddp", directory=where)
        """Who saves, decides and writes (:mod:`stabmon.collect.cluster.rank_policy`)."""
        self.run_name = spec.run_name or time.strftime("run-%Y%m%d-%H%M%S")
        self.outbox = build_outbox(spec, rank=self.rank, failsafe=self.failsafe, run_name=self.run_name)
        self._start_run()
        checkpoints = build_checkpoints(spec, self.outbox)
        follower = RankFollower()
        self._state = build_monitor_state(run=run, signals=self.signals.states(), follower=follower,
                                          outbox=self.outbox, checkpoints=checkpoints, run_name=self.run_name)
        self._channel = RankChannel(rank=self.rank, world_size=self.world_size, timeout=cfg.diagnose.timeout)
        training = build_training_state(model, optimizer, scaler=scaler, scheduler=scheduler, monitor_state=self._state,
                                        counts_steps=spec.loop.counts_steps)
        engine, detectors = resolve_decisions(runbook=spec.runbook, detectors=spec.detectors, mode=spec.mode,
                                              overrides=spec.threshold_overrides)
        self.batches = batch_log_for(engine, spec.sample_ids, capacity=cfg.diagnose.batches,
                                     max_bytes=cfg.diagnose.max_bytes, checkpoints=checkpoints is not None)
        self.records: deque[StepRecord] = deque(maxlen=cfg.history)
        self._hooks = HookSwitch(self.signals.hooks)  # on or off as the loop wants them; a diagnosis keeps that
        self.snapshots = build_snapshots(cfg, checkpoints, sharded=layout.sharded)
        """The host-memory snapshots a rollback restores first (None: ``config.snapshots`` off)."""
        rollback_from: CheckpointStore | None = checkpoints
        if self.snapshots is not None and checkpoints is not None:
            rollback_from = TieredCheckpoints(checkpoints, self.snapshots)
        landing = RerunLanding(training, run)  # a diagnosis' re-run hands it over, the rollback after it lands there
        self._diagnoser = build_diagnoser(
            model=model, optimizer=optimizer, scaler=scaler, grads=self.signals.grads, hooks=self._hooks,
            batches=self.batches, records=self.records, checkpoints=rollback_from, check=training.mismatch,
            loss_fn=spec.loss_fn, own=self.signals.rank_values.own if self.signals.rank_values is not None else None,
            rank=self.rank, world_size=self.world_size, channel=self._channel, land=landing.offer)
        handed: deque[Event] = deque()  # a joint action's disagreements, for the flush's publish
        self.recovery = Recovery(run, state=training, outbox=self.outbox, failsafe=self.failsafe,
                                 stop_code=cfg.exit_code, checkpoints=rollback_from, policy=self.policy,
                                 channel=self._channel, reports=handed, landing=landing)
        hooks = self.signals.hooks
        self.handle = self.recovery.handle(hparams=hooks.hparams, diagnose=self._diagnoser,
                                           loss_first=lambda: hooks.loss_first)
        """What every intervention of the runbook acts on (:class:`~stabmon.interventions.handle.Handle`)."""
        self.pipeline = build_pipeline(self.handle, engine=engine, detectors=detectors, states=self._state,
                                       failsafe=self.failsafe, grace_steps=cfg.grace_steps)
        #: ln(output classes), recorded once with the first step observed (None: unknown, or recorded)
        self._untrained: float | None = untrained_loss(model)
        self.flusher = Flusher(self.pipeline, self.outbox, target=self.recovery, failsafe=self.failsafe,
                               mode=spec.mode, follower=follower, kill_switch=kill_switch(cfg.kill_switch),
                               policy=self.policy, handed=handed, channel=self._channel,
                               joiners={**self.recovery.joiners, Diagnose.name: self._diagnoser.join},
                               history=cfg.history)
        self._closed = False
        self._flushing = False
        self._initial_saved = False
        self._started = False
        self._watch_until = 0
        """Until this step the monitor flushes every ``config.watch.flush_every`` steps (:meth:`_watch`)."""
        self.activity = LoopActivity()  # pauses in progress, the loop's end: read by the hang watchdog
        self._watchdog = self._start_watchdog(spec.store) if cfg.hang_timeout is not None else None
        self._hooks.install()
        self._exit_guard = ExitGuard(self.close)  # Ctrl-C, SIGTERM or an exit without close(): run interrupted
        if spec.resume:
            self.load_state_dict(dict(spec.resume))
        self._warn_unfit()
        #: the loop has not yet said whether it hands batches over: the first step tells
        self._batches_unknown = spec.loop.batches is None and self.batches is not None

    def _start_run(self) -> None:
        """Open (or reopen) the run in the store; every rank takes rank 0's id. A resumed run must continue its
        own step count (:class:`~stabmon.collect.checkpoint.resume.ResumeCheck`). The run's config holds the rungs
        dropped from the runbook's ladders in this loop, so that its replay drops them too."""
        resume_run_id = self.spec.resume_run_id
        recipe = run_recipe(optimizer=type(self.optimizer).__name__, hparams=self.signals.hooks.hparams(),
                            runbook=self.spec.loaded_runbook, user=self.spec.recipe)
        self._unfit = self._unfit_rungs(batches=self.spec.loop.batches)
        self._run_config = {"monitor": self.config.to_dict(), "mode": self.mode, "recipe": recipe,
                            "world_size": self.world_size,
                            "ladder": self._ladder_config()}
        run_id = self.outbox.start_run(config=self._run_config, resume_run_id=resume_run_id)
        if self.world_size > 1:
            self.outbox.run_id = broadcast(run_id)
        last = self.outbox.last_step() if resume_run_id is not None else None
        self._resume = ResumeCheck(resume_run_id, last_step=broadcast(last) if self.world_size > 1 else last)

    def _warn_unfit(self) -> None:
        """Fit the runbook's ladders to this loop (the rungs that cannot act in it are dropped, one line per
        reason) and say which rungs would change nothing on this optimizer as it stands."""
        runbook = self.spec.loaded_runbook
        if runbook is None:
            return
        from stabmon.runbook.fit import fit_warnings

        self._drop_rungs(self._unfit, {})
        for line in fit_warnings(runbook, self.hparams()):
            log.warning("stabmon: runbook %s: %s", runbook.name, line)
        rolls_back = any(rung.action == "rollback" for rule in runbook.rules for rung in rule.ladder)
        if rolls_back and self.checkpoints is not None and not self.config.checkpoint_every \
                and not self.checkpoints.checkpoints:
            log.warning(
                "stabmon: config.checkpoint_every=0 and no checkpoint registered in %s: a rollback fails until "
                "you save one (monitor.save_checkpoint() or checkpoints.register)", self.checkpoints.directory
            )

    def _unfit_rungs(self, *, batches: bool | None) -> dict[tuple[str, int], str]:
        """The runbook's rungs that cannot act in this loop (:func:`~stabmon.runbook.fit.unfit_rungs`)."""
        runbook = self.spec.loaded_runbook
        if runbook is None:
            return {}
        from stabmon.collect.signals.updates import UpdateNorms
        from stabmon.runbook.fit import unfit_rungs

        c = self.config
        sampled = {name for name, section in (("moments", c.moments), ("attention", c.attention),
                                              ("logits", c.logits)) if section.every}
        if any(isinstance(signal, UpdateNorms) for _, signal in self.signals.hooks.signals):
            sampled.add("updates")  # on by default where it costs no copy (UpdateConfig.every)
        checkpoints = self.spec.checkpoint_dir is not None or self.spec.checkpoints is not None
        return unfit_rungs(runbook, checkpoints=checkpoints, facts=run_facts(Training(self.model, self.optimizer)),
                           sampled=sampled, batches=batches)

    def _drop_rungs(self, unfit: dict[tuple[str, int], str], before: dict[tuple[str, int], str]) -> None:
        """Drop ``unfit`` from the engine's ladders: never tried, escalated or paged at incident time; one line per
        reason (those not in ``before``, said already) names the rungs and why."""
        runbook, engine = self.spec.loaded_runbook, self.pipeline.engine
        if runbook is None or not isinstance(engine, LadderEngine):
            return
        engine.drop_rungs(unfit)
        by_reason: dict[str, list[str]] = {}
        for (rule, index), why in unfit.items():
            if (rule, index) not in before:
                by_reason.setdefault(why, []).append(f"rule {rule} rung {index + 1}")
        if self.rank == 0:
            for why, rungs in by_reason.items():
                log.warning("stabmon: runbook %s: %s dropped from the ladder: %s", runbook.name, ", ".join(rungs),
                            why)

    def _refit_without_batches(self) -> None:
        """The first step came without its batch: the rungs that replay batches cannot act; dropped now, and the
        run's config in the store says so (its replay drops them too)."""
        unfit = self._unfit_rungs(batches=False)
        if unfit == self._unfit:
            return
        before, self._unfit = self._unfit, unfit
        self._drop_rungs(unfit, before)
        self._run_config = {**self._run_config, "ladder": self._ladder_config()}
        if self.spec.resume_run_id is None:  # a resumed run keeps the config its first process stored
            self.outbox.update_config(self._run_config)

    def _ladder_config(self) -> dict[str, Any]:
        """The rungs dropped in this loop, as the run's config stores them (its replay drops them too)."""
        runbook = self.spec.loaded_runbook
        return dropped_as_config(runbook.name, self._unfit) if runbook is not None else {}

    # -- what the monitor is made of ---------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps completed (the index the next step will get)."""
        return self.run.step

    @property
    def mode(self) -> str | None:
        """``propose``, ``apply``, ``observe`` or None (the runbook's own)."""
        return self.spec.mode

    @property
    def errors(self) -> Counter[str]:
        """Failures caught so far, per category (``store``, ``alerts``, ``pipeline``, ``checkpoint``, ...)."""
        return self.failsafe.errors

    @property
    def executor(self) -> Any:
        """The pipeline's executor (None without a runbook engine)."""
        return self.pipeline.executor

    @property
    def overrides(self) -> Overrides:
        """LR / clip / beta2 / weight-decay / skip overrides in force (the run state's)."""
        return self.run.overrides

    @property
    def cursor(self) -> DataCursor:
        """The data position and the batches to skip (the run state's)."""
        return self.run.cursor

    @property
    def buffer(self) -> StepBuffer:
        """Device values waiting for the next flush."""
        return self.signals.buffer

    @property
    def checkpoints(self) -> CheckpointStore | None:
        """The :class:`~stabmon.checkpoints.CheckpointManager`, or None."""
        return self.recovery.checkpoints

    @property
    def should_stop(self) -> bool:
        """True once checkpoint-and-stop, the kill switch or rank 0 asked the run to stop."""
        return self.recovery.should_stop

    @property
    def stop_reason(self) -> str | None:
        return self.recovery.stop_reason

    @property
    def exit_code(self) -> int:
        """0, or after a requested stop its code: ``config.exit_code`` (:data:`stabmon.checkpoints.STOP_EXIT_CODE`)
        unless the stopping rung named another (``HARDWARE_EXIT_CODE`` after a hardware-suspect diagnosis)."""
        return self.recovery.exit_code

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
        """The anomalies, decisions, interventions and outcomes this process published, the newest
        ``config.history`` of them (the store holds every one)."""
        return list(self.flusher.events)

    @property
    def anomalies(self) -> list[Anomaly]:
        """The anomalies this process published, the newest ``config.history``."""
        return list(self.flusher.anomalies)

    def hparams(self) -> dict[str, float]:
        """lr, beta2, weight_decay and clip in force for the next step (overrides included)."""
        return self.signals.hooks.hparams()

    def rollback(
        self, *, onset_step: int, lookback: int, skip_batches: int, checkpoint_dir: str | None = None
    ) -> dict[str, Any]:
        """Restore this rank's last-known-good checkpoint and skip data
        (:meth:`~stabmon.collect.checkpoint.recovery.Recovery.rollback_here`; under torch.distributed every rank calls
        it itself)."""
        return self.recovery.commit_now(self.recovery.rollback_here(
            onset_step=onset_step, lookback=lookback, skip_batches=skip_batches, checkpoint_dir=checkpoint_dir
        ))

    def checkpoint_and_stop(self, *, reason: str, exit_code: int | None = None) -> dict[str, Any]:
        """Save a checkpoint and ask the loop to stop with ``exit_code`` (default ``config.exit_code``); under
        torch.distributed on this rank, saving as the rank policy says
        (:meth:`~stabmon.collect.checkpoint.recovery.Recovery.stop_here`)."""
        return self.recovery.commit_now(self.recovery.stop_here(reason=reason, exit_code=exit_code))

    def diagnose(self, **params: Any) -> Diagnosis:
        """Re-run and replay the incident's steps (see :mod:`stabmon.diagnose`); the verdict and its evidence.
        Under torch.distributed every rank must call it at the same point (a runbook's ``diagnose`` rung calls
        the other ranks in itself, :mod:`stabmon.diagnose.ranks`)."""
        return self._diagnoser.run(**params)

    def device_memory(self) -> DeviceMemory:
        """Bytes the monitor holds on the device right now, per signal (activation norms hold a few scalars
        of the sampled step only, already counted in ``pending`` once collected)."""
        return self.signals.device_memory()

    # -- for training frameworks -------------------------------------------------------------------------
    def remove_optimizer_hooks(self) -> None:
        """Take the optimizer step pre/post hooks off, for a framework that runs backward inside
        ``optimizer.step(closure)``; it then calls :meth:`before_optimizer_step` and
        :meth:`after_optimizer_step` itself. They stay off (a diagnosis does not put them back)."""
        self._hooks.remove()

    def before_optimizer_step(self) -> None:
        """The pre-step work (unscale, norms, skip guard, clip, overrides): after backward, before the update."""
        self.signals.hooks.before_step()

    def after_optimizer_step(self, *, skipped: bool = False) -> None:
        """The post-step work (scheduler-visible values back, the skip guard finished): after the update.
        ``skipped=True``: the optimizer did not step after all (a loss scaler's overflow). The step is then
        recorded with ``overflow = 1``, even when the scaler is not one the monitor was given (an engine's own
        loss scaling), so a non-finite grad norm on it reads as the routine skip it is; it may be called
        without :meth:`before_optimizer_step` when the skip came before the optimizer was reached."""
        self.signals.hooks.after_step(skipped=skipped)

    def sync_step(self, step: int) -> None:
        """Set the step counter to a framework's optimizer-step count (after a resume without saved monitor
        state, or when the framework restored another step). Call it between steps."""
        try:
            value = operator.index(step)
        except TypeError:
            raise ValueError(f"sync_step: step must be an integer >= 0, got {type(step).__name__}") from None
        if value < 0:
            raise ValueError(f"sync_step: step must be an integer >= 0, got {value}")
        self.run.step = value
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
        if self.should_stop or (max_steps is not None and self.run.step >= max_steps):
            return
        self.activity.ended = False
        try:
            yield from self._loop(loader, passes, max_steps)
        finally:
            self.activity.ended = True  # what follows the loop (a final evaluation, saving, close) is not a hang

    def _loop(self, loader: Iterable[Any], passes: int | None, max_steps: int | None) -> Iterator[tuple[int, Any]]:
        for index, batch in self.run.cursor.batches(loader, passes):
            self.begin_step(batch_index=index, batch=batch)
            try:
                yield self.run.step, batch
            except GeneratorExit:  # the loop was left (break) during this step
                if self.signals.recorder.trained:
                    self.end_step()
                else:  # left before training on the batch: no step happened
                    self.signals.recorder.discard()
                raise
            self.end_step()
            if self.should_stop or (max_steps is not None and self.run.step >= max_steps):
                return

    def begin_step(self, *, batch_index: int | None = None, batch: Any = None) -> None:
        """Open the record of the next step (done by :meth:`steps`; call it yourself in a hand-written
        loop, with the ``batch`` when a runbook diagnoses or ``sample_ids`` is given)."""
        if self.signals.buffer.open:
            self.end_step()
        if self.run.restored:  # a loaded state says where the loop is
            self._resume.settle()
        self._resume.first_step(self.run.step)  # a resumed run must not start over at step 0
        if not self._started:  # this process's first step: checkpoints after it are of a line it does not continue
            self._started = True
            self.recovery.starts_at(self.run.step)
            self._watch([])  # (an incident a resume brought back)
        if not (self._initial_saved or self.run.restored) and self.config.checkpoint_every:
            # the first step of a run not restored from a state (its first step may be 1, as in HF Trainer):
            # the initial state is known-good, so a rollback can always reach it
            self._initial_saved = True
            if self.checkpoints is not None:
                self._timed_save()
        self.signals.recorder.begin(step=self.run.step, batch_index=batch_index)
        if self.batches is not None:  # the RNG state the step starts with, and its batch when the loop has it
            self.batches.remember(step=self.run.step, batch_index=batch_index, batch=batch)

    def hand_batch(self, batch: Any) -> None:
        """This step's batch, handed over after :meth:`begin_step` (a framework that learns it in the forward):
        what a ``diagnose`` rung replays. Kept by reference, nothing copied (``MonitorConfig.diagnose`` bounds
        how many and how many bytes)."""
        if self.batches is not None and self.signals.buffer.open:
            self.batches.complete(step=self.run.step, batch=batch)

    def observe(self, loss: Any = None, *, tokens: int | None = None, **metrics: Any) -> None:
        """Record this step's loss (and any other named scalars) as device tensors: no host sync.
        ``tokens`` (a host int: tokens in this step's batch) adds ``tokens_per_sec`` at the end of the step."""
        if not self.signals.buffer.open:
            self.begin_step()
        if self._untrained is not None:  # a host float, once: what the no_progress detector calls untrained
            metrics = {**metrics, Metric.UNTRAINED_LOSS: self._untrained}
            self._untrained = None
        self.signals.recorder.observe((("loss", loss), *metrics.items()), tokens=tokens, step=self.run.step)
        if self._alarm is not None:
            self._alarm.watch(loss)

    def end_step(self) -> None:
        """Close the step's record; flush when ``config.flush_every`` steps are waiting."""
        self.signals.hooks.interrupts.release()  # a Ctrl-C or SIGTERM held since optimizer.step(): now
        if not self.signals.buffer.open:
            return
        if self._batches_unknown:
            self._batches_unknown = False
            if self.batches is not None and not self.batches.handed(self.run.step):
                self._refit_without_batches()  # no batch with the first step: a diagnosis could replay none
        self.signals.recorder.end()
        self.run.step += 1
        if self._watchdog is not None:
            self._watchdog.beat(self.run.step - 1)
        every = self.config.checkpoint_every
        waiting, watching = len(self.signals.buffer), self.run.step < self._watch_until  # (something is wrong)
        flush = waiting >= self.config.flush_every or (watching and waiting >= self.config.watch.flush_every)
        if self._alarm is not None and self._alarm.rang():
            flush = True  # a NaN or inf loss: the runbook answers now, not at the cadence
        completed = self.run.step
        if every and self.checkpoints is not None and self.run.step % every == 0:
            step = self.run.step
            if flush or (watching and waiting):  # the flush first (a watch window's off its cadence too), and the
                self.flush()  # checkpoint holds what it decided
            if self.run.step == step:  # (a rollback in that flush saved the state it restored already)
                self._timed_save()
        elif flush:
            self.flush()
        snapshots = self.snapshots
        if snapshots is not None and self.run.step == completed and snapshots.due(completed):
            with self.outside_steps("snapshot"):  # (a rollback in the flush above landed elsewhere: none now)
                self.failsafe.call("checkpoint", partial(snapshots.take, completed, self.recovery.state.state_dict))
        self.signals.recorder.restart_clock()  # flush and checkpoint time stay out of the next step's time

    # -- flush -------------------------------------------------------------------------------------------
    def flush(self) -> list[StepRecord]:
        """Copy waiting metrics to the host once, run them through the pipeline, hand events to the sinks."""
        # a failed read-back is logged and counted; every rank still reaches the flush's collective
        records: list[StepRecord] = self.failsafe.call("collect", self.signals.buffer.drain) or []
        for r in records:
            self.signals.hooks.learn_host(r.get(Metric.GRAD_NORM), bool(r.get(Metric.SKIPPED)))
        self.records.extend(records)
        self._flushing = True
        events: list[Event] = []
        try:
            events = self.flusher.flush(records, stored=self.signals.buffer.take_stored())
        except PeerLost:  # said once, in one line, where it happened: this rank goes on without the others
            pass
        finally:
            self._flushing = False
            if self.recovery.landing is not None:  # a re-run's landing lives for the flush that made it
                self.recovery.landing.drop()
        checkpoints = self.recovery.checkpoints
        if checkpoints is not None:  # the checkpoints saved while an incident is open keep its rollback's target
            checkpoints.hold_before = open_onset(self.pipeline.engine)
        self._watch(events)
        return records

    def _watch(self, events: list[Event]) -> None:
        """After a flush: trouble with the model in ``events``, or an incident open, brings the next flushes closer
        for ``config.watch.steps`` steps (:class:`~stabmon.collect.config.WatchConfig`)."""
        watch = self.config.watch
        if not watch.steps or self.world_size > 1:  # ranks must flush on the same steps: the cadence stays
            return
        if calls_for_closer_flushes(events, self.pipeline.engine):
            self._watch_until = self.run.step + watch.steps

    def _start_watchdog(self, store: Any) -> Any:
        """The hang watchdog (a thread): rank 0 publishes without waiting for a flush (never at the same time
        as one); another rank writes its own report into the run; ``config.hang.exit_code`` then ends the
        process."""
        outbox = self.outbox
        reporter = HangReporter(
            rank=self.rank,
            publish=self.flusher.publish_from_thread,
            settle=outbox.settle,
            open_store=lambda: resolve_store(store),
            run_id=lambda: outbox.run_id,
            run_name=self.run_name,
            exit_code=self.config.hang.exit_code,
            quiet=self.activity.quiet,
            last_words=partial(write_last_words, self.signals.buffer.drain, outbox, self.failsafe),
            alarm=self._hang_alarm(),
        )
        return start_watchdog(self.config, reporter, label=f"rank {self.rank}: " if self.world_size > 1 else "")

    def _hang_alarm(self) -> Any:
        """Under torch.distributed, the alarm that makes every rank report its stacks when one rank hangs."""
        if self.world_size <= 1:
            return None
        from stabmon.collect.cluster.hang_alarm import PeerAlarm

        return PeerAlarm.of_default_group(self.world_size)

    def heartbeat(self) -> None:
        """A sign of life between steps (inside a long evaluation): re-arms the hang watchdog without
        teaching it that steps are this slow."""
        if self._watchdog is not None:
            self._watchdog.beat(self.run.step - 1, learn=False)

    @contextmanager
    def paused(self, reason: str) -> Iterator[None]:
        """A stretch of the loop that is not a step and may take long (an evaluation, a checkpoint, reloading
        data): the hang watchdog does not fire inside it, and its time is not learned as a step.

        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> mon = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=None, detectors=False)
        >>> with mon.paused("eval"):
        ...     mon.activity.quiet()
        "paused for 'eval'"
        >>> mon.close()
        """
        self.activity.pauses.append(reason)
        try:
            yield
        finally:
            self.activity.pauses.remove(reason)
            self.heartbeat()

    @contextmanager
    def outside_steps(self, what: str) -> Iterator[None]:
        """Work outside the training steps that may take long, but not forever (a checkpoint save, an
        evaluation): the hang watchdog judges it by ``config.hang_timeout`` (the cap) instead of the deadline
        learned from the steps, and does not learn its time as a step. (:meth:`paused` declares a stretch the
        watchdog does not judge at all.) The monitor's own saves and the framework callbacks' evaluations and
        checkpoints use it.

        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> mon = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=None, detectors=False)
        >>> with mon.outside_steps("evaluation"):
        ...     mon._watchdog.deadline() == mon.config.hang_timeout
        True
        >>> mon.close()
        """
        watchdog = self._watchdog
        if watchdog is None:
            yield
            return
        watchdog.outside(what)
        try:
            yield
        finally:
            watchdog.inside(what)

    # -- state -------------------------------------------------------------------------------------------
    def _timed_save(self) -> None:
        """A checkpoint at the cadence, its seconds on the next step's record (the goodput ledger's). It holds
        every completed step (:meth:`_cover_pending`; every rank is here together, so under torch.distributed the
        waiting steps are flushed first)."""
        started = time.perf_counter()
        if self.world_size > 1 and len(self.signals.buffer):
            step = self.run.step
            self.flush()
            if self.run.step != step:  # a rollback in that flush saved the state it restored already
                return
        self._cover_pending()
        self.save_checkpoint()
        self.signals.recorder.note(Metric.CHECKPOINT_TIME, time.perf_counter() - started)

    def save_checkpoint(self) -> Any:
        """Save :meth:`training_state` through the checkpoint manager; failures are logged and counted. A save
        is work outside the steps (:meth:`outside_steps`): its time is not learned as a step, and the hang
        watchdog gives it ``config.hang_timeout``."""
        with self.outside_steps("checkpoint"):
            return self.recovery.save_checkpoint()

    def training_state(self) -> dict[str, Any]:
        """Everything a checkpoint holds: model, optimizer, scaler, scheduler and the monitor's own state."""
        return self.recovery.state.state_dict()

    def load_training_state(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`training_state` (all or nothing; ``ValueError`` when it does not fit)."""
        self.recovery.state.load(state)

    def state_dict(self) -> dict[str, Any]:
        """Step counter, data position, overrides, detector/engine/executor state, guard and embedding
        baselines, the alert gates' memory (:mod:`stabmon.collect.checkpoint.monitor_state` lists every entry), and the
        completed steps not flushed yet (read to the host now; a resumed run flushes them first), so a resume
        from it loses no step."""
        self._cover_pending()
        return self._state.state_dict()

    def _cover_pending(self) -> None:
        """Before the monitor's state is written between flushes: the steps waiting for the flush go with it. In
        one process they are read to the host and stay pending (the flush cadence, and so every decision's
        timing, is unchanged); under torch.distributed that read is a collective, so where every rank writes
        together (the cadence's checkpoint) they are flushed, and elsewhere (a user's save on one rank) they
        stay on the device and the next flush has them."""
        if self._flushing or not len(self.signals.buffer):
            return
        if self.world_size == 1:
            self.failsafe.call("collect", self.signals.buffer.settle)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (a resume: every entry). Its completed steps not flushed when it was
        written are flushed by this run, unless the store holds them already."""
        self._state.load_state_dict(state)
        self.signals.buffer.mark_stored(self._resume.last_step)

    # -- lifecycle ---------------------------------------------------------------------------------------
    def close(self, status: str | None = None) -> None:
        """Flush what is left, end the run in the store, remove the hooks. Idempotent."""
        if self._closed:
            return
        closing = InterruptHold(at_most_s=None)  # a Ctrl-C or SIGTERM now (a job's other ranks are stopped so)
        closing.hold()  # waits until the run is closed: its rows drained, its checkpoint whole
        held = self.signals.hooks.interrupts.release(deliver=False)  # one held since optimizer.step(), too
        try:
            self._close(status)
        finally:
            held += closing.release(deliver=False)
            self._exit_guard.release()
            deliver_held(held)

    def _close(self, status: str | None) -> None:
        self._exit_guard.disarm()
        hooks = self.signals.hooks
        cut = hooks.cut  # interrupted inside optimizer.step(): the update may be half-applied
        if status == INTERRUPTED and self.signals.buffer.open and not hooks.stepped:
            self.signals.recorder.discard()  # interrupted before its update: the step did not happen
        self.end_step()
        self.flush()
        if status == INTERRUPTED and self.recovery.saves(SavePath.INTERRUPT) and self.run.step > 0:
            if cut:
                log.warning("stabmon: interrupted inside optimizer.step() of step %d: no interrupt checkpoint "
                            "(its update may be half-applied); a resume starts from the last checkpoint",
                            self.run.step - 1)
            else:
                self.save_checkpoint()  # a resume from here repeats no step
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.stop()
        self.signals.remove()
        self.outbox.close(status or ("stopped" if self.should_stop else "finished"))

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
            self.close(status=INTERRUPTED)
        else:
            self.close(status="failed" if exc_type is not None else None)

