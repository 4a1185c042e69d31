"""The monitor's collaborators, each built from its explicit dependencies (torchtitan's ``config.X.build(deps)``).

The :class:`~stabmon.monitor.Monitor` is a sequence of these calls plus the user's API: :func:`build_signals`
(what measures a step), :func:`build_outbox` (the store and the notifier), :func:`build_checkpoints`,
:func:`build_training_state`, :func:`build_pipeline`. None of
them receives the monitor: a collaborator gets the :class:`~stabmon.collect.run_state.RunState` where it needs
the step, the data position or the overrides.

A new collector measured around the optimizer's update (an :class:`~stabmon.collect.step.optim.UpdateSignal`: a
second-moment ratio, an update norm) is one line in :func:`build_signals`'s ``update_signals``: its sampling
period (from its own section of :class:`~stabmon.collect.config.MonitorConfig`) and the collector, built from
the model and the optimizer. If it keeps state, one line adds it to :meth:`Signals.states` (the checkpoint then
carries it). A collector on the forward pass (activation norms; a
:class:`~stabmon.collect.signals.record.ForwardSignal`:
attention logits, output-logit scale) is armed by the step recorder on the steps its period divides.

The signals with lead (second-moment ratio, attention logits, output-logit scale) are off by default
(``every=0``). Turned on, each is checked at start: an optimizer without ``exp_avg_sq``, a model with no
recognised attention module or no output layer over a vocabulary gets one warning line naming the config
section ("not applicable") and that signal stays off; a module name in the config that matches nothing is a
``ValueError`` naming the dotted path.

>>> import torch
>>> from stabmon.collect.config import MonitorConfig
>>> from stabmon.collect.failsafe import Failsafe
>>> from stabmon.collect.run_state import RunState
>>> model = torch.nn.Linear(4, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> run = RunState()
>>> signals = build_signals(model, opt, config=MonitorConfig(), run=run, failsafe=Failsafe(run), world_size=1)
>>> sorted(signals.states()), signals.hooks.overrides is run.overrides
(['embeddings', 'hooks', 'pending'], True)
>>> signals.moments is None, signals.attention is None, signals.logits is None
(True, True, True)
>>> from stabmon.collect.config import LogitConfig, MomentConfig
>>> model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5))
>>> on = MonitorConfig(moments=MomentConfig(every=10), logits=LogitConfig(every=10))
>>> signals = build_signals(model, torch.optim.AdamW(model.parameters()), config=on, run=run,
...                         failsafe=Failsafe(run), world_size=1)
>>> signals.moments is not None, signals.attention is None, signals.logits.name
(True, True, '1')
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stabmon.alerts.notifier import resolve_notifier
from stabmon.checkpoints import CheckpointStore
from stabmon.collect.checkpoint.monitor_state import REQUIRED, add_pipeline_state, excluded
from stabmon.collect.checkpoint.restore import NamedStates, Stateful, TrainingState
from stabmon.collect.checkpoint.snapshots import HostSnapshots
from stabmon.collect.cluster.distributed import max_over_ranks, reduce_across_ranks
from stabmon.collect.cluster.ranks import RankGather, RankProbe
from stabmon.collect.cluster.sharding import Layout, ShardedSquares, embedding_counted, layout_of
from stabmon.collect.config import MonitorConfig
from stabmon.collect.failsafe import Failsafe
from stabmon.collect.flushing import Outbox
from stabmon.collect.run_state import RunState
from stabmon.collect.signals.activations import ActivationNorms
from stabmon.collect.signals.attention import AttentionLogits
from stabmon.collect.signals.buffer import StepBuffer
from stabmon.collect.signals.embeddings import EmbeddingDrift
from stabmon.collect.signals.grads import GradNorms
from stabmon.collect.signals.logits import OutputLogits
from stabmon.collect.signals.memory import DeviceMemory
from stabmon.collect.signals.moment_ratio import MomentRatios, not_applicable
from stabmon.collect.signals.record import ForwardSignal, StepRecorder
from stabmon.collect.signals.updates import AdamUpdateNorms, UpdateNorms
from stabmon.collect.step.optim import OptimizerHooks
from stabmon.collect.step.qk import StandingQkClip
from stabmon.collect.wiring import resolve_store
from stabmon.factory import pipeline_of
from stabmon.interventions.handle import Handle
from stabmon.pipeline import DetectorSuiteLike, EngineLike, Pipeline
from stabmon.spec import MonitorSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Signals:
    """What measures a step: the buffer, the optimizer hooks, the recorder and the collectors they sample."""

    layout: Layout
    buffer: StepBuffer
    grads: GradNorms
    hooks: OptimizerHooks
    recorder: StepRecorder
    activations: ActivationNorms | None
    embeddings: EmbeddingDrift | None
    probe: RankProbe | None
    """Under torch.distributed: per-rank probes (:class:`~stabmon.collect.cluster.ranks.RankProbe`)."""
    rank_values: RankGather | None
    """Under torch.distributed: per-rank values gathered at each flush."""
    moments: MomentRatios | None = None
    """The second-moment ratio (``config.moments``; None: off or not applicable)."""
    attention: AttentionLogits | None = None
    """The max attention logit per layer and head (``config.attention``; None: off or not applicable)."""
    logits: OutputLogits | None = None
    """The output-logit scale (``config.logits``; None: off or not applicable)."""

    def states(self) -> dict[str, Stateful | None]:
        """The collectors' entries in a checkpoint (an absent collector saves None); ``pending``: the steps a
        checkpoint written between flushes holds that were not flushed yet (:meth:`StepBuffer.settle`)."""
        return {"hooks": self.hooks, "embeddings": self.embeddings, "pending": self.buffer}

    def device_memory(self) -> DeviceMemory:
        """Bytes held on the device right now, per signal."""
        return DeviceMemory(
            embeddings=self.embeddings.device_bytes() if self.embeddings else 0,
            skip_guard=self.hooks.guard.nbytes(),
            pending=self.buffer.nbytes(),
        )

    def remove(self) -> None:
        """Every hook off the optimizer and the model."""
        self.hooks.remove()
        if self.probe is not None:
            self.probe.remove()
        if self.activations is not None:
            self.activations.disarm()
        for _, signal in self.recorder.forward:
            signal.disarm()
        standing = self.recorder.standing_qk
        if standing is not None and standing.built:
            standing.attention.disarm()


def build_signals(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    config: MonitorConfig,
    run: RunState,
    failsafe: Failsafe,
    world_size: int,
    scaler: Any = None,
) -> Signals:
    """The collectors on ``model`` and ``optimizer`` that ``config`` asks for (the hooks are not installed)."""
    layout = layout_of(model)
    grads = GradNorms(model, config.grads.layers, sharded=ShardedSquares(layout.counted) if layout.sharded else None)
    activations = ActivationNorms(model, config.activations.modules) if config.activations.every else None
    embeddings = (
        EmbeddingDrift(model, rows=config.embeddings.rows, reference=config.embeddings.reference,
                       counted=embedding_counted(model, layout))
        if config.embeddings.every
        else None
    )
    probe, rank_values, buffer = None, None, StepBuffer()
    if world_size > 1:
        replicated = layout.kind == "ddp"
        rank_values = RankGather(replicated=replicated, keep=config.diagnose.batches)
        buffer = StepBuffer(reduce=reduce_across_ranks, maxed=max_over_ranks, gather=rank_values)
        probe = RankProbe(model, grads.params, replicated=replicated)
    moments = _moment_ratios(model, optimizer, config, grads.sharded)
    update_signals = (  # (sampling period, collector): a new update signal is one line here
        (config.embeddings.every, embeddings),
        _update_norms(optimizer, grads, config, layout=layout.kind),
        (config.moments.every, moments),
    )
    attention, logits = _attention(model, config), _logits(model, config)
    forward_signals: tuple[tuple[int, ForwardSignal | None], ...] = (  # the same for a forward signal
        (config.attention.every, attention),
        (config.logits.every, logits),
    )
    hooks = OptimizerHooks(
        optimizer,
        grads,
        buffer=buffer,
        overrides=run.overrides,
        clip=config.clip,
        scaler=scaler,
        ema_decay=config.grads.skip_ema,
        signals=[(every, signal) for every, signal in update_signals if signal is not None],
    )
    recorder = StepRecorder(buffer, hooks, config=config, failsafe=failsafe, scaler=scaler,
                            activations=activations, probe=probe,
                            forward=[(every, signal) for every, signal in forward_signals if signal is not None],
                            standing_qk=_standing_qk(model, attention, config))
    return Signals(layout, buffer, grads, hooks, recorder, activations, embeddings, probe, rank_values,
                   moments=moments, attention=attention, logits=logits)


def _update_norms(optimizer: torch.optim.Optimizer, grads: GradNorms, config: MonitorConfig, *,
                  layout: str) -> tuple[int, UpdateNorms | None]:
    """(period, collector) of ``config.updates``: recomputed from Adam/AdamW's state where it can be (no copy,
    and on by default there: one process, DDP, FSDP2's DTensor shards), else from a copy of the parameters (only
    when asked for; FSDP1's flat parameters too)."""
    from stabmon.collect.config import UPDATE_EVERY
    from stabmon.collect.step.inplace import adam_like

    cheap = layout != "fsdp1" and adam_like(optimizer) is None
    every = config.updates.every
    if every is None:
        every = UPDATE_EVERY if cheap else 0
    if not every:
        return 0, None
    return every, AdamUpdateNorms(grads, optimizer) if cheap else UpdateNorms(grads)


