"""How the monitor's ``store=``, ``alerts=``/``notifier=``, ``detectors=`` and ``runbook=`` arguments become
objects.

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
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from stabmon.events import Anomaly, StepRecord
from stabmon.pipeline import Pipeline
from stabmon.sinks import NotifierLike, Sink

log = logging.getLogger(__name__)

MODES = ("propose", "apply", "observe", None)
DEFAULT_STORE = "default"
"""Sentinel for ``store=``: ``$STABMON_DB_URL``, else ``sqlite:///stabmon.db``."""
DEFAULT_DB_URL = "sqlite:///stabmon.db"


def default_db_url() -> str:
    return os.environ.get("STABMON_DB_URL") or DEFAULT_DB_URL


def resolve_store(store: Any) -> tuple[Sink | None, bool]:
    """(sink, owned): ``owned`` when the monitor opened it and so must close it."""
    if store is None:
        return None, False
    if store is DEFAULT_STORE:
        store = default_db_url()
    if isinstance(store, str):
        from stabmon.store import StoreError, open_store

        try:
            return open_store(store), True
        except StoreError as exc:  # already one line that names the store and the URL
            raise ValueError((str(exc).splitlines() or [""])[0]) from None
        except Exception as exc:  # noqa: BLE001 - any failure to open is the user's URL's fault
            first = (str(exc).splitlines() or [""])[0]
            raise ValueError(f"store: cannot open {_safe(store)}: {type(exc).__name__}: {first}") from None
    if isinstance(store, Sink):
        return store, False
    raise ValueError(f"store: expected a URL string, a Sink object or None, got {type(store).__name__}")


def _safe(url: str) -> str:
    from stabmon.store.engine import safe_url

    return repr(safe_url(url))


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


class NullDetectors:
    """A detector suite that finds nothing (``detectors=False``).

    >>> NullDetectors().update(StepRecord(step=0, metrics={}))
    []
    """

    def update(self, record: StepRecord) -> list[Anomaly]:
        return []

    def enter_grace(self, steps: int | None = None) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def resolve_detectors(detectors: Any) -> Any:
    if detectors is False:
        return NullDetectors()
    if detectors is None or isinstance(detectors, Mapping):
        try:
            from stabmon.detect import DetectorSuite
        except ImportError:
            log.warning("stabmon: stabmon.detect.DetectorSuite is unavailable; running without detectors")
            return NullDetectors()
        try:
            return DetectorSuite.from_config(detectors)
        except ValueError as exc:
            raise ValueError(f"detectors: {exc}") from None
    if all(hasattr(detectors, m) for m in ("update", "enter_grace", "state_dict", "load_state_dict")):
        return detectors
    raise ValueError(
        f"detectors: expected a config mapping, a detector suite, None or False, got "
        f"{type(detectors).__name__}"
    )


def resolve_engine(runbook: Any, mode: str | None) -> Any:
    if runbook is None or mode == "observe":
        return None
    if all(hasattr(runbook, m) for m in ("process", "answer", "applied", "state_dict")):
        return runbook  # an engine already
    from stabmon.runbook import Engine

    return _make_engine(Engine, resolve_runbook(runbook), mode)


def resolve_runbook(runbook: Any) -> Any:
    """A loaded :class:`~stabmon.runbook.Runbook` from a name, a path or a Runbook; errors name ``runbook``."""
    from stabmon.runbook import Runbook, load_runbook

    if isinstance(runbook, Runbook):
        return runbook
    try:
        return load_runbook(os.fspath(runbook))
    except (ValueError, OSError, TypeError) as exc:
        first = (str(exc).splitlines() or [""])[0]
        raise ValueError(f"runbook: {first}") from None


def _make_engine(engine_cls: Any, runbook: Any, mode: str | None) -> Any:
    import inspect

    try:
        accepts_mode = "mode" in inspect.signature(engine_cls).parameters
    except (TypeError, ValueError):
        accepts_mode = False
    return engine_cls(runbook, mode=mode) if accepts_mode and mode is not None else engine_cls(runbook)


def build_pipeline(target: Any, *, detectors: Any, runbook: Any, mode: str | None) -> tuple[Pipeline, Any]:
    """The pipeline (detectors, engine, live executor acting on ``target``) and its executor.

    Without ``detectors=``, the detectors take the runbook's ``detectors:`` section (where a ``stabmon tune``
    result lands through ``include:``), exactly as replay does."""
    if runbook is not None and mode != "observe" and not hasattr(runbook, "process"):
        runbook = resolve_runbook(runbook)
        if detectors is None and getattr(runbook, "detectors", None):
            detectors = dict(runbook.detectors)
    suite = resolve_detectors(detectors)
    engine = resolve_engine(runbook, mode)
    executor = None
    if engine is not None:
        from stabmon.interventions import LiveExecutor

        executor = LiveExecutor(target)
    return Pipeline(suite, engine, executor), executor


def environment() -> dict[str, Any] | None:
    """The run's environment fingerprint, or None to let the store take it."""
    try:
        from stabmon.environment import fingerprint
    except ImportError:
        return None
    try:
        return dict(fingerprint())
    except Exception:  # noqa: BLE001 - a fingerprint is never worth failing a run for
        log.exception("stabmon: could not take the environment fingerprint")
        return None


def check_model_and_optimizer(model: Any, optimizer: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    """One-line ValueErrors naming ``model`` or ``optimizer`` for inputs the monitor cannot watch."""
    params = {id(p) for p in model.parameters()}
    if not params:
        raise ValueError("model: has no parameters to monitor")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not params & held:
        raise ValueError("optimizer: holds none of the model's parameters (was it built for another model?)")
