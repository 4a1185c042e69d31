"""Humans' answers to proposals, read by the store's writer thread and handed to the training thread from
memory.

The training thread never waits on the database for an answer: :meth:`AnswerBox.take` only swaps a list.
:attr:`AnswerBox.live` says whether answers are being read right now (the last read succeeded recently); while
they are not, the monitor holds its proposals' approval clocks, so an answer given during an outage is not
outrun by an expiry.

>>> box = AnswerBox(poll_interval=0.0, stale_after=5.0)
>>> box.watch("run-1"); box.take("run-1"), box.live
([], False)
>>> box.wait(box.due_now("run-1"), timeout=0.01)  # nobody polls here
False
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

log = logging.getLogger("stabmon.store")


class AnswerBox:
    """Answers per run, filled by :meth:`poll` (writer thread), emptied by :meth:`take` (training thread)."""

    def __init__(self, *, poll_interval: float, stale_after: float) -> None:
        self.poll_interval = poll_interval
        self.stale_after = stale_after
        self._runs: dict[str, float] = {}  # run id -> next poll time
        self._got: dict[str, list[tuple[str, bool]]] = {}
        self._lock = threading.Condition()
        self._last_ok = -float("inf")
        self._reads = 0  # successful reads so far

    def due_now(self, run_id: str) -> int:
        """Make ``run_id`` due for a read at once; returns the read count to wait past (see :meth:`wait`)."""
        with self._lock:
            self._runs[run_id] = 0.0
            return self._reads

    def wait(self, reads: int, timeout: float) -> bool:
        """Block until a read after ``reads`` succeeded, or ``timeout`` passes (tests and the CLI only)."""
        with self._lock:
            return self._lock.wait_for(lambda: self._reads > reads, timeout)

    def watch(self, run_id: str) -> None:
        with self._lock:
            self._runs.setdefault(run_id, 0.0)

    def take(self, run_id: str) -> list[tuple[str, bool]]:
        """Answers read since the last call (no I/O)."""
        self.watch(run_id)
        with self._lock:
            return self._got.pop(run_id, [])

    @property
    def live(self) -> bool:
        """True when answers were read from the database within ``stale_after`` seconds."""
        return time.monotonic() - self._last_ok < self.stale_after

    def poll(self, engine: sa.Engine, stats: Any) -> None:
        """Writer thread: read new answers of every watched run that is due."""
        from stabmon.store.repo import take_answers

        now = time.monotonic()
        with self._lock:
            due = [r for r, t in self._runs.items() if now >= t]
        if not due:
            return
        try:
            with Session(engine) as s, s.begin():
                got = {r: take_answers(session=s, run_id=r) for r in due}
        except Exception:  # noqa: BLE001 - the writer must not die; the training thread is not waiting
            stats.poll_failures += 1
            log.exception("stabmon store: cannot read answers for %d run(s)", len(due))
            return
        with self._lock:
            for run_id, answers in got.items():
                self._runs[run_id] = now + self.poll_interval
                if answers:
                    self._got.setdefault(run_id, []).extend(answers)
            self._last_ok = time.monotonic()
            self._reads += 1
            self._lock.notify_all()
