"""Runbooks: what to do about anomalies, one intervention at a time.

:func:`load_runbook` loads and validates a YAML runbook (bundled name or path); :class:`Engine` is the pure
state machine that turns anomalies into decisions and judges their outcomes.
"""

from __future__ import annotations

from stabmon.runbook.engine import Engine
from stabmon.runbook.loader import (
    RunbookError,
    RunbookIssue,
    bundled_runbooks,
    load_runbook,
    loads_runbook,
)
from stabmon.runbook.schema import Runbook

__all__ = ["Engine", "Runbook", "RunbookError", "RunbookIssue", "bundled_runbooks", "load_runbook",
           "loads_runbook"]
