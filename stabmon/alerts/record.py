"""Where delivery attempts are written down: one row per (alert, channel), updated after every attempt.

The notifier's delivery threads call an :class:`AlertRecorder`; they never run on the training thread. The SQL
recorder is the :class:`stabmon.store.Store` itself: its rows go through the store's background writer and
spool like every other row.
Statuses: ``queued`` → (``retrying`` →)* ``sent`` | ``failed`` (attempts exhausted) | ``abandoned`` (still
queued when the notifier was closed, or dropped because the channel's queue was full). ``channel`` is always
the redacted URL and ``error`` is scrubbed of secrets before it reaches a recorder.

>>> rec = MemoryRecorder()
>>> rec.add_alert(alert_id="x1", run_id="r", channel="slack://***", severity="error", status="queued",
...               dedup_key="stabmon-r-i", incident_id="i", event_id="d1", title="t")
>>> rec.update_alert(alert_id="x1", status="sent", attempts=1, error=None)
>>> rec.rows["x1"]["status"], rec.rows["x1"]["attempts"]
('sent', 1)
"""

from __future__ import annotations

import threading
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class AlertRecorder(Protocol):
    """What the notifier needs from the store. Both calls are made from delivery threads."""

    def add_alert(
        self,
        *,
        alert_id: str,
        run_id: str | None,
        channel: str,
        severity: str,
        status: str,
        dedup_key: str | None,
        incident_id: str | None,
        event_id: str | None,
        title: str,
    ) -> None: ...

    def update_alert(self, *, alert_id: str, status: str, attempts: int, error: str | None) -> None: ...


class MemoryRecorder:
    """Keeps rows in a dict (tests, and runs without a store). Thread-safe."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[str, str, int, str | None]] = []  # (alert id, status, attempts, error)
        self._lock = threading.Lock()

    def add_alert(self, *, alert_id: str, **fields: Any) -> None:
        with self._lock:
            self.rows[alert_id] = {"id": alert_id, "attempts": 0, "error": None, **fields}

    def update_alert(self, *, alert_id: str, status: str, attempts: int, error: str | None) -> None:
        with self._lock:
            self.rows.setdefault(alert_id, {"id": alert_id}).update(
                status=status, attempts=attempts, error=error
            )
            self.history.append((alert_id, status, attempts, error))
