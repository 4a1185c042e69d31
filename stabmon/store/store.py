"""``Store``: the SQL implementation of :class:`stabmon.sinks.Sink`, with a background writer and a spool.

>>> import tempfile, os
>>> from stabmon.events import StepRecord
>>> store = open_store("sqlite:///" + os.path.join(tempfile.mkdtemp(), "s.db"))
>>> run = store.start_run(name="demo", environment={})
>>> store.write_steps(run_id=run, records=[StepRecord(step=0, metrics={"loss": 2.0})])
>>> store.flush(10.0), store.stats.rows_written
(True, 3)
>>> store.close()
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from stabmon.events import Anomaly, Decision, InterventionRecord, Outcome, StepRecord, new_id
from stabmon.sinks import LowVolumeEvent
from stabmon.store import repo
from stabmon.store.answers import AnswerBox
from stabmon.store.codec import encode
from stabmon.store.database import (
    StoreError,
    current_revision,
    is_down,
    is_memory,
    make_engine,
    require_schema,
    resolve_url,
    safe_url,
    sqlite_path,
    upgrade,
)
from stabmon.store.lease import RunInUseError, RunLease
from stabmon.store.limits import check_name, name_problem
from stabmon.store.spool import Spool, database_identity, orphans
from stabmon.store.writer import StoreStats, Writer

log = logging.getLogger("stabmon.store")

_EVENTS = (Anomaly, Decision, InterventionRecord, Outcome)


@dataclass
class StoreConfig:
    """How the background writer batches, retries and spools."""

    flush_interval: float = 0.25
    """Seconds the writer waits between batches (``flush()`` wakes it at once)."""
    batch_max_rows: int = 200_000
    """Most rows written in one transaction."""
    retry_initial: float = 0.5
    """First wait, in seconds, before retrying an unavailable database; doubles up to ``retry_max``."""
    retry_max: float = 30.0
    """Longest wait between retries."""
    spool_dir: str | None = None
    """Where batches go while the database is away. Default: ``stabmon-spool/`` beside a SQLite file, else in
    the working directory."""
    close_timeout: float = 30.0
    """Seconds ``close()`` waits for queued writes before leaving the rest in the spool."""
    poll_interval: float = 0.0
    """Least seconds between two reads of human answers (``poll_answers``) for one run; 0 reads every time
    the monitor asks (it asks once per flush)."""
    max_held_rows: int = 5_000_000
    """Rows kept in memory when neither the database nor the spool file can take them; beyond it rows are
    dropped and counted."""
    adopt_any: bool = False
    """Adopt every spool file left in the spool directory, whichever database it names (or none: an earlier
    release's), not only this database's (``stabmon db recover --any-database``: its user says where they go,
    after a database moved to another URL)."""
    fail_fast: bool = False
    """Raise at start-up when the database cannot be reached, instead of starting with the spool and
    connecting when the database comes."""
    lease_ttl: float = 60.0
    """Seconds a run's writer lease lasts unless renewed (the writer renews it every ``lease_ttl / 4``): how long
    a run whose writer died on another host stays refused to a second writer (see :mod:`stabmon.store.lease`)."""

    def __post_init__(self) -> None:
        if not self.poll_interval >= 0:
            raise ValueError(f"store.poll_interval must be >= 0, got {self.poll_interval!r}")
        for name in ("flush_interval", "retry_initial", "retry_max", "close_timeout", "lease_ttl"):
            if not getattr(self, name) > 0:
                raise ValueError(f"store.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("batch_max_rows", "max_held_rows"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"store.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.retry_max < self.retry_initial:
            raise ValueError(f"store.retry_max must be >= store.retry_initial, got {self.retry_max!r}")


def _writer_url(url: sa.URL) -> sa.URL:
    """SQLite: open the file read-write without creating it, so a vanished file is an error, not a new DB."""
    path = sqlite_path(url)
    if path is None:
        return url
    return url.set(database=f"file:{path.resolve()}", query={**url.query, "mode": "rw", "uri": "true"})


def open_store(url: str | None = None, *, config: StoreConfig | None = None) -> Store:
    """Open the store at ``url`` (default ``$STABMON_DB_URL``, else ``sqlite:///stabmon.db``).

    A SQLite file (or in-memory ``sqlite://``, meant for tests) without a schema is upgraded here; any other
    database must already be at the newest schema (``stabmon db upgrade --db URL``). Raises ``ValueError``
    with one line when the URL cannot be opened.
    """
    return Store(resolve_url(url), config=config)


class Store:
    """A :class:`stabmon.sinks.Sink` writing to SQL through a background writer; see :func:`open_store`."""

    def __init__(self, url: str, *, config: StoreConfig | None = None) -> None:
        self.config = config or StoreConfig()
        self.url = safe_url(url)
        try:
            u = make_url(url)
        except Exception as exc:  # noqa: BLE001
            raise StoreError(f"store: cannot open {safe_url(url)!r}: {exc}") from None
        path = sqlite_path(u)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        spool_dir = Path(self.config.spool_dir or ((path.parent if path else Path.cwd()) / "stabmon-spool"))
        ready = self._connect(u, path is not None)
        memory = is_memory(u)
        writer_engine = self.engine if memory else make_engine(_writer_url(u), pooled=path is None, probe=ready)
        stale = 10 * self.config.flush_interval + self.config.poll_interval + 1.0
        self.answers = AnswerBox(poll_interval=self.config.poll_interval, stale_after=stale)
        self.lease = RunLease(self.config.lease_ttl)
        database = database_identity(url)
        self._writer = Writer(
            writer_engine,
            Spool(spool_dir, database=database),
            config=self.config,
            adopted=orphans(spool_dir, database=database, any_database=self.config.adopt_any),
            ready=ready,
            answers=self.answers,
            lease=self.lease,
        )
        self._seq: dict[str, int] = {}
        self._seq_lock = threading.Lock()
        self._closed = False
        self._writer.start()

    def _connect(self, u: sa.URL, is_file: bool) -> bool:
        """Open the engine and check the schema; False when the database is down and we start spooling."""
        try:
            self.engine = make_engine(u)
            if (is_file or is_memory(u)) and current_revision(self.engine) is None:
                upgrade(self.engine)
            require_schema(self.engine)
            return True
        except StoreError as exc:
            if self.config.fail_fast or not is_down(exc):
                raise
            log.warning(
                "stabmon store: %s; training starts anyway, spooling until the database answers", exc
            )
        self.engine = make_engine(u, probe=False)
        return False

    @property
    def stats(self) -> StoreStats:
        """Writer counters: rows_written, batches_written, failures, spooled_rows, ... (see StoreStats)."""
        return self._writer.stats

    @property
    def spool_path(self) -> Path:
        return self._writer.spool.path

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session for the repository functions (reads and answers); committed on success."""
        with Session(self.engine) as s, s.begin():
            yield s

    # -- Sink ------------------------------------------------------------------------------------------------
    def start_run(
        self,
        *,
        name: str,
        kind: str = "live",
        config: Mapping[str, Any] | None = None,
        environment: Mapping[str, Any] | None = None,
        resume_run_id: str | None = None,
        parent_run_id: str | None = None,
        source: str | None = None,
        run_id: str | None = None,
        join: bool = False,
    ) -> str:
        """Create (or reopen) a run; the row is queued like everything else.

        ``environment=None`` records :func:`stabmon.environment.fingerprint` for live runs. ``parent_run_id``
        and ``source`` say what a replay or import came from; ``run_id`` chooses the id (default: a new one).
        Reopening claims the run's writer lease first and raises :class:`~stabmon.store.lease.RunInUseError`
        (one line) while another live process writes the run. ``join=True`` reopens a run another process holds,
        to add a few events of its own (another rank's hang report): no lease is taken, and its records are
        numbered by the clock, past the holder's.
        """
        if kind not in repo.RUN_KINDS:
            raise ValueError(f"store.start_run.kind must be one of {sorted(repo.RUN_KINDS)}, got {kind!r}")
        check_name("store.start_run.name", name)
        if environment is None and kind == "live":
            from stabmon.environment import fingerprint

            environment = fingerprint()
        rid = resume_run_id or run_id or new_id()
        if resume_run_id and not join:
            self._claim(rid)
        if not join:
            self.lease.hold(rid)
        row = {
            "id": rid,
            "name": name,
            "kind": kind,
            "status": "running",
            "started_at": time.time(),
            "ended_at": None,
            "config": encode(dict(config or {})),
            "environment": encode(dict(environment or {})),
            "parent_run_id": parent_run_id,
            "source": source,
            **(self.lease.row() if not join else {"lease_owner": None, "lease_until": None}),
        }
        self._writer.submit("run", row)
        self._seq[rid] = self._resume_seq(rid) if resume_run_id else 0
        if join:
            self._seq[rid] = max(self._seq[rid], time.time_ns() // 1000)
        if resume_run_id and not join:
            self._writer.submit("update", rid, {"status": "running", "ended_at": None})
        return rid

    def _claim(self, run_id: str) -> None:
        """Take a resumed run's lease (raises RunInUseError); a database that cannot be read is let be."""
        if not self._writer.ready:
            log.warning("stabmon store: resuming run %s while the database is away: its lease is not checked",
                        run_id)
            return
        try:
            self.lease.claim(self.engine, run_id)
        except RunInUseError:
            raise
        except Exception:  # noqa: BLE001 - the database may be away at resume; the run goes on
            log.exception("stabmon store: cannot claim run %s's lease", run_id)

    def _resume_seq(self, run_id: str) -> int:
        """The next sequence number of a resumed run: past every row in the database AND in the spools
        (rows a crashed or cut-off run left there are written later and must not collide)."""
        spooled = self._writer.spooled_seq(run_id)
        if not self._writer.ready:
            log.warning("stabmon store: resuming run %s while the database is away; numbering by the clock",
                        run_id)
            return max(spooled, time.time_ns() // 1000)
        try:
            with self.session() as s:
                return max(spooled, repo.next_seq(session=s, run_id=run_id))
        except Exception:  # noqa: BLE001 - the database may be away at resume; stay ordered anyway
            log.exception("stabmon store: cannot read run %s's last sequence number; using the clock", run_id)
            return max(spooled, time.time_ns() // 1000)

    def last_step(self, *, run_id: str) -> int | None:
        """The highest step ``run_id`` holds in the database (None: none, or the database cannot be read now;
        rows still queued or spooled are not counted). Reads at once: for the edges of a run, like a resume."""
        if not self._writer.ready:
            return None
        try:
            with self.session() as s:
                return repo.last_step(session=s, run_id=run_id)
        except Exception:  # noqa: BLE001 - a resume check must not stop a run the store cannot read
            log.exception("stabmon store: cannot read run %s's last step", run_id)
            return None

    def _next(self, run_id: str, n: int) -> int:
        with self._seq_lock:
            seq0 = self._seq.get(run_id, 0)
            self._seq[run_id] = seq0 + n
        return seq0

    def write_steps(self, *, run_id: str, records: Sequence[StepRecord]) -> None:
        """Queue StepRecords (their metrics mappings must not be mutated afterwards). A metric whose name the
        store cannot hold (:data:`~stabmon.store.limits.MAX_NAME`) is left out of its record, logged and
        counted in ``stats.bad_names``; the rest of the record is kept."""
        records = self._storable(records)
        if self._closed:
            self._after_close(sum(1 + len(r.metrics) for r in records))
        elif records:
            self._writer.submit("steps", run_id, self._next(run_id, len(records)), records)

    def _storable(self, records: Sequence[StepRecord]) -> Sequence[StepRecord]:
        bad = {n for r in records for n in r.metrics if name_problem("metric name", n)}
        if not bad:
            return records
        self.stats.bad_names += sum(n in bad for r in records for n in r.metrics)
        for n in bad:
            log.error("stabmon store: %s; that metric is not stored", name_problem("metric name", n))
        return [dataclasses.replace(r, metrics={k: v for k, v in r.metrics.items() if k not in bad}) for r in records]

    def write_events(self, *, run_id: str, events: Sequence[LowVolumeEvent]) -> None:
        good = [e for e in events if isinstance(e, _EVENTS)]
        if len(good) != len(events):
            log.error("stabmon store: ignoring %d non-event objects", len(events) - len(good))
        if self._closed:
            self._after_close(len(good))
        elif good:
            self._writer.submit("events", run_id, self._next(run_id, len(good)), good)

    def write_checkpoint(self, *, run_id: str, step: int, path: str, nbytes: int, valid: bool = True) -> None:
        row = {
            "id": new_id(),
            "run_id": run_id,
            "step": int(step),
            "path": str(path),
            "nbytes": int(nbytes),
            "valid": bool(valid),
            "created_at": time.time(),
        }
        self._writer.submit("checkpoint", row)

    def write_skipped_batches(self, *, run_id: str, step: int, batch_indices: Sequence[int]) -> None:
        if batch_indices:
            self._writer.submit("skipped", run_id, int(step), list(batch_indices))

    def poll_answers(self, *, run_id: str) -> list[tuple[str, bool]]:
        """Answers given with ``stabmon approve/reject`` that this run has not picked up yet.

        Never touches the database: the writer thread reads answers (every ``config.poll_interval`` seconds
        at most) and this hands over what it has read; :meth:`refresh_answers` asks for a read now. See
        :attr:`answers_live`."""
        return self.answers.take(run_id)

    def refresh_answers(self, *, run_id: str, timeout: float) -> bool:
        """Have the writer read ``run_id``'s answers now and wait up to ``timeout`` seconds for it (for tests
        and tools that answer and then step; the monitor never waits). True when the read happened."""
        reads = self.answers.due_now(run_id)
        self._writer.wake()
        return self.answers.wait(reads, timeout)

    @property
    def answers_live(self) -> bool:
        """False while answers cannot be read (database away, writer stuck): proposals should not expire."""
        return self.answers.live and not self._writer.backlog()

    def update_config(self, *, run_id: str, config: Mapping[str, Any]) -> None:
        """Replace the run's stored config (queued like every row)."""
        self._writer.submit("update", run_id, {"config": encode(dict(config))})

    def end_run(self, *, run_id: str, status: str) -> None:
        """Record the run's final status (its lease is given up at close())."""
        self._writer.submit("update", run_id, {"status": status, "ended_at": time.time()})

    # -- AlertRecorder: the notifier's delivery threads record their attempts through the writer ----------------
    def add_alert(self, *, alert_id: str, **fields: Any) -> None:
        """Queue the row of one alert to one channel: ``run_id``, ``channel`` (already redacted), ``severity``,
        ``status``, ``dedup_key``, ``incident_id``, ``event_id``, ``title`` (see
        :class:`~stabmon.alerts.record.AlertRecorder`)."""
        now = time.time()
        row = {"id": alert_id, "created_at": now, "updated_at": now, "attempts": 0, "error": None, **fields}
        self._submit_alert("alert", row)

    def update_alert(self, *, alert_id: str, status: str, attempts: int, error: str | None) -> None:
        """Queue an alert's new status after a delivery attempt."""
        values = {"status": status, "attempts": attempts, "error": error, "updated_at": time.time()}
        self._submit_alert("alert_update", alert_id, values)

    def _submit_alert(self, *item: Any) -> None:
        if self._closed:
            self._after_close(1)
        else:
            self._writer.submit(*item)

    def _after_close(self, rows: int) -> None:
        self.stats.dropped_rows += rows
        log.error("stabmon store: %d rows written after close() were dropped", rows)

    def flush(self, timeout: float | None = None) -> bool:
        return self._writer.wait(timeout)

    def close(self) -> None:
        """Drain the queue (up to ``config.close_timeout``), stop the writer, release the engines.

        Whatever the database has not taken by then stays in the spool file (counted in ``stats.kept_rows``),
        for the next store on this spool directory or ``stabmon db recover``; rows not even the spool can take
        are counted in ``stats.dropped_rows``. Both are logged."""
        if self._closed:
            return
        self._closed = True
        if self._writer.stop(self.config.close_timeout):
            self._release_leases()
        else:
            kept, dropped = self._writer.park()
            log.error(
                "stabmon store: closed with %d rows not in the database: %d kept in %s (written by the next "
                "store on that directory, or `stabmon db recover`), %d lost",
                kept + dropped,
                kept,
                self._writer.spool.path,
                dropped,
            )
        self.lease.close()
        self._writer.spool.close()
        self._writer.engine.dispose()
        self.engine.dispose()

    def _release_leases(self) -> None:
        """Free this store's runs for the next writer, once what it queued is written. A database that cannot
        be reached now keeps them until their lease runs out (or, on this host, at once: the process ends)."""
        try:
            self.lease.release(self.engine)
        except Exception:  # noqa: BLE001 - closing must not raise; the lease expires on its own
            log.warning("stabmon store: could not release the run lease at close (it expires in %g s)",
                        self.lease.ttl, exc_info=True)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
