"""The notifier: events in, alerts out, never blocking the training thread.

``handle()`` runs on the training thread at flush time. It composes alerts from the flush's events, routes
each through every channel's gate (severity, deduplication, rate limits) and appends what passes to that
channel's queue; the channel's own thread delivers it. Only rank 0 sends: on any other rank of an initialised
``torch.distributed`` group ``handle()`` does nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from stabmon.alerts.config import AlertsConfig, ChannelConfig, resolve_config
from stabmon.alerts.delivery import Channel, ChannelWorker, Job
from stabmon.alerts.message import Alert, Composer
from stabmon.alerts.record import AlertRecorder
from stabmon.alerts.routing import Gate
from stabmon.events import Event, new_id
from stabmon.sinks import NotifierLike

log = logging.getLogger("stabmon.alerts")
DEFAULT_CLOSE_TIMEOUT = 30.0


def is_nonzero_rank() -> bool:
    """True on a torch.distributed rank other than 0 (torch is not imported just to ask)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        dist = torch.distributed
        return bool(dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)
    except Exception:  # noqa: BLE001 - a half-initialised torch is treated as single-process
        return False


class Notifier:
    """Alerts through apprise URLs, delivered on background threads (a ``stabmon.sinks.NotifierLike``).

    >>> n = Notifier(["json://127.0.0.1:9/hook"], config=AlertsConfig(timeout=0.2, max_attempts=1))
    >>> [c.name for c in n.channels]
    ['json://127.0.0.1:9/***']
    >>> n.handle(run_id="r1", run_name="demo", events=[])  # nothing to say: returns at once
    >>> n.close(timeout=1.0)
    """

    def __init__(
        self,
        channels: Iterable[str | ChannelConfig] | None = None,
        *,
        config: AlertsConfig | None = None,
        recorder: AlertRecorder | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        cfg = copy.deepcopy(config) if config is not None else AlertsConfig()
        if channels is not None:
            cfg.channels = [c if isinstance(c, ChannelConfig) else ChannelConfig.parse(c) for c in channels]
        self.config = cfg.validate()
        self.recorder = recorder
        self.channels = [
            Channel(c, timeout=cfg.timeout, path=f"alerts.channels[{i}]") for i, c in enumerate(cfg.channels)
        ]
        self.gates = [Gate(c.config, cfg, clock) for c in self.channels]
        self.counters: dict[str, int] = {}
        self._count_lock = threading.Lock()
        self.workers = [
            ChannelWorker(c, cfg, recorder, self.counters, self._count_lock) for c in self.channels
        ]
        self.composer = Composer()
        self._closed = False

    @classmethod
    def from_sources(
        cls,
        urls: str | Iterable[str | ChannelConfig] | None = None,
        *,
        config_file: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        recorder: AlertRecorder | None = None,
    ) -> Notifier:
        """Channels from ``urls``, else the config file, else ``$STABMON_ALERTS`` (see ``alerts.config``)."""
        return cls(config=resolve_config(urls, config_file=config_file, env=env), recorder=recorder)

    # -- training thread ------------------------------------------------------------------------------------
    def handle(self, *, run_id: str, run_name: str, events: Sequence[Event]) -> None:
        """Queue alerts for ``events``; returns without waiting for any network or database I/O."""
        if not self.workers or self._closed or not events or is_nonzero_rank():
            return
        try:
            for alert in self.composer.compose(run_id=run_id, run_name=run_name, events=events):
                self._route(alert)
        except Exception:  # noqa: BLE001 - alerting never raises into training
            log.exception("composing alerts for run %s failed", run_id)
            self._count("errors")

    def _route(self, alert: Alert) -> None:
        for gate, worker in zip(self.gates, self.workers, strict=True):
            action = gate.admit(alert)
            if action is None:
                continue
            held = gate.take_held_back()
            sent = (
                alert
                if not held
                else dataclasses.replace(
                    alert,
                    body=f"{alert.body}\n({held} earlier alert(s) on this channel held back by rate limits)",
                )
            )
            if worker.submit(Job(sent, action, new_id())):
                self._count("queued")
            else:
                self._count("dropped")
                log.warning("alert queue for %s is full or closed; alert dropped", worker.channel.name)

    # -- waiting and closing --------------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is delivered or given up (True) or ``timeout`` passes (False)."""
        deadline = time.monotonic() + (DEFAULT_CLOSE_TIMEOUT if timeout is None else timeout)
        return all([w.wait_idle(deadline) for w in self.workers])

    def close(self, timeout: float | None = None) -> None:
        """Drain the queues (retrying without long backoffs) for up to ``timeout`` seconds, then stop.

        Alerts still queued at the deadline are recorded as ``abandoned``.
        """
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + (DEFAULT_CLOSE_TIMEOUT if timeout is None else timeout)
        try:
            for w in self.workers:
                w.begin_close()
            if not all([w.join(deadline) for w in self.workers]):
                log.warning("alert notifier closed with undelivered alerts (see the alerts table)")
        except Exception:  # noqa: BLE001 - closing must not raise into the training script
            log.exception("closing the alert notifier failed")

    # -- bookkeeping ----------------------------------------------------------------------------------------
    def _count(self, name: str) -> None:
        with self._count_lock:
            self.counters[name] = self.counters.get(name, 0) + 1

    @property
    def stats(self) -> dict[str, Any]:
        """Counters (queued, sent, retries, failed, dropped, abandoned, errors); suppressions per channel."""
        with self._count_lock:
            out: dict[str, Any] = dict(self.counters)
        out["suppressed"] = {
            ch.name: dict(g.suppressed) for g, ch in zip(self.gates, self.channels, strict=True)
        }
        return out

    def state_dict(self) -> dict[str, Any]:
        """Incident keys and per-channel routing state (who was told about which incident), for resume."""
        return {
            "composer": self.composer.state_dict(),
            "gates": {ch.name: g.state_dict() for g, ch in zip(self.gates, self.channels, strict=True)},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.composer.load_state_dict(state.get("composer", {}))
        gates = state.get("gates", {})
        for g, ch in zip(self.gates, self.channels, strict=True):
            if ch.name in gates:
                g.load_state_dict(gates[ch.name])


def make_notifier(
    alerts: Notifier | AlertsConfig | str | os.PathLike[str] | Iterable[str | ChannelConfig] | None,
    *,
    recorder: AlertRecorder | None = None,
    store: Any = None,
    env: Mapping[str, str] | None = None,
) -> Notifier | None:
    """What the Monitor's ``alerts=`` argument means.

    A Notifier, a config, a config-file path (``.yaml``, ``.yml``, ``.toml``), URL(s), or None (then
    ``$STABMON_ALERTS_CONFIG`` / ``$STABMON_ALERTS``). Returns None when no channel is configured anywhere.
    Delivery attempts are recorded through ``recorder``, else through ``store`` (an open
    :class:`stabmon.store.Store`, or any other :class:`~stabmon.alerts.record.AlertRecorder`).
    """
    if isinstance(alerts, Notifier):
        return alerts
    if recorder is None and store is not None:
        recorder = _store_recorder(store)
    if isinstance(alerts, AlertsConfig):
        notifier = Notifier(config=alerts, recorder=recorder)
    elif isinstance(alerts, (str, os.PathLike)) and str(alerts).lower().endswith((".yaml", ".yml", ".toml")):
        notifier = Notifier.from_sources(config_file=alerts, env=env, recorder=recorder)
    elif isinstance(alerts, os.PathLike):
        raise ValueError(f"alerts: a config file must end in .yaml, .yml or .toml, got {os.fspath(alerts)!r}")
    else:
        notifier = Notifier.from_sources(alerts, env=env, recorder=recorder)
    return notifier if notifier.channels else None


def _store_recorder(store: Any) -> AlertRecorder | None:
    if isinstance(store, AlertRecorder):
        return store
    # alerts still go out; only their rows are missing
    log.error("alert attempts will not be recorded: %s cannot record alerts", type(store).__name__)
    return None


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
        # alerts=None still honours $STABMON_ALERTS / $STABMON_ALERTS_CONFIG; None when no channel is set.
        made = make_notifier(alerts, store=store)
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith("alerts") else f"alerts: {message}") from None
    return made, made is not None
