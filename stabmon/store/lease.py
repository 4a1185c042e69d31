"""One writer per run: a lease in the ``runs`` row, taken by one conditional UPDATE.

A store that creates a run holds its lease from the first row; one that resumes a run claims it first
(:meth:`RunLease.claim`, at start-up, before anything of the run is queued). The store's background writer
renews its leases every ``ttl / 4`` seconds and the store releases them at ``close()``, once what it queued is
written (where they are still its own). A second
process resuming a run whose lease is held gets :class:`RunInUseError`, one line naming the holder, and writes
nothing: before, both numbered their records from the same sequence number and the database kept only the
first of each pair (860 of 1,260 steps, nothing counted).

A lease whose holder died is free: at once when the holder ran on this host and its process is gone (or, in
this process, its store was closed), otherwise once ``lease_until`` has passed without renewal.

>>> import os, tempfile
>>> from stabmon.store import open_store
>>> url = "sqlite:///" + os.path.join(tempfile.mkdtemp(), "l.db")
>>> first = open_store(url); run = first.start_run(name="r", environment={}); _ = first.flush(10.0)
>>> second = open_store(url)
>>> second.start_run(name="r", resume_run_id=run, environment={})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
stabmon.store.lease.RunInUseError: run ... is being written by another process (...); ...
>>> first.close(); second.start_run(name="r", resume_run_id=run, environment={}) == run
True
>>> second.close()
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timezone

import sqlalchemy as sa

from stabmon.sinks import RunRefusedError
from stabmon.store.database import StoreError
from stabmon.store.models import Base

log = logging.getLogger("stabmon.store")

_RUNS = Base.metadata.tables["runs"]
_OPEN: set[str] = set()  # owners of this process's stores that are not closed
_OPEN_LOCK = threading.Lock()


class RunInUseError(StoreError, RunRefusedError):
    """Another live process holds the run's lease."""


def _host() -> str:
    return socket.gethostname()[:64]


def _gone(owner: str) -> bool:
    """Whether the store that took lease ``owner`` (``host:pid:token``) is certainly gone: its process ended
    (on this host), or, in this process, it was closed."""
    parts = owner.split(":")
    if len(parts) < 3 or ":".join(parts[:-2]) != _host():
        return False
    try:
        pid = int(parts[-2])
    except ValueError:
        return False
    if pid == os.getpid():
        with _OPEN_LOCK:
            return owner not in _OPEN
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, owned by another user
        return False
    return False


def writer_gone(owner: str | None, until: float | None) -> bool:
    """Whether a run's writer is gone (killed, or its host lost): its lease ran out, or its holder ended on this
    host. A run without a lease (written before leases existed) is never judged gone."""
    if owner is None:
        return False
    return (until is not None and until < time.time()) or _gone(owner)


class RunLease:
    """The leases one store holds. ``claim`` runs on the caller's thread; ``renew`` on the writer's."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.owner = f"{_host()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.runs: set[str] = set()
        self._renewed = 0.0
        with _OPEN_LOCK:
            _OPEN.add(self.owner)

    def row(self) -> dict[str, object]:
        """The lease columns of a new run's row: held by this store from the start."""
        return {"lease_owner": self.owner, "lease_until": time.time() + self.ttl}

    def hold(self, run_id: str) -> None:
        self.runs.add(run_id)

    def claim(self, engine: sa.Engine, run_id: str) -> None:
        """Take ``run_id``'s lease, or raise :class:`RunInUseError`. A run the database does not hold (yet)
        has no lease to take: it is held from its first row on."""
        with engine.begin() as conn:
            if self._take(conn, run_id, free=sa.or_(_RUNS.c.lease_owner.is_(None),
                                                    _RUNS.c.lease_until < time.time(),
                                                    _RUNS.c.lease_owner == self.owner)):
                self.hold(run_id)
                return
            found = conn.execute(sa.select(_RUNS.c.lease_owner, _RUNS.c.lease_until)
                                 .where(_RUNS.c.id == run_id)).first()
            if found is None:
                self.hold(run_id)
                return
            holder, until = found
            if holder is not None and _gone(holder) and self._take(conn, run_id, free=_RUNS.c.lease_owner == holder):
                log.warning("stabmon store: run %s's previous writer (%s) is gone; taking the run over", run_id,
                            _who(holder))
                self.hold(run_id)
                return
        raise RunInUseError(
            f"run {run_id} is being written by another process ({_who(holder)}, lease until {_when(until)}); "
            f"a second writer would lose rows, so it is refused: resume it once that process ends (its lease "
            f"ends with it, or {self.ttl:g} s after it dies on another host)"
        )

    def _take(self, conn: sa.Connection, run_id: str, *, free: sa.ColumnElement[bool]) -> bool:
        values = {"lease_owner": self.owner, "lease_until": time.time() + self.ttl}
        done: sa.CursorResult = conn.execute(  # type: ignore[assignment]
            sa.update(_RUNS).where(_RUNS.c.id == run_id, free).values(**values)
        )
        return done.rowcount == 1

    def renew(self, engine: sa.Engine) -> None:
        """Extend every lease this store holds, at most every ``ttl / 4`` seconds (writer thread)."""
        now = time.time()
        if not self.runs or now - self._renewed < self.ttl / 4:
            return
        held = sorted(self.runs)
        with engine.begin() as conn:
            conn.execute(sa.update(_RUNS).where(_RUNS.c.id.in_(held), _RUNS.c.lease_owner == self.owner)
                         .values(lease_until=now + self.ttl))
            lost = conn.execute(sa.select(_RUNS.c.id, _RUNS.c.lease_owner).where(
                _RUNS.c.id.in_(held), _RUNS.c.lease_owner.is_not(None), _RUNS.c.lease_owner != self.owner)).all()
        self._renewed = now
        for run_id, holder in lost:  # this store went unrenewed past ttl (stalled) and another took the run
            self.runs.discard(run_id)
            log.error("stabmon store: run %s was taken over by %s after this writer's lease ran out; both now write "
                      "it", run_id, _who(holder))

    def release(self, engine: sa.Engine) -> None:
        """Give up every lease this store still holds, where it still holds it (one that another writer took
        over after it ran out stays theirs)."""
        held, self.runs = sorted(self.runs), set()
        if held:
            with engine.begin() as conn:
                conn.execute(sa.update(_RUNS).where(_RUNS.c.id.in_(held), _RUNS.c.lease_owner == self.owner)
                             .values(lease_owner=None, lease_until=None))

    def close(self) -> None:
        with _OPEN_LOCK:
            _OPEN.discard(self.owner)


def _who(owner: str | None) -> str:
    """``host pid N`` of a lease owner (its token left out)."""
    if not owner:
        return "unknown"
    parts = owner.split(":")
    return f"{':'.join(parts[:-2])} pid {parts[-2]}" if len(parts) >= 3 else owner


def _when(until: float | None) -> str:
    if until is None:
        return "unknown"
    return datetime.fromtimestamp(until, timezone.utc).isoformat(timespec="seconds")
