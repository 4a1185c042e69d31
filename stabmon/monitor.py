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
and the notifier. Decisions are applied at flushes through :class:`~stabmon.interventions.LiveExecutor`, whose
target is the monitor itself (:class:`~stabmon.pipeline.InterventionTarget`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from stabmon.collect.activations import ActivationNorms
from stabmon.collect.batches import batch_log_for
from stabmon.collect.buffer import StepBuffer
from stabmon.collect.config import ActivationConfig, EmbeddingConfig, GradConfig, MonitorConfig
from stabmon.collect.data import DataCursor
from stabmon.collect.distributed import RankFollower, broadcast, executed_decisions, mean_across_ranks, world
from stabmon.collect.embeddings import EmbeddingDrift
from stabmon.collect.flushing import decide, publish, share, start_run
from stabmon.collect.grads import GradNorms
from stabmon.collect.memory import DeviceMemory
from stabmon.collect.observe import value_problem
from stabmon.collect.optim import OptimizerHooks
from stabmon.collect.ranks import RankGather, RankProbe
from stabmon.collect.sharding import ShardedSquares, embedding_counted, layout_of
from stabmon.collect.updates import UpdateNorms
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
from stabmon.store.limits import check_name, name_problem

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
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        sample_ids: Callable[[Any], Any] | None = None,
    ) -> None:
        self.config = config if config is not None else MonitorConfig()
        if not isinstance(self.config, MonitorConfig):
            raise ValueError(f"config: expected a MonitorConfig, got {type(self.config).__name__}")
        self.config.validate()
        check_model_and_optimizer(model, optimizer)
        if run_name is not None:
            check_name("run_name", run_name)
        if mode not in MODES:
            raise ValueError(f"mode: must be one of {', '.join(map(str, MODES))}, got {mode!r}")
        self.model, self.optimizer, self.scaler, self.scheduler, self.mode = (
            model,
            optimizer,
            scaler,
            scheduler,
            mode,
        )
        self.overrides = Overrides()
        self.cursor = DataCursor()
        self.buffer = StepBuffer()
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
            overrides=lambda: self.overrides,
            clip=cfg.clip,
            scaler=scaler,
            embeddings=self._emb,
            ema_decay=cfg.grads.skip_ema,
            updates=UpdateNorms(self._grads) if cfg.updates.every else None,
        )
        self.errors: Counter[str] = Counter()
        self.rank, self.world_size = world()
        self._probe: RankProbe | None = None
        if self.world_size > 1:
            self.buffer.reduce = mean_across_ranks
            replicated = self.layout.kind == "ddp"
            self.buffer.gather = RankGather(replicated=replicated)
            self._probe = RankProbe(model, self._grads.params, replicated=replicated)
        self._follower = RankFollower()
        leader = self.rank == 0  # only rank 0 writes to the store and sends alerts
        self.store, self._owns_store = resolve_store(store if leader else None)
        self.notifier, self._owns_notifier = (
            resolve_notifier(notifier, alerts, self.store) if leader else (None, False)
        )
        self.pipeline, self.executor = build_pipeline(self, detectors=detectors, runbook=runbook, mode=mode)
        self.batches = batch_log_for(self.pipeline.engine, sample_ids, capacity=cfg.diagnose.batches)
        self._loss_fn = loss_fn  # diagnose's loss of a batch (None: stabmon.collect.rerun.call_model)
        self.run_name = run_name or time.strftime("run-%Y%m%d-%H%M%S")
        self.run_id = start_run(self, resume_run_id)
        if self.world_size > 1:
            self.run_id = broadcast(self.run_id)
        self.checkpoints = checkpoints
        if self.checkpoints is None and checkpoint_dir is not None:
            from stabmon.checkpoints import CheckpointManager

            self.checkpoints = CheckpointManager(
                checkpoint_dir, keep=cfg.checkpoint_keep, sink=self.store, run_id=self.run_id
            )
        self.kill_switch = None
        if cfg.kill_switch:
            from stabmon.checkpoints import KillSwitch

            self.kill_switch = KillSwitch(cfg.kill_switch, every=1)
        self.anomalies: list[Anomaly] = []
        self.events: list[Event] = []
        self.records: deque[StepRecord] = deque(maxlen=cfg.history)
        self._step = 0
        self.should_stop = False
        self.stop_reason: str | None = None
        self._stop_code = self.config.exit_code
        self._scale_snapshot: torch.Tensor | None = None
        self._hp_snapshot: dict[str, float] | None = None
        self._tokens: int | None = None
        self._t_last: float | None = None
        self._closed = False
        self._initial_saved = False
        self._watchdog = self._start_watchdog(store) if cfg.hang_timeout is not None else None
        self._hooks.install()

    # -- InterventionTarget ------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps completed (the index the next step will get)."""
        return self._step

    def hparams(self) -> dict[str, float]:
        """lr, beta2, weight_decay and clip in force for the next step (overrides included)."""
        return self._hooks.hparams()

    def device_memory(self) -> DeviceMemory:
        """Bytes the monitor holds on the device right now, per signal (activation norms hold a few scalars
        of the sampled step only, already counted in ``pending`` once collected)."""
        return DeviceMemory(
            embeddings=self._emb.device_bytes() if self._emb else 0,
            skip_guard=self._hooks.guard.nbytes(),
            pending=self.buffer.nbytes(),
        )

    def rollback(
        self, *, onset_step: int, lookback: int, skip_batches: int, checkpoint_dir: str | None = None
    ) -> dict[str, Any]:
        from stabmon.collect.restore import rollback

        return rollback(
            self,
            onset_step=onset_step,
            lookback=lookback,
            skip_batches=skip_batches,
            checkpoint_dir=checkpoint_dir,
        )

    def diagnose(self, **params: Any) -> dict[str, Any]:
        """Re-run and replay the incident's steps (see :mod:`stabmon.collect.rerun`); the verdict and its
        evidence."""
        from stabmon.collect.rerun import diagnose

        return diagnose(self, self._grads, self._hooks, loss_fn=self._loss_fn, **params)

    def checkpoint_and_stop(self, *, reason: str, exit_code: int | None = None) -> dict[str, Any]:
        info = self.save_checkpoint() if self.checkpoints is not None else None
        self.should_stop, self.stop_reason = True, reason
        self._stop_code = exit_code if exit_code is not None else self.config.exit_code
        log.warning("stabmon: stopping the run at step %d: %s", self._step, reason)
        return {
            "path": getattr(info, "path", None),
            "step": self._step,
            "exit_code": self._stop_code,
            "reason": reason,
        }

    @property
    def exit_code(self) -> int:
        """0, or ``config.exit_code`` (:data:`stabmon.checkpoints.STOP_EXIT_CODE`) after a requested stop."""
        return self._stop_code if self.should_stop else 0

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
        for index, batch in self.cursor.batches(loader, passes):
            self.begin_step(batch_index=index, batch=batch)
            try:
                yield self._step, batch
            except GeneratorExit:  # the loop was left (break) during this step
                if self._hooks.stepped or self.buffer.pending_values:
                    self.end_step()
                else:  # left before training on the batch: no step happened
                    self.buffer.discard()
                    if self._acts is not None:
                        self._acts.disarm()
                raise
            self.end_step()
            if self.should_stop or (max_steps is not None and self._step >= max_steps):
                return

    def begin_step(self, *, batch_index: int | None = None, batch: Any = None) -> None:
        """Open the record of the next step (done by :meth:`steps`; call it yourself in a hand-written
        loop, with the ``batch`` when a runbook diagnoses or ``sample_ids`` is given)."""
        if self.buffer.open:
            self.end_step()
        if self._step == 0 and not self._initial_saved and self.config.checkpoint_every:
            self._initial_saved = True  # the initial state is known-good: a rollback can always reach it
            if self.checkpoints is not None:
                self.save_checkpoint()
        if self._t_last is None:
            self._t_last = time.perf_counter()
        self.buffer.begin(step=self._step, batch_index=batch_index)
        if self.batches is not None and batch is not None:
            self.batches.remember(step=self._step, batch_index=batch_index, batch=batch)
        self._hooks.stepped = False
        self._scale_snapshot = None
        self._hp_snapshot = None
        self._tokens = None
        act_k, emb_k = self.config.activations.every, self.config.embeddings.every
        if self._acts is not None and self._step % act_k == 0:
            self._acts.arm()
        self._hooks.sample_embeddings = bool(self._emb) and emb_k > 0 and self._step % emb_k == 0
        upd_k = self.config.updates.every
        self._hooks.sample_updates = upd_k > 0 and self._step % upd_k == 0

    def observe(self, loss: Any = None, *, tokens: int | None = None, **metrics: Any) -> None:
        """Record this step's loss (and any other named scalars) as device tensors: no host sync.
        ``tokens`` (a host int: tokens in this step's batch) adds ``tokens_per_sec`` at the end of the step."""
        if not self.buffer.open:
            self.begin_step()
        if tokens is not None:
            self._tokens = int(tokens)
        for name, value in (("loss", loss), *metrics.items()):
            if value is not None:
                self._observe_one(name, value)
        self._collect_activations()
        scaler = self.scaler
        if scaler is not None and scaler.is_enabled():
            # an overflow step never reaches the pre-hook: keep the values in force before scheduler.step()
            self._hp_snapshot = self._hooks.hparams()
            if getattr(scaler, "_scale", None) is not None:
                self._scale_snapshot = scaler._scale.detach().clone()

    def _observe_one(self, name: str, value: Any) -> None:
        """Queue one observed value. A value that cannot be a metric (meta tensor, complex, a name the store
        cannot hold) is dropped alone, logged once per name and counted in ``errors``; never raised."""
        problem = name_problem("observe: metric name", name) or value_problem(name, value)
        if problem is None and isinstance(value, torch.Tensor):
            self.buffer.add([name], value.detach())
        elif problem is None:
            self.buffer.add_host(name, float(value.item() if hasattr(value, "item") else value))
        else:
            self.errors["observe"] += 1
            if self.errors[f"observe:{name[:64]}"] == 0:
                log.error("stabmon: %s (dropped at step %d; counted in monitor.errors)", problem, self._step)
            self.errors[f"observe:{name[:64]}"] += 1

    def end_step(self) -> None:
        """Close the step's record; flush when ``config.flush_every`` steps are waiting."""
        if not self.buffer.open:
            return
        self._collect_activations()
        self._record_scaler()
        hp = self._hooks.last_hparams if self._hooks.stepped else (self._hp_snapshot or self._hooks.hparams())
        for name, value in hp.items():
            self.buffer.add_host(name, value)
        if self._probe is not None:
            local_norm = self._grads.last_local_total if self._hooks.stepped else None
            before_flush = len(self.buffer) + 1 >= self.config.flush_every
            self._probe.record(self.buffer, started=self._t_last, local_norm=local_norm, before_flush=before_flush)
        now = time.perf_counter()
        elapsed = now - (self._t_last or now)
        self.buffer.add_host(Metric.STEP_TIME, elapsed)
        if self._tokens is not None and elapsed > 0:
            self.buffer.add_host(Metric.TOKENS_PER_SEC, self._tokens / elapsed)
        self.buffer.end(time=time.time())
        self._step += 1
        if self._watchdog is not None:
            self._watchdog.beat(self._step - 1)
        every = self.config.checkpoint_every
        if every and self.checkpoints is not None and self._step % every == 0:
            self.save_checkpoint()
        if len(self.buffer) >= self.config.flush_every:
            self.flush()
        self._t_last = time.perf_counter()  # flush and checkpoint time stay out of the next step's time

    def _collect_activations(self) -> None:
        if self._acts is not None and self._acts.armed:
            names, values = self._acts.collect()
            if values is not None:
                self.buffer.add([Metric.ACT_RMS_PREFIX + n for n in names], values)

    def _record_scaler(self) -> None:
        scaler = self.scaler
        if scaler is None or not scaler.is_enabled():
            return
        # scaler.step() skips a non-fused optimizer.step() (and so our pre-hook) when it found inf/NaN
        # gradients; a fused optimizer steps anyway and its kernel skips on the scaler's found_inf
        found_inf = self._hooks.found_inf if self._hooks.stepped else None
        if found_inf is not None:
            self.buffer.add([Metric.OVERFLOW], found_inf)
        else:
            self.buffer.add_host(Metric.OVERFLOW, 0.0 if self._hooks.stepped else 1.0)
        scale = self._scale_snapshot
        if scale is None and getattr(scaler, "_scale", None) is not None:
            scale = scaler._scale.detach().clone()
        if scale is not None:
            self.buffer.add([Metric.LOSS_SCALE], scale)

    # -- flush -------------------------------------------------------------------------------------------
    def flush(self) -> list[StepRecord]:
        """Copy waiting metrics to the host once, run them through the pipeline, hand events to the sinks."""
        records: list[StepRecord] = []
        try:
            records = self.buffer.drain()
        except Exception:  # noqa: BLE001 - never raise into training (and every rank still reaches _share)
            self.errors["collect"] += 1
            log.exception("stabmon: could not read back this flush's metrics")
        for r in records:
            self._hooks.learn_host(r.get(Metric.GRAD_NORM), bool(r.get(Metric.SKIPPED)))
        self.records.extend(records)
        store = self.store
        if records and store is not None:
            self._guard("store", lambda: store.write_steps(run_id=self.run_id, records=records))
        events = decide(self, records) if self.rank == 0 else []
        if self.world_size > 1:
            share(self, executed_decisions(events) if self.rank == 0 else None)
        return records

    def _start_watchdog(self, store: Any) -> Any:
        """The hang watchdog (a thread): rank 0 publishes at once instead of waiting for a flush; another rank
        writes its own report into the run; ``config.hang.exit_code`` then ends the process."""
        from stabmon.collect.hangs import HangReporter, start_watchdog

        reporter = HangReporter(
            rank=self.rank,
            publish=lambda anomalies: publish(self, list[Event](anomalies)),
            settle=self._settle,
            open_store=lambda: resolve_store(store),
            run_id=lambda: self.run_id,
            run_name=self.run_name,
            exit_code=self.config.hang.exit_code,
        )
        return start_watchdog(self.config, reporter, label=f"rank {self.rank}: " if self.world_size > 1 else "")

    def _settle(self) -> None:
        """Before a hang exit: what was published reaches the database and the alert channels (bounded)."""
        store, notifier = self.store, self.notifier
        if store is not None:
            self._guard("store", lambda: store.flush(timeout=30.0))
        if notifier is not None:
            self._guard("alerts", lambda: notifier.close(timeout=10.0))

    def heartbeat(self) -> None:
        """A sign of life between steps (inside a long evaluation): re-arms the hang watchdog without
        teaching it that steps are this slow."""
        if self._watchdog is not None:
            self._watchdog.beat(self._step - 1, learn=False)

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run training-path I/O: catch, log, count; never raise into training."""
        if what == "store" and self.store is None:
            return None
        try:
            return fn()
        except Exception:  # noqa: BLE001
            self.errors[what] += 1
            log.exception("stabmon: %s failed at step %d (continuing)", what, self._step)
            return None

    # -- state -------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Any:
        """Save :meth:`training_state` through the checkpoint manager; failures are logged and counted."""
        if self.checkpoints is None:
            raise ValueError("checkpoint_dir: the monitor has no checkpoint manager (pass checkpoint_dir=...)")
        return self._guard("checkpoint", lambda: self.checkpoints.save(self.training_state(), step=self._step))

    def training_state(self) -> dict[str, Any]:
        """Everything a checkpoint holds: model, optimizer, scaler, scheduler and the monitor's own state."""
        from stabmon.collect.restore import training_state

        return training_state(self)

    def load_training_state(self, state: dict[str, Any]) -> None:
        from stabmon.collect.restore import load_training_state

        load_training_state(self, state)

    def state_dict(self) -> dict[str, Any]:
        """Step counter, data position, overrides, detector/engine/executor state, guard and embedding
        baselines."""
        return {
            "version": 1,
            "step": self._step,
            "data": self.cursor.state_dict(),
            "overrides": self.overrides.state_dict(),
            "pipeline": self._guard("pipeline", self.pipeline.state_dict),
            "executor": self.executor.state_dict() if hasattr(self.executor, "state_dict") else None,
            "follower": self._follower.state_dict(),
            "hooks": self._hooks.state_dict(),
            "embeddings": self._emb.state_dict() if self._emb else None,
            "notifier": self._notifier_state(),
            "run_id": self.run_id,
            "run_name": self.run_name,
        }

    def _notifier_state(self) -> dict[str, Any] | None:
        """Which channels were told about which incident, so a resumed run does not page again."""
        state_dict = getattr(self.notifier, "state_dict", None)
        return None if state_dict is None else self._guard("notifier", state_dict)

    def load_state_dict(self, state: dict[str, Any], *, pipeline: bool = True) -> None:
        self._step = int(state["step"])
        self.cursor.load_state_dict(state["data"])
        self.overrides.load_state_dict(state["overrides"])
        self._hooks.load_state_dict(state.get("hooks", {}))
        if self._emb and state.get("embeddings"):
            self._emb.load_state_dict(state["embeddings"])
        if pipeline and state.get("pipeline") is not None:
            self.pipeline.load_state_dict(state["pipeline"])
            reseed = getattr(self.pipeline.engine, "reseed", None)
            if reseed is not None:  # another run may continue from this same state: never share an id
                reseed()
            self._guard("pipeline", lambda: self.pipeline.detectors.enter_grace(self.config.grace_steps))
        if pipeline and state.get("executor") is not None and hasattr(self.executor, "load_state_dict"):
            self.executor.load_state_dict(state["executor"])
        if pipeline and state.get("follower") is not None:
            self._follower.load_state_dict(state["follower"])
        load_notifier = getattr(self.notifier, "load_state_dict", None)
        if state.get("notifier") is not None and load_notifier is not None:
            self._guard("notifier", lambda: load_notifier(state["notifier"]))

    # -- lifecycle ---------------------------------------------------------------------------------------
    def close(self, status: str | None = None) -> None:
        """Flush what is left, end the run in the store, remove the hooks. Idempotent."""
        if self._closed:
            return
        self.end_step()
        self.flush()
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.stop()
        self._hooks.remove()
        if self._probe is not None:
            self._probe.remove()
        if self._acts is not None:
            self._acts.disarm()
        status = status or ("stopped" if self.should_stop else "finished")
        store, notifier = self.store, self.notifier
        if store is not None:
            self._guard("store", lambda: store.end_run(run_id=self.run_id, status=status))
            if self._owns_store:  # close() drains within the store's close_timeout and spools the rest
                self._guard("store", store.close)
        if notifier is not None and self._owns_notifier:
            self._guard("alerts", lambda: notifier.close(timeout=10.0))

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(status="failed" if exc_type is not None else None)