def _moment_ratios(model: nn.Module, optimizer: torch.optim.Optimizer, config: MonitorConfig,
                   sharded: ShardedSquares | None) -> MomentRatios | None:
    """``config.moments``' collector, or None when off or the optimizer keeps no second moment (logged)."""
    if not config.moments.every:
        return None
    problem = not_applicable(optimizer)
    if problem is not None:
        log.warning("stabmon: %s", problem)
        return None
    return MomentRatios(optimizer, list(model.named_parameters()), per_tensor=config.moments.per_tensor,
                        sharded=sharded)


def _attention(model: nn.Module, config: MonitorConfig) -> AttentionLogits | None:
    """``config.attention``'s collector, or None when off or the model has no recognised attention (logged)."""
    a = config.attention
    if not a.every:
        return None
    attention = AttentionLogits(model, a.modules, sub_batch=a.sub_batch, heads=a.heads)
    if attention.names:
        return attention
    if a.modules is not None:
        raise ValueError(f"config.attention.modules: no recognised attention module matches {a.modules}")
    log.warning("stabmon: config.attention: the model has no recognised attention module (not applicable; see "
                "stabmon.collect.signals.attention.register_attention): attention logits are off")
    return None


def _standing_qk(model: nn.Module, attention: AttentionLogits | None, config: MonitorConfig) -> StandingQkClip:
    """The standing QK-clip ``qk_clip`` turns on: on the sampled collector where attention logits are recorded,
    else on a collector of its own, made when the clip is first turned on and armed only while it is on."""
    if attention is not None:
        return StandingQkClip(attention)
    a = config.attention
    return StandingQkClip(lambda: AttentionLogits(model, a.modules, sub_batch=a.sub_batch, heads=a.heads))


