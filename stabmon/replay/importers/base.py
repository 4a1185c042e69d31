"""The result type every importer returns."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from stabmon.events import StepRecord
from stabmon.replay.importers.table import StepTable


class ImportResult:
    """Records read from one file, in step order, with an account of what could not be read.

    ``malformed`` counts lines (or rows) that looked like data but could not be parsed; ``problems`` keeps the first
    few as ``"<file>:<line>: <what>"`` strings. ``restarts`` lists the steps at which a later segment superseded an
    earlier one (a resume from an older checkpoint). ``events`` holds non-metric lines worth keeping
    (e.g. ``(line_no, "OVERFLOW ...")``, tracebacks, watchdog alerts) as (step or None, text): the first
    ``MAX_EVENTS`` of them; ``events_total`` counts them all.

    The records are either a list (``records=``) or an importer's :class:`StepTable` (``steps=``), which holds
    a large file's steps in a temporary file: :meth:`batches` and :meth:`metric_names` read it a bounded batch at
    a time, while ``records`` builds the whole list (for callers that want one).

    >>> r = ImportResult("csv", [StepRecord(1, {"loss": 2.0}), StepRecord(2, {"lr": 0.1})])
    >>> len(r), r.first_step, r.last_step, r.metric_names(), [len(b) for b in r.batches(1)]
    (2, 1, 2, ['loss', 'lr'], [1, 1])
    """

    MAX_PROBLEMS = 20
    MAX_EVENTS = 1000

    def __init__(
        self,
        format: str,
        records: list[StepRecord] | None = None,
        *,
        steps: StepTable | None = None,
    ) -> None:
        self.format = format
        self.malformed = 0
        self.problems: list[str] = []
        self.restarts: list[int] = []
        self.events: list[tuple[int | None, str]] = []
        self.events_total = 0
        self._records: list[StepRecord] | None = None if steps is not None else (records or [])
        self._steps = steps

    def __repr__(self) -> str:
        return (f"ImportResult(format={self.format!r}, records={len(self)}, malformed={self.malformed}, "
                f"restarts={len(self.restarts)}, events={self.events_total})")

    def problem(self, where: str, what: str) -> None:
        self.malformed += 1
        if len(self.problems) < self.MAX_PROBLEMS:
            self.problems.append(f"{where}: {what}")

    def event(self, step: int | None, text: str) -> None:
        self.events_total += 1
        if len(self.events) < self.MAX_EVENTS:
            self.events.append((step, text))

    @property
    def records(self) -> list[StepRecord]:
        """Every record as one list (built once from the importer's table, which is then released)."""
        if self._records is None:
            self._records = [r for b in self.batches(4096) for r in b]
            self._release()
        return self._records

    @records.setter
    def records(self, value: list[StepRecord]) -> None:
        self._release()
        self._records = value

    def batches(self, size: int) -> Iterator[list[StepRecord]]:
        """The records in step order, at most ``size`` at a time, without building the whole list."""
        if self._records is not None:
            for i in range(0, len(self._records), size):
                yield self._records[i : i + size]
        elif self._steps is not None:
            yield from self._steps.batches(size)

    def __len__(self) -> int:
        return len(self._records) if self._records is not None else len(self._steps or ())

    @property
    def first_step(self) -> int | None:
        if self._records is not None:
            return self._records[0].step if self._records else None
        return self._steps.bounds()[0] if self._steps is not None else None

    @property
    def last_step(self) -> int | None:
        if self._records is not None:
            return self._records[-1].step if self._records else None
        return self._steps.bounds()[1] if self._steps is not None else None

    def metric_names(self, keep: Callable[[str], bool] | None = None) -> list[str]:
        """Every metric name in the records (only those ``keep`` accepts, if given), sorted. With ``keep``, a
        table is read only when a name it was ever given passes."""
        if self._steps is not None and keep is not None and not any(map(keep, self._steps.names_seen)):
            return []
        names = {n for b in self.batches(4096) for r in b for n in r.metrics}
        return sorted(n for n in names if keep is None or keep(n))

    def close(self) -> None:
        """Release the importer's table (its temporary file); the records are gone unless already listed."""
        if self._records is None:
            self._records = []
        self._release()

    def _release(self) -> None:
        if self._steps is not None:
            self._steps.close()
        self._steps = None

    def __enter__(self) -> ImportResult:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
