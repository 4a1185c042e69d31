"""The steps of one file being imported, in bounded memory.

An importer reads a log line by line and builds its steps out of order: a validation line updates a step
already seen, a resume from an older checkpoint supersedes every step from the restart on, a table may list a
step twice. :class:`StepTable` keeps those steps keyed by step. Up to ``hot_limit`` of them live in a dict;
past that the dict is moved into a private temporary SQLite file (deleted when the table is closed or
collected), so a 200 MB log costs a bounded amount of memory whatever its length. Reading back
(:meth:`StepTable.batches`) yields StepRecords in step order, a bounded batch at a time.

>>> t = StepTable(hot_limit=2)
>>> for s in (3, 1, 2, 5): t.merge(s, {"loss": float(s)})
>>> t.merge(1, {"lr": 0.1}); t.drop_from(5); len(t), t.spilled
(3, True)
>>> [(r.step, dict(r.metrics)) for b in t.batches(2) for r in b]
[(1, {'loss': 1.0, 'lr': 0.1}), (2, {'loss': 2.0}), (3, {'loss': 3.0})]
"""

from __future__ import annotations

import marshal
import sqlite3
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from stabmon.events import StepRecord

HOT_LIMIT = 50_000
"""Steps kept in memory before the table moves them to its temporary file."""


class _Keep:
    """The type of :data:`KEEP`."""


KEEP = _Keep()
"""``StepTable.merge(..., time=KEEP)``: leave the step's time as it is."""


@dataclass(slots=True)
class _Row:
    metrics: dict[str, float] = field(default_factory=dict)
    time: float | None = None


class StepTable:
    """Steps keyed by step number; every step is in exactly one place: the in-memory dict or the file."""

    def __init__(self, *, hot_limit: int | None = None) -> None:
        hot_limit = HOT_LIMIT if hot_limit is None else hot_limit
        if hot_limit < 1:
            raise ValueError(f"StepTable.hot_limit: must be at least 1, got {hot_limit}")
        self.hot_limit = hot_limit
        self._hot: dict[int, _Row] = {}
        self._db: sqlite3.Connection | None = None
        self._disk_rows = 0
        self._disk_max: int | None = None  # an upper bound of the steps in the file
        self.names_seen: dict[str, None] = {}
        """Every metric name ever put in, superseded steps' too (a superset of the names held)."""

    @property
    def spilled(self) -> bool:
        """Whether the table has used its temporary file."""
        return self._db is not None

    def __len__(self) -> int:
        return len(self._hot) + self._disk_rows

    def __contains__(self, step: int) -> bool:
        return step in self._hot or self._on_disk(step)

    def merge(self, step: int, metrics: Mapping[str, float], time: float | None | _Keep = KEEP) -> None:
        """Add ``metrics`` to the step (created if absent); a ``time`` given (None too) replaces the step's."""
        row = self._take(step)
        row.metrics.update(metrics)
        self.names_seen.update(dict.fromkeys(metrics))
        if not isinstance(time, _Keep):
            row.time = time
        self._after_insert()

    def put(self, step: int, metrics: Mapping[str, float], time: float | None = None) -> None:
        """Replace the step with exactly these metrics and time."""
        if step not in self._hot and self._on_disk(step):
            self._delete(step)
        self._hot[step] = _Row(dict(metrics), time)
        self.names_seen.update(dict.fromkeys(metrics))
        self._after_insert()

    def put_new(self, step: int, metrics: Mapping[str, float]) -> None:
        """Create the step with ``metrics`` unless it exists (``dict.setdefault``)."""
        if step not in self:
            self.put(step, metrics)

    def drop_from(self, step: int) -> None:
        """Forget every step >= ``step`` (a later segment supersedes them)."""
        for stale in [s for s in self._hot if s >= step]:
            del self._hot[stale]
        if self._db is not None and self._disk_max is not None and step <= self._disk_max:
            self._disk_rows -= self._db.execute("DELETE FROM steps WHERE step >= ?", (step,)).rowcount
            self._disk_max = step - 1

    def bounds(self) -> tuple[int | None, int | None]:
        """The lowest and the highest step held (None, None when empty)."""
        lo, hi = (min(self._hot), max(self._hot)) if self._hot else (None, None)
        if self._db is not None and self._disk_rows:
            dlo, dhi = self._db.execute("SELECT min(step), max(step) FROM steps").fetchone()
            lo, hi = (dlo, dhi) if lo is None or hi is None else (min(lo, dlo), max(hi, dhi))
        return lo, hi

    def batches(self, size: int) -> Iterator[list[StepRecord]]:
        """StepRecords in step order, at most ``size`` at a time."""
        batch: list[StepRecord] = []
        for step, row in self._rows():
            batch.append(StepRecord(step=step, metrics=row.metrics, time=row.time))
            if len(batch) >= size:
                yield batch
                batch = []
        if batch:
            yield batch

    def close(self) -> None:
        """Drop the temporary file (the table is empty afterwards)."""
        if self._db is not None:
            self._db.close()
        self._db, self._disk_rows, self._disk_max = None, 0, None
        self._hot.clear()

    def _rows(self) -> Iterator[tuple[int, _Row]]:
        if self._db is None:
            for step in sorted(self._hot):
                yield step, self._hot[step]
            return
        self._spill()
        cur = self._db.execute("SELECT step, row FROM steps ORDER BY step")
        while chunk := cur.fetchmany(1024):
            for step, blob in chunk:
                yield step, _Row(*marshal.loads(blob))

    def _take(self, step: int) -> _Row:
        """The step's row, in memory (brought back from the file, or created)."""
        row = self._hot.get(step)
        if row is None:
            row = self._load(step) if self._on_disk(step) else _Row()
            self._hot[step] = row
        return row

    def _on_disk(self, step: int) -> bool:
        if self._db is None or self._disk_max is None or step > self._disk_max:
            return False
        return self._db.execute("SELECT 1 FROM steps WHERE step = ?", (step,)).fetchone() is not None

    def _load(self, step: int) -> _Row:
        assert self._db is not None
        (blob,) = self._db.execute("SELECT row FROM steps WHERE step = ?", (step,)).fetchone()
        self._delete(step)
        return _Row(*marshal.loads(blob))

    def _delete(self, step: int) -> None:
        assert self._db is not None
        self._disk_rows -= self._db.execute("DELETE FROM steps WHERE step = ?", (step,)).rowcount

    def _after_insert(self) -> None:
        if len(self._hot) > self.hot_limit:
            self._spill()

    def _spill(self) -> None:
        if not self._hot:
            return
        if self._db is None:
            # "" opens a private temporary database on disk, removed when the connection closes
            self._db = sqlite3.connect("", check_same_thread=False)
            self._db.executescript("PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF;"
                                   "CREATE TABLE steps (step INTEGER PRIMARY KEY, row BLOB NOT NULL);")
        rows = ((s, marshal.dumps((r.metrics, r.time))) for s, r in self._hot.items())
        self._db.executemany("INSERT INTO steps VALUES (?, ?)", rows)
        top = max(self._hot)
        self._disk_max = top if self._disk_max is None else max(self._disk_max, top)
        self._disk_rows += len(self._hot)
        self._hot.clear()