def _logits(model: nn.Module, config: MonitorConfig) -> OutputLogits | None:
    """``config.logits``' collector, or None when off or the model has no output layer over a vocabulary
    (logged); a named module that does not exist raises."""
    o = config.logits
    if not o.every:
        return None
    if o.module is not None:
        return OutputLogits(model, o.module, sub_batch=o.sub_batch)
    try:
        return OutputLogits(model, sub_batch=o.sub_batch)
    except ValueError as exc:
        log.warning("stabmon: %s: output logits are off", exc)
        return None


def build_outbox(spec: MonitorSpec, *, rank: int, failsafe: Failsafe, run_name: str) -> Outbox:
    """Rank 0's store and notifier (only rank 0 writes to the store and sends alerts), and the OTLP export
    ``spec.otlp`` asks for (:mod:`stabmon.integrations.otel`: rank 0's, or every rank's per rank)."""
    leader = rank == 0
    sink, owns_store = resolve_store(spec.store if leader else None)
    alerter, owns_notifier = resolve_notifier(spec.notifier, spec.alerts, sink) if leader else (None, False)
    exporter = None
    if spec.otlp is not False:
        from stabmon.integrations.otel import exporter_for

        exporter = exporter_for(spec.otlp, rank=rank, run_name=run_name)
    return Outbox(sink, alerter, failsafe=failsafe, run_name=run_name, owns_store=owns_store,
                  owns_notifier=owns_notifier, exporter=exporter)


