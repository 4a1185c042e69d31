"""Per-channel routing, deduplication and rate limiting: which alerts a channel hears, and with what action.

Rules, in order, for one channel:

1. A resolution goes to every channel that was told about the incident (PagerDuty: ``resolve``), whatever its
   severity filter; a channel never told about the incident does not hear of its resolution.
2. The alert's kind must be in the channel's ``events`` and its severity at least ``min_severity``.
3. Deduplication: PagerDuty triggers once per open incident (a repeat goes again only when the severity rises,
   with the same ``dedup_key``, which updates the alert rather than paging anew); other channels get the same
   alert (incident + fingerprint) once per ``dedup_window`` seconds.
4. Limits: at most ``incident_limit`` messages per incident, and a token bucket of ``rate_per_minute`` with
   ``burst``. Priority alerts (stops, resolutions) skip both. Suppressed alerts are counted; the next message
   sent on the channel says how many were held back.

>>> from stabmon.alerts.config import AlertsConfig, ChannelConfig
>>> from stabmon.alerts.message import Alert
>>> from stabmon.events import Severity
>>> gate = Gate(ChannelConfig.parse("pagerduty://rk@key"), AlertsConfig(), clock=lambda: 0.0)
>>> a = Alert("r", "demo", "intervention", Severity.ERROR, "i1", "x", 5, "t", "b")
>>> gate.admit(a), gate.admit(a)
('trigger', None)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from stabmon.alerts.config import AlertsConfig, ChannelConfig
from stabmon.alerts.message import Alert

TRIGGER = "trigger"
RESOLVE = "resolve"
NOTIFY = "notify"


class Gate:
    """The routing state of one channel (module docstring). Called from the training thread only."""

    def __init__(self, channel: ChannelConfig, config: AlertsConfig, clock: Callable[[], float]) -> None:
        self.channel = channel
        self.config = config
        self.clock = clock
        self.min_severity = channel.effective_min_severity()
        self._told: dict[str, int] = {}  # incident key -> highest severity rank sent
        self._sent: dict[str, float] = {}  # incident key + fingerprint -> time last sent
        self._count: dict[str, int] = {}  # incident key -> messages sent
        self._tokens = float(config.burst)
        self._refilled = clock()
        self.suppressed = {"filtered": 0, "dedup": 0, "incident_limit": 0, "rate_limit": 0}
        self.held_back = 0  # suppressed by limits since the last message sent here

    def admit(self, alert: Alert) -> str | None:
        """How to deliver ``alert`` (``trigger``/``resolve`` for PagerDuty, else ``notify``), or None."""
        key = alert.incident_key
        if alert.resolves:
            if key not in self._told:
                return self._drop("filtered")
            self._forget(key)
            return RESOLVE if self.channel.is_pagerduty else NOTIFY
        if not self.channel.accepts(alert.kind) or alert.severity < self.min_severity:
            return self._drop("filtered")
        if self._is_repeat(alert):
            return self._drop("dedup")
        if not alert.priority:
            if self._count.get(key, 0) >= self.config.incident_limit:
                return self._drop("incident_limit")
            if not self._take_token():
                return self._drop("rate_limit")
        self._told[key] = max(self._told.get(key, -1), alert.severity.rank)
        self._sent[f"{key}|{alert.fingerprint}"] = self.clock()
        self._count[key] = self._count.get(key, 0) + 1
        return TRIGGER if self.channel.is_pagerduty else NOTIFY

    def take_held_back(self) -> int:
        n, self.held_back = self.held_back, 0
        return n

    def _is_repeat(self, alert: Alert) -> bool:
        key = alert.incident_key
        if self.channel.is_pagerduty:
            return key in self._told and alert.severity.rank <= self._told[key]
        last = self._sent.get(f"{key}|{alert.fingerprint}")
        return last is not None and self.clock() - last < self.config.dedup_window

    def _take_token(self) -> bool:
        now = self.clock()
        rate = self.config.rate_per_minute / 60.0
        self._tokens = min(float(self.config.burst), self._tokens + (now - self._refilled) * rate)
        self._refilled = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def _drop(self, reason: str) -> str | None:
        self.suppressed[reason] += 1
        if reason in ("incident_limit", "rate_limit"):
            self.held_back += 1
        return None

    def _forget(self, key: str) -> None:
        self._told.pop(key, None)
        self._count.pop(key, None)
        for k in [k for k in self._sent if k.startswith(f"{key}|")]:
            del self._sent[k]

    def state_dict(self) -> dict[str, Any]:
        return {"told": dict(self._told), "sent": dict(self._sent), "count": dict(self._count)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._told = dict(state.get("told", {}))
        self._sent = dict(state.get("sent", {}))
        self._count = dict(state.get("count", {}))
