"""The result type every importer returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from stabmon.events import StepRecord


@dataclass
class ImportResult:
    """Records read from one file, in step order, with an account of what could not be read.

    ``malformed`` counts lines (or rows) that looked like data but could not be parsed; ``problems`` keeps the first
    few as ``"<file>:<line>: <what>"`` strings. ``restarts`` lists the steps at which a later segment superseded an
    earlier one (a resume from an older checkpoint). ``events`` holds non-metric lines worth keeping
    (e.g. ``(line_no, "OVERFLOW ...")``, tracebacks, watchdog alerts) as (step or None, text).
    """

    format: str
    records: list[StepRecord]
    malformed: int = 0
    problems: list[str] = field(default_factory=list)
    restarts: list[int] = field(default_factory=list)
    events: list[tuple[int | None, str]] = field(default_factory=list)

    MAX_PROBLEMS = 20

    def problem(self, where: str, what: str) -> None:
        self.malformed += 1
        if len(self.problems) < self.MAX_PROBLEMS:
            self.problems.append(f"{where}: {what}")