def build_checkpoints(spec: MonitorSpec, outbox: Outbox) -> CheckpointStore | None:
    """The user's checkpoints (attached to the run's store), a manager on ``checkpoint_dir``, or None. Call it
    once the run is open: checkpoint rows name it."""
    if spec.checkpoints is not None:
        spec.checkpoints.attach(sink=outbox.store, run_id=outbox.run_id)
        return spec.checkpoints
    if spec.checkpoint_dir is None:
        return None
    from stabmon.checkpoints import CheckpointManager

    return CheckpointManager(spec.checkpoint_dir, keep=spec.config.checkpoint_keep, sink=outbox.store,
                             run_id=outbox.run_id)


def build_snapshots(config: MonitorConfig, checkpoints: CheckpointStore | None, *, sharded: bool
                    ) -> HostSnapshots | None:
    """The host-memory snapshot tier ``config.snapshots`` asks for (None: off, no checkpoints to stand in front
    of, or a sharded model: said once)."""
    want = config.snapshots
    if not want.every:
        return None
    if checkpoints is None:
        log.warning("stabmon: config.snapshots needs checkpoints (checkpoint_dir= or checkpoints=): no snapshots")
        return None
    if sharded:
        log.warning("stabmon: config.snapshots: not for a sharded model yet (FSDP): rollbacks use the disk "
                    "checkpoints")
        return None
    return HostSnapshots(every=want.every, keep=want.keep, max_bytes=want.max_bytes)


def build_training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, scaler: Any, scheduler: Any, monitor_state: NamedStates,
    counts_steps: bool = True,
) -> TrainingState:
    """What a checkpoint holds, by name, with the monitor's exclusions per reason to load
    (:data:`~stabmon.collect.checkpoint.monitor_state.EXCLUDED`; ``counts_steps=False``: a framework counts the steps,
    and a rollback leaves the count and the data position to it)."""
    return TrainingState(
        {"model": model, "optimizer": optimizer, "scaler": scaler, "scheduler": scheduler, "monitor": monitor_state},
        exclude=excluded(counts_steps=counts_steps),
        required=REQUIRED,
    )


def build_pipeline(
    target: Handle, *, engine: EngineLike | None, detectors: DetectorSuiteLike, states: NamedStates,
    failsafe: Failsafe, grace_steps: int | None,
) -> Pipeline:
    """The monitor's pipeline (:func:`stabmon.pipeline_of`), acting on ``target``; its detectors, engine
    and executor take their places in the checkpointed ``states`` as it is made."""
    pipeline = pipeline_of(target, engine=engine, detectors=detectors)
    add_pipeline_state(states, pipeline, failsafe=failsafe, grace_steps=grace_steps)
    return pipeline


def kill_switch(path: str | None) -> Any:
    """The kill switch file's watcher (None: no kill switch)."""
    if not path:
        return None
    from stabmon.checkpoints import KillSwitch

    return KillSwitch(path, every=1)
