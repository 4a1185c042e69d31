"""What a monitor is asked to be: :class:`MonitorSpec`, the one argument list of the
:class:`~stabmon.monitor.Monitor` and of the HF Trainer and Lightning callbacks, frozen and checked once.

``Monitor(model, optimizer, store=..., runbook=...)`` and ``StabmonCallback(store=..., runbook=...)`` both
build a ``MonitorSpec`` from their keyword arguments (or take one as ``spec=``), so every argument is written,
documented and validated here only. A bad value is one ``ValueError`` naming the argument, when the spec is made:
for a callback, before the framework starts training. A runbook given by name or path is loaded here (its errors
name ``runbook``), so the monitor and every ``train()`` of a callback share the loaded file.

>>> spec = MonitorSpec(store=None, runbook="default", mode="apply")
>>> spec.runbook.name, spec.mode, spec.config.flush_every, spec.config_in_force.checkpoint_every
('default', 'apply', 20, 0)
>>> MonitorSpec(store=None, mode="yolo")
Traceback (most recent call last):
...
ValueError: mode: must be one of propose, apply, observe, None, got 'yolo'
>>> try:
...     spec_of(None, {"store": None, "clip": 1.0})
... except TypeError as exc:
...     print(str(exc).split(" (")[0])
unexpected keyword argument 'clip'
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stabmon.checkpoints import CheckpointStore
from stabmon.collect.config import MonitorConfig
from stabmon.pipeline import EngineLike
from stabmon.recipe import check_recipe
from stabmon.store.limits import check_name

if TYPE_CHECKING:
    from stabmon.integrations.otel import OtlpConfig

MODES = ("propose", "apply", "observe", None)


@dataclass(frozen=True)
class Loop:
    """What the training loop around a monitor does with the steps and the batches: what a runbook's rungs can
    count on (a rung that cannot act in this loop is dropped at start, :mod:`stabmon.runbook.fit`).

    ``framework``: None for a loop the monitor counts (``monitor.steps()``, or ``begin_step``/``end_step``);
    else the framework that counts the optimizer steps (``"hf"``, ``"lightning"``): the monitor follows its count
    (``sync_step``), and a rollback restores the training state in place while the count goes on (the
    framework's own step counter, data position and logs do not go back).
    ``batches``: the loop hands each step's batch to the monitor (``monitor.steps()``, ``begin_step(batch=...)``,
    the callbacks): what ``diagnose`` re-runs and replays. None: not known until the first step (a plain loop).

    >>> Loop().framework is None, Loop(framework="hf", batches=True).batches
    (True, True)
    """

    framework: str | None = None
    batches: bool | None = None

    @property
    def counts_steps(self) -> bool:
        """The monitor counts the steps (a rollback rewinds the count and, where it can, the data)."""
        return self.framework is None
DEFAULT_STORE = "default"
"""Sentinel for ``store=``: the default store URL (:func:`stabmon.store.database.resolve_url`)."""


@dataclass(frozen=True)
class MonitorSpec:
    """Everything a :class:`~stabmon.monitor.Monitor` is built from besides the training objects (model,
    optimizer, scaler, scheduler); see the module docstring."""

    store: Any = DEFAULT_STORE
    """A database URL, a :class:`~stabmon.sinks.Sink`, None (no store) or :data:`DEFAULT_STORE`."""
    runbook: Any = None
    """A shipped runbook's name, a YAML path, a :class:`~stabmon.runbook.Runbook`, a ready engine, or None."""
    mode: str | None = "propose"
    """``propose`` (a human approves), ``apply``, ``observe`` (detectors only) or None (the runbook's own)."""
    detectors: Any = None
    """None (defaults, or the runbook's ``detectors:``), False (none), a config mapping or a detector suite."""
    thresholds: str | os.PathLike[str] | None = None
    """A thresholds file (what ``stabmon tune --out`` writes): its detector settings on top of the runbook's
    ``detectors:`` (or ``detectors=``), so a shipped runbook takes a tuning without being copied."""
    notifier: Any = None
    """A ready notifier (``handle()`` and ``close()``); wins over ``alerts``."""
    alerts: Iterable[str] | str | None = None
    """Alert channel URLs, an alerts config or its file (None: ``$STABMON_ALERTS``, if set)."""
    config: MonitorConfig = field(default_factory=MonitorConfig)
    """The monitor's settings (as given; :attr:`config_in_force` has the checkpoint cadence resolved)."""
    run_name: str | None = None
    """The run's name in the store (None: ``run-<date>-<time>``, or the framework's)."""
    checkpoint_dir: str | None = None
    """A directory for the monitor's own checkpoints (rollback needs checkpoints)."""
    checkpoints: CheckpointStore | None = None
    """Checkpoints the user manages (:class:`~stabmon.checkpoints.UserCheckpoints`), instead of
    ``checkpoint_dir``."""
    resume_run_id: str | None = None
    """Continue this run in the store (None: the run named by ``resume``, if any)."""
    resume: Mapping[str, Any] | None = None
    """A saved ``monitor.state_dict()`` to continue from."""
    loss_fn: Callable[[Any, Any], Any] | None = None
    """Diagnose's loss of a batch, ``loss_fn(model, batch)`` (None: the model's own output)."""
    sample_ids: Callable[[Any], Any] | None = None
    """The ids of a batch's samples, recorded with the steps a runbook diagnoses."""
    recipe: Mapping[str, Any] | None = None
    """The run's own settings (its arguments), stored with the run for ``stabmon diff``."""
    loop: Loop = field(default_factory=Loop)
    """What the training loop does with steps and batches (:class:`Loop`; the HF and Lightning callbacks say)."""
    otlp: bool | str | OtlpConfig | None = None
    """Live export over OTLP/HTTP (:mod:`stabmon.integrations.otel`, extra ``otel``): None exports when
    ``$OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` or ``$OTEL_EXPORTER_OTLP_ENDPOINT`` is set; False: never; True: to
    those or ``localhost:4318``; a URL: there; an :class:`~stabmon.integrations.otel.OtlpConfig` for more."""

    _thresholds: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    """The ``detector.param=value`` settings read from :attr:`thresholds`."""

    def __post_init__(self) -> None:
        config = MonitorConfig() if self.config is None else self.config
        if not isinstance(config, MonitorConfig):
            raise ValueError(f"config: expected a MonitorConfig, got {type(config).__name__}")
        config.validate()
        self._set("config", config)
        if not isinstance(self.loop, Loop):
            raise ValueError(f"loop: expected a stabmon.spec.Loop, got {type(self.loop).__name__}")
        if self.mode not in MODES:
            raise ValueError(f"mode: must be one of {', '.join(map(str, MODES))}, got {self.mode!r}")
        if self.run_name is not None:
            check_name("run_name", self.run_name)
        self._set("recipe", check_recipe(self.recipe))
        _check_store(self.store)
        if self.checkpoints is not None and not isinstance(self.checkpoints, CheckpointStore):
            raise ValueError(f"checkpoints: expected a CheckpointStore (stabmon.checkpoints.UserCheckpoints or "
                             f"CheckpointManager), got {type(self.checkpoints).__name__}")
        if self.runbook is not None and not isinstance(self.runbook, EngineLike):
            from stabmon.factory import resolve_runbook

            self._set("runbook", resolve_runbook(self.runbook))  # raises "runbook: ..." now
        if self.thresholds is not None:
            from stabmon.detect.config import load_thresholds

            self._set("_thresholds", tuple(load_thresholds(self.thresholds)))  # raises "thresholds: ..."
            if self.detectors is False or not (self.detectors is None or isinstance(self.detectors, Mapping)):
                raise ValueError("thresholds: apply to the default detectors or a detectors= mapping, not to "
                                 f"detectors={type(self.detectors).__name__}")
        if isinstance(self.detectors, Mapping) or self.thresholds is not None:
            from stabmon.factory import resolve_detectors

            # raises "detectors: ..." now rather than after the run opened (a bad tuned value included)
            runbook = self.loaded_runbook
            base = self.detectors if self.detectors is not None else runbook.detectors if runbook is not None else None
            resolve_detectors(dict(base) if base else None, self.threshold_overrides)
        if self.notifier is not None or self.alerts is not None:
            _check_alerts(self.notifier, self.alerts)
        if self.otlp is not None:
            from stabmon.integrations.otel import check_otlp

            check_otlp(self.otlp)  # raises "otlp: ..."
        if self.resume and self.resume_run_id is None:  # a saved monitor state names its run: reopen that one
            self._set("resume_run_id", self.resume.get("run_id"))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: only __post_init__ normalises a field

    def replace(self, **changes: Any) -> MonitorSpec:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    @property
    def config_in_force(self) -> MonitorConfig:
        """``config`` with the checkpoint cadence in force (``checkpoint_every=None`` resolved: a cadence when
        the monitor can save checkpoints), the value stored with the run."""
        return _with_cadence(self.config, checkpoint_dir=self.checkpoint_dir, checkpoints=self.checkpoints)

    @property
    def threshold_overrides(self) -> list[str]:
        """The ``detector.param=value`` settings of :attr:`thresholds` (none without a file)."""
        return list(self._thresholds)

    @property
    def loaded_runbook(self) -> Any:
        """The :class:`~stabmon.runbook.Runbook` the engine will run (None: none, observe mode, or a ready
        engine given as ``runbook=``)."""
        return None if self.mode == "observe" or isinstance(self.runbook, EngineLike) else self.runbook


