"""Where delivery attempts are written down: one row per (alert, channel), updated after every attempt.

The notifier's delivery threads call an :class:`AlertRecorder`; they never run on the training thread.
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


class SqlRecorder:
    """Writes the store's ``alerts`` table through its repository functions (``stabmon.store.repo``).

    Takes a store URL, a SQLAlchemy engine, or a store object with an ``engine`` attribute (the schema must
    exist: ``stabmon db upgrade``, or a SQLite file the store opened). Used by delivery threads only, so its
    short transactions never touch the training thread.
    """

    def __init__(self, target: Any) -> None:
        import sqlalchemy as sa

        from stabmon.store.database import make_engine

        if isinstance(target, str):
            self.engine = make_engine(target)
        elif isinstance(target, sa.Engine):
            self.engine = target
        elif isinstance(getattr(target, "engine", None), sa.Engine):
            self.engine = target.engine
        else:
            raise ValueError(
                f"alerts.recorder: expected a store URL, engine or store, got {type(target).__name__}"
            )

    def add_alert(self, **fields: Any) -> None:
        from sqlalchemy.orm import Session

        from stabmon.store import repo

        with Session(self.engine) as session, session.begin():
            repo.add_alert(session=session, **fields)

    def update_alert(self, *, alert_id: str, status: str, attempts: int, error: str | None) -> None:
        from sqlalchemy.orm import Session

        from stabmon.store import repo

        with Session(self.engine) as session, session.begin():
            repo.update_alert(
                session=session, alert_id=alert_id, status=status, attempts=attempts, error=error
            )
