"""How the monitor's ``store=``, ``alerts=``/``notifier=``, ``detectors=`` and ``runbook=`` arguments become
objects. The runbook engine and detectors come from :mod:`stabmon.factory` (which replay uses too):
:func:`resolve_decisions`, and :func:`resolve_engine` for the framework integrations, are re-exported here.

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

from stabmon.factory import resolve_decisions as resolve_decisions
from stabmon.factory import resolve_engine as resolve_engine
from stabmon.sinks import Sink
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