FIELDS = tuple(sorted(f.name for f in dataclasses.fields(MonitorSpec) if f.init))


def spec_of(spec: MonitorSpec | None, options: Mapping[str, Any]) -> MonitorSpec:
    """``spec`` (or the defaults) with the keyword ``options`` a caller passed; an unknown keyword is a
    ``TypeError`` naming it, as Python's own."""
    unknown = sorted(set(options) - set(FIELDS))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r} (a monitor takes: {', '.join(FIELDS)})")
    if spec is None:
        return MonitorSpec(**options)
    if not isinstance(spec, MonitorSpec):
        raise ValueError(f"spec: expected a MonitorSpec, got {type(spec).__name__}")
    return spec.replace(**options) if options else spec


def _check_store(store: Any) -> None:
    from stabmon.sinks import Sink

    if store is None or isinstance(store, (str, Sink)):
        return
    raise ValueError(f"store: expected a URL string, a Sink object or None, got {type(store).__name__}")


def _check_alerts(notifier: Any, alerts: Any) -> None:
    """Raise ``alerts: ...`` / ``notifier: ...`` now rather than when the monitor starts."""
    from stabmon.alerts.notifier import resolve_notifier

    made, owned = resolve_notifier(notifier, alerts)
    if owned and made is not None:
        made.close(timeout=1.0)


def _with_cadence(config: MonitorConfig, *, checkpoint_dir: str | None,
                  checkpoints: CheckpointStore | None) -> MonitorConfig:
    """``config`` with the checkpoint cadence in force (``checkpoint_every=None`` resolved), the value stored
    with the run."""
    can_save = checkpoint_dir is not None or (checkpoints is not None and checkpoints.can_save)
    return dataclasses.replace(config, checkpoint_every=config.checkpoint_cadence(can_save=can_save))
