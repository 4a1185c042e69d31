"""The background writer: drains the store's queue into batches, writes them, spools them when needed.

The training thread (and the notifier's delivery threads, for alert rows) only appends to a deque
(``submit``). This thread wakes every ``flush_interval`` seconds (or at once on ``flush``), turns what is queued
into one :class:`~stabmon.store.batch.Batch` and writes it in one transaction. When the database is
unavailable the batch, and every batch after it, goes to the spool file in order; the writer retries with
exponential backoff, replays the spool when the database answers again, and only then writes new batches
directly. A batch the database refuses for its content (not for being unreachable) is set aside in a
``rejected-*.jsonl`` file and counted, so one bad value cannot wedge the writer.

A store opened while its database is down starts with ``ready`` False: everything goes to the spool until the
schema check passes. At close, whatever the database has not taken (queued, held in memory, or in a write
that hangs) is put in the spool by :meth:`Writer.park`, to be replayed by the next store on that spool
directory or by ``stabmon db recover``; what not even the spool can take is counted in ``dropped_rows``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import sqlalchemy as sa

from stabmon.store.answers import AnswerBox
from stabmon.store.batch import Batch, NameCache, write_batch
from stabmon.store.codec import EVENT_TABLES, event_row
from stabmon.store.database import is_unavailable, require_schema
from stabmon.store.lease import RunLease
from stabmon.store.spool import Spool

log = logging.getLogger("stabmon.store")

@dataclass
class StoreStats:
    """Counters of the background writer. ``failures`` counts failed write attempts (outages and retries)."""

    rows_written: int = 0
    batches_written: int = 0
    failures: int = 0
    spooled_rows: int = 0
    spooled_batches: int = 0
    replayed_batches: int = 0
    rejected_batches: int = 0
    dropped_rows: int = 0
    poll_failures: int = 0
    quarantined_lines: int = 0
    bad_names: int = 0
    """Metric values left out because their name is longer than the store holds."""
    kept_rows: int = 0
    """Rows left in the spool by ``close()`` for the next store (or ``stabmon db recover``) to write."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Writer(threading.Thread):
    """One daemon thread per store. See the module docstring."""

    def __init__(
        self,
        engine: sa.Engine,
        spool: Spool,
        *,
        config: Any,
        adopted: list[Spool],
        ready: bool = True,
        answers: AnswerBox | None = None,
        lease: RunLease | None = None,
    ) -> None:
        super().__init__(name="stabmon-store-writer", daemon=True)
        self.engine, self.spool, self.cfg = engine, spool, config
        self.stats = StoreStats()
        self.queue: deque[tuple[Any, ...]] = deque()
        self._tickets = itertools.count(1)
        self._submit_lock = threading.Lock()
        self.issued = 0
        self.done = 0
        self._cond = threading.Condition()
        self._wake = threading.Event()
        self._stopping = False
        self._names = NameCache()
        self._adopted = adopted
        self._held: list[Batch] = []  # batches the spool file could not take either
        self._retry_at = 0.0
        self._backoff = config.retry_initial
        self.ready = ready  # False until the database answered the schema check once
        self.answers = answers
        self.lease = lease
        self._inflight: Batch | None = None
        self._parked = False

    # -- training thread -------------------------------------------------------------------------------------
    def submit(self, *item: Any) -> None:
        """Queue one item; O(1), never touches the database. Called from the training thread and from the
        notifier's delivery threads (alert rows), so tickets are taken and queued under one lock."""
        with self._submit_lock:
            t = next(self._tickets)
            self.queue.append((t, *item))
            self.issued = t

    def wake(self) -> None:
        """Have the writer thread look at its queue and its timers now, without waiting for its interval."""
        self._wake.set()

    def wait(self, timeout: float | None) -> bool:
        """Block until everything submitted so far is in the database, or ``timeout`` passes."""
        target = self.issued
        self._wake.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.done < target:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.05 if left is None else min(left, 0.05))
                self._wake.set()
        return True

    def stop(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` for the queue to reach the database, then stop the thread (a thread stuck in
        a write is left behind: it is a daemon, and :meth:`park` keeps its batch)."""
        ok = self.wait(timeout)
        self._stopping = True
        self._wake.set()
        self.join(timeout=1.0)
        return ok and not self.backlog()

    def spooled_seq(self, run_id: str) -> int:
        """One past the highest sequence number of ``run_id`` still waiting in a spool or in memory."""
        waiting = [b for sp in [*list(self._adopted), self.spool] for b in sp.read(quarantine=False)]
        waiting += list(self._held)
        return max((b.top_seq(run_id) for b in waiting), default=-1) + 1

    def park(self) -> tuple[int, int]:
        """After :meth:`stop`: put everything not in the database into the spool, from the calling thread.

        Returns ``(kept_rows, dropped_rows)``: rows now in the spool file (including those spooled earlier)
        and rows that not even the spool could take."""
        self._parked = True
        dropped0 = self.stats.dropped_rows
        inflight = self._inflight
        rest = ([inflight] if inflight is not None and all(b is not inflight for b in self._held) else [])
        rest += self._held
        self._held = []
        rest += [self._take() for _ in iter(lambda: bool(self.queue), False)]
        for batch in rest:
            self._spool(batch, hold=False)
        kept = sum(b.rows() for b in self.spool.read()) if self.spool.pending else 0
        self.stats.kept_rows = kept
        return kept, self.stats.dropped_rows - dropped0

    # -- writer thread ---------------------------------------------------------------------------------------
    def run(self) -> None:
        while not self._stopping and not self._parked:
            self._wake.wait(self.cfg.flush_interval)
            self._wake.clear()
            try:
                self.cycle()
            except Exception:  # noqa: BLE001 - the writer must not die
                log.exception("stabmon store writer: unexpected error")

    def cycle(self) -> None:
        """One round: retry the backlog if due, then write (or spool) what is queued."""
        if self.backlog() and time.monotonic() >= self._retry_at:
            self._replay_backlog()
        while self.queue and not self._parked:
            batch = self._take()
            if self.backlog():
                self._spool(batch)
            else:
                self._write_or_spool(batch)
        if self.answers is not None and not self.backlog() and not self._parked:
            self.answers.poll(self.engine, self.stats)
        if self.lease is not None and not self.backlog() and not self._parked:
            self._renew(self.lease)

    def _renew(self, lease: RunLease) -> None:
        try:
            lease.renew(self.engine)
        except Exception:  # noqa: BLE001 - a missed renewal is retried next cycle; the lease lasts ttl
            log.debug("stabmon store: cannot renew the run lease now", exc_info=True)

    def backlog(self) -> bool:
        return bool(not self.ready or self._adopted or self.spool.pending or self._held)

    def _take(self) -> Batch:
        batch = Batch(hi=0)
        rows = 0
        while self.queue and rows < self.cfg.batch_max_rows:
            item = self.queue.popleft()
            batch.hi = item[0]
            try:
                rows += _add(batch, item[1:])
            except Exception:  # noqa: BLE001 - a malformed item must not take the batch down
                self.stats.rejected_batches += 1
                log.exception("stabmon store: dropping a malformed %r item", item[1])
        return batch

    def _commit(self, batch: Batch, *, track: bool = True) -> None:
        self._inflight = batch if track else None
        try:
            with self.engine.begin() as conn:
                self._names.conn = conn
                write_batch(conn, batch, self._names)
        except BaseException:
            self._names.clear()
            raise
        finally:
            self._names.conn = None
            self._inflight = None
        if self._parked:  # close() gave up on this write and spooled the batch; the spool copy is harmless
            return
        self.stats.rows_written += batch.rows()
        self.stats.batches_written += 1

    def _write_or_spool(self, batch: Batch) -> None:
        try:
            self._commit(batch)
        except Exception as exc:  # noqa: BLE001 - classified below
            if not is_unavailable(exc):
                self._salvage(batch, exc)
                return
            else:
                self.stats.failures += 1
                log.exception(
                    "stabmon store: database unavailable; spooling to %s and retrying", self.spool.path
                )
                self._retry_at = time.monotonic() + self._backoff
                self._spool(batch)
            return
        self._mark_done(batch.hi)

    def _spool(self, batch: Batch, *, hold: bool = True) -> None:
        if self._parked and threading.current_thread() is self:
            return  # close() gave up on this thread's write and already spooled the batch
        if not self._held:
            try:
                self.spool.append(batch)
                self.stats.spooled_rows += batch.rows()
                self.stats.spooled_batches += 1
                return
            except Exception:  # noqa: BLE001
                log.exception(
                    "stabmon store: cannot write the spool file %s; holding in memory", self.spool.path
                )
        held_rows = sum(b.rows() for b in self._held)
        if not hold or held_rows + batch.rows() > self.cfg.max_held_rows:
            self.stats.dropped_rows += batch.rows()
            log.error("stabmon store: dropping %d rows (database and spool both unavailable)", batch.rows())
            self._mark_done(batch.hi)
            return
        self._held.append(batch)

    def _replay_backlog(self) -> None:
        try:
            if not self.ready:
                require_schema(self.engine)
                self.ready = True
                log.warning("stabmon store: database reachable; writing what was spooled since start-up")
            while self._adopted:
                self._replay(self._adopted[0], own=False)
                self._adopted.pop(0).close()
            if self.spool.pending:
                self._replay(self.spool, own=True)
            while self._held:
                self._write_held(self._held[0])
        except Exception as exc:  # noqa: BLE001
            self.stats.failures += 1
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, self.cfg.retry_max)
            if is_unavailable(exc):
                log.debug("stabmon store: still unavailable (%s); next retry in %.1fs", exc, self._backoff)
            else:
                log.error("stabmon store: cannot write the spooled batches (%s); next retry in %.1fs",
                          exc, self._backoff)
            return
        self._backoff = self.cfg.retry_initial
        log.warning("stabmon store: database reachable again; spooled batches written")

    def _write_held(self, batch: Batch) -> None:
        """Write the oldest batch kept in memory; one the database refuses for its content is set aside."""
        try:
            self._commit(batch)
        except Exception as exc:  # noqa: BLE001 - classified below
            if is_unavailable(exc):
                raise
            self._held.pop(0)
            self._salvage(batch, exc)
            return
        self._mark_done(self._held.pop(0).hi)

    def _replay(self, spool: Spool, *, own: bool) -> None:
        before = spool.quarantined
        batches = spool.read()
        self.stats.quarantined_lines += spool.quarantined - before
        if not own:
            for batch in batches:
                batch.hi = 0  # another process's queue tickets mean nothing to this store's flush()
        for batch in batches:
            try:
                self._commit(batch, track=False)
            except Exception as exc:  # noqa: BLE001
                if is_unavailable(exc):
                    raise
                self._salvage(batch, exc)
            self.stats.replayed_batches += 1
        spool.clear()
        if own and batches:
            self._mark_done(max(b.hi for b in batches))

    def _salvage(self, batch: Batch, exc: BaseException) -> None:
        """The database refused ``batch`` for its content: write its parts one by one, set aside bad ones."""
        parts = batch.split()
        if len(parts) <= 1:
            self._reject(batch, exc)
            return
        for i, part in enumerate(parts):
            try:
                self._commit(part)
            except Exception as part_exc:  # noqa: BLE001
                if is_unavailable(part_exc):
                    for rest in parts[i:]:
                        self._spool(rest)
                    return
                self._reject(part, part_exc)
        self._mark_done(batch.hi)

    def _reject(self, batch: Batch, exc: BaseException) -> None:
        self.stats.rejected_batches += 1
        path = self.spool.dir / f"rejected-{self.spool.path.stem.removeprefix('spool-')}.jsonl"
        log.error(
            "stabmon store: database refused a batch (%s: %s); kept in %s", type(exc).__name__, exc, path
        )
        try:
            self.spool.dir.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(batch.to_json() + "\n")
        except Exception:  # noqa: BLE001
            log.exception("stabmon store: cannot keep the rejected batch")
        self._mark_done(batch.hi)

    def _mark_done(self, hi: int) -> None:
        with self._cond:
            self.done = max(self.done, hi)
            self._cond.notify_all()


def _add(batch: Batch, item: tuple[Any, ...]) -> int:
    """Fold one queued item into ``batch``; return the rows it adds."""
    kind = item[0]
    if kind == "steps":
        _, run_id, seq0, records = item
        for i, r in enumerate(records):
            b, t = r.batch_index, r.time
            b, t = (None if b is None else int(b)), (None if t is None else float(t))
            batch.steps.append((run_id, seq0 + i, int(r.step), b, t, dict(r.metrics)))
        return sum(1 + len(r.metrics) for r in records)
    if kind == "events":
        _, run_id, seq0, events = item
        for i, ev in enumerate(events):
            batch.events.setdefault(EVENT_TABLES[type(ev)], []).append(
                event_row(ev, run_id=run_id, seq=seq0 + i)
            )
        return len(events)
    handlers: dict[str, Callable[[], None]] = {
        "run": lambda: batch.runs.append(item[1]),
        "update": lambda: batch.run_updates.append((item[1], item[2])),
        "checkpoint": lambda: batch.checkpoints.append(item[1]),
        "skipped": lambda: batch.skipped.extend((item[1], item[2], int(b)) for b in item[3]),
        "alert": lambda: batch.alerts.append(item[1]),
        "alert_update": lambda: batch.alert_updates.append((item[1], item[2])),
    }
    handlers[kind]()
    return 1
