"""How the monitor's ``store=``, ``alerts=``/``notifier=``, ``detectors=`` and ``runbook=`` arguments become
objects. The pipeline (detectors, runbook engine, executor) comes from :mod:`stabmon.factory`, which replay
uses too; :func:`resolve_engine` is re-exported from there for the framework integrations.

Each resolver accepts the plain forms a user types (a URL, a runbook name, a config mapping) or a ready object
implementing the protocol, and turns anything else into a one-line ``ValueError`` naming the argument.

>>> resolve_store(None)
(None, False)
>>> resolve_store(42)
Traceback (most recent call last):
...
ValueError: store: expected a URL string, a Sink object or None, got int
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from stabmon import factory
from stabmon.factory import resolve_engine as resolve_engine
from stabmon.pipeline import InterventionTarget, Pipeline
from stabmon.sinks import NotifierLike, Sink
from stabmon.spec import DEFAULT_STORE as DEFAULT_STORE
from stabmon.spec import MODES as MODES

log = logging.getLogger(__name__)



def resolve_store(store: Any) -> tuple[Sink | None, bool]:
    """(sink, owned): ``owned`` when the monitor opened it and so must close it."""
    if store is None:
        return None, False
    if store is DEFAULT_STORE or isinstance(store, str):
        from stabmon.store import StoreError, open_store
        from stabmon.store.database import resolve_url, safe_url

        store = resolve_url(None if store is DEFAULT_STORE else store)
        try:
            return open_store(store), True
        except StoreError as exc:  # already one line that names the store and the URL
            raise ValueError((str(exc).splitlines() or [""])[0]) from None
        except Exception as exc:  # noqa: BLE001 - any failure to open is the user's URL's fault
            first = (str(exc).splitlines() or [""])[0]
            raise ValueError(f"store: cannot open {safe_url(store)!r}: {type(exc).__name__}: {first}") from None
    if isinstance(store, Sink):
        return store, False
    raise ValueError(f"store: expected a URL string, a Sink object or None, got {type(store).__name__}")


def resolve_notifier(notifier: Any, alerts: Any, store: Any = None) -> tuple[NotifierLike | None, bool]:
    """(notifier, owned) from ``notifier=`` (an object) or ``alerts=`` (URLs, a config or a config file).

    Delivery attempts are recorded in ``store`` (the monitor's opened store, or a URL)."""
    if notifier is not None:
        if not isinstance(notifier, NotifierLike):
            raise ValueError(
                f"notifier: expected an object with handle() and close(), got {type(notifier).__name__}"
            )
        return notifier, False
    try:
        from stabmon.alerts import make_notifier

        # alerts=None still honours $STABMON_ALERTS / $STABMON_ALERTS_CONFIG; None when no channel is set.
        made = make_notifier(alerts, store=store)
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith("alerts") else f"alerts: {message}") from None
    return made, made is not None


def build_pipeline(
    target: InterventionTarget, *, detectors: Any, runbook: Any, mode: str | None
) -> tuple[Pipeline, Any]:
    """The monitor's pipeline (see :func:`stabmon.factory.build_pipeline`), acting on ``target``, and its
    executor."""
    pipeline = factory.build_pipeline(target, runbook=runbook, detectors=detectors, mode=mode)
    return pipeline, pipeline.executor


def environment() -> dict[str, Any] | None:
    """The run's environment fingerprint, or None (logged) when taking it failed (a live run's store then tries
    once more)."""
    from stabmon.environment import fingerprint

    try:
        return dict(fingerprint())
    except Exception:  # noqa: BLE001 - a fingerprint is never worth failing a run for
        log.exception("stabmon: could not take the environment fingerprint")
        return None


def check_model_and_optimizer(model: Any, optimizer: Any) -> None:
    """One-line ValueErrors naming ``model`` or ``optimizer`` for inputs the monitor cannot watch."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    params = {id(p) for p in model.parameters()}
    if not params:
        raise ValueError("model: has no parameters to monitor")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not params & held:
        raise ValueError("optimizer: holds none of the model's parameters (was it built for another model?)")
