"""What the HF Trainer and Lightning callbacks share: building monitors from one :class:`~stabmon.spec.MonitorSpec`
and a framework's objects, and monitor state as bytes in a checkpoint.

A callback takes the monitor's own keyword arguments (or ``spec=``): they make a ``MonitorSpec``, checked when the
callback is built (bad store URL, unknown runbook, bad mode or config), so a mistake is one ``ValueError`` before
the framework even starts, not a crash a minute into training.

>>> from stabmon.spec import MonitorSpec
>>> monitors = MonitorFactory(MonitorSpec(store=None, runbook=None))
>>> monitors.open_store() is None
True
>>> state_from_bytes(state_to_bytes({"step": 3}))
{'step': 3}
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from stabmon.collect.wiring import resolve_store
from stabmon.overrides import Overrides
from stabmon.spec import MonitorSpec

log = logging.getLogger(__name__)


class MonitorFactory:
    """Monitors on a framework's objects, one per ``train()``/``fit()``, from one spec.

    The store is opened here (so a bad URL fails at once) and kept open across ``train()`` calls; the
    callback closes it with :meth:`close_store` when training ends and :meth:`open_store` reopens it.

    >>> from stabmon.collect.config import MonitorConfig
    >>> MonitorFactory(MonitorSpec(store=None, config=MonitorConfig(clip=2.0))).spec.config.clip
    2.0
    """

    def __init__(self, spec: MonitorSpec) -> None:
        self.spec = spec
        self._store: Any = None
        self._owns_store = False
        self.open_store()

    def open_store(self) -> Any:
        """The store sink (opened on first use, and again after :meth:`close_store`)."""
        if self._store is None and self.spec.store is not None:
            self._store, self._owns_store = resolve_store(self.spec.store)
        return self._store

    def close_store(self) -> None:
        """Flush and close the store if this factory opened it; failures are logged, never raised."""
        store, self._store = self._store, None
        if store is None or not self._owns_store:
            return
        try:
            store.flush(timeout=30.0)
            store.close()
        except Exception:  # noqa: BLE001 - training is over; a store problem must not turn it into a crash
            log.exception("stabmon: closing the store failed")

    def build(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scaler: Any = None,
        scheduler: Any = None,
        clip: float | None = None,
        framework: str,
        defaults: Mapping[str, Any] | None = None,
        changes: Mapping[str, Any] | None = None,
    ) -> Any:
        """A Monitor on the framework's objects; ``clip`` (the framework's own max-norm, taken over) applies
        when the config sets none; ``framework``: who counts the steps (the callback hands each step's batch over,
        :class:`~stabmon.spec.Loop`); ``defaults``: spec fields the framework knows (its ``run_name``, how a handed
        batch gives its ``loss_fn``) that apply where the spec leaves them None; ``changes``: spec fields of this
        ``train()``/``fit()`` (``resume_run_id``, the framework's own settings as ``recipe``) that apply where they
        are not None."""
        from stabmon.monitor import Monitor
        from stabmon.spec import Loop

        spec = self.spec
        fields: dict[str, Any] = {"store": self.open_store(), "loop": Loop(framework=framework, batches=True)}
        if clip is not None and spec.config.clip is None:
            fields["config"] = dataclasses.replace(spec.config, clip=float(clip))
        fields.update({k: v for k, v in (defaults or {}).items() if v is not None and vars(spec)[k] is None})
        fields.update({k: v for k, v in (changes or {}).items() if v is not None})
        return Monitor(model, optimizer, spec.replace(**fields), scaler=scaler, scheduler=scheduler)


class EffectiveLR:
    """Make a scheduler's ``get_last_lr()`` report the learning rates in force, the monitor's overrides applied
    (``lr_scale``, ``lr_cap``), so that a framework logging the schedule's value (HF Trainer's ``learning_rate``)
    logs the one training uses. The scheduler's ``_last_lr`` (the plain list ``get_last_lr()`` returns) holds the
    values in force from :meth:`install` until :meth:`remove` puts the schedule's own list back, unless the
    scheduler stepped meanwhile (it then wrote its own new values). Nothing but numbers is ever set on the
    scheduler: its ``state_dict`` stays picklable and loads with ``weights_only=True`` whenever it is saved. The
    schedule itself is untouched (the monitor applies its overrides around ``optimizer.step()``).

    >>> import torch
    >>> from stabmon.overrides import Overrides
    >>> opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.4)
    >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    >>> o = Overrides(lr_scale=0.5, lr_cap=0.1)
    >>> patch = EffectiveLR(sched, lambda: o); patch.install()
    >>> sched.get_last_lr(), sched.state_dict()["_last_lr"]
    ([0.1], [0.1])
    >>> patch.remove(); sched.get_last_lr()
    [0.4]
    """

    def __init__(self, scheduler: Any, overrides: Callable[[], Overrides]) -> None:
        self.scheduler, self.overrides = scheduler, overrides
        self._own: list[float] | None = None  # the schedule's list while the values in force stand in for it
        self._shown: list[float] | None = None  # the list of values in force set on the scheduler

    def install(self) -> None:
        lrs = getattr(self.scheduler, "_last_lr", None)
        if not isinstance(lrs, list) or not lrs or self._shown is not None or any(_on_device(v) for v in lrs):
            return  # nothing to show, or an LR on an accelerator (reading it would stall the step)
        in_force = self.overrides()
        ref = lrs[0]
        self._own = lrs
        self._shown = [float(in_force.scaled_lr(_number(v), group=i, ref=_number(ref))) for i, v in enumerate(lrs)]
        self.scheduler._last_lr = self._shown

    def remove(self) -> None:
        if self._shown is None:
            return
        if self.scheduler._last_lr is self._shown:  # the scheduler has not stepped since: its own list back
            self.scheduler._last_lr = self._own
        self._own = self._shown = None


def _number(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _on_device(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


def state_to_bytes(state: dict[str, Any]) -> bytes:
    """Monitor state as bytes, so a checkpoint loaded with ``torch.load(weights_only=True)`` still loads."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def state_from_bytes(data: bytes) -> dict[str, Any]:
    """The monitor state :func:`state_to_bytes` wrote: plain values and tensors only (``weights_only=True``)."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


class OutsideSteps:
    """A framework's work between two of its hooks that is outside the training steps (the HF Trainer's
    evaluation and checkpoint, Lightning's validation): :meth:`stabmon.monitor.Monitor.outside_steps` from one hook
    to another, so the hang watchdog gives it the cap and does not learn its time as a step.

    >>> import torch
    >>> from stabmon.monitor import Monitor
    >>> model = torch.nn.Linear(2, 1)
    >>> mon = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=None, detectors=False)
    >>> outside = OutsideSteps()
    >>> outside.begin(mon, "evaluation"); mon._watchdog.deadline() == mon.config.hang_timeout
    True
    >>> outside.end("evaluation"); outside.open
    []
    >>> mon.close()
    """

    def __init__(self) -> None:
        self._open: dict[str, contextlib.ExitStack] = {}

    @property
    def open(self) -> list[str]:
        return list(self._open)

    def begin(self, monitor: Any, what: str) -> None:
        if monitor is None or what in self._open:
            return
        stack = contextlib.ExitStack()
        stack.enter_context(monitor.outside_steps(what))
        self._open[what] = stack

    def end(self, what: str) -> None:
        stack = self._open.pop(what, None)
        if stack is not None:
            stack.close()

    def end_all(self) -> None:
        for what in list(self._open):
            self.end(what)
