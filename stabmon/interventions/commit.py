"""What a change leaves to do once it is committed: the rollback's checkpoint on its new timeline, the stop's
checkpoint.

A checkpoint that a change writes "so that a resume continues from here" must hold the change itself: the
learning-rate cap the rollback rung set, the executor that can revert it and the engine that observes it. So
the change does not save while it is applied; it leaves a :class:`FollowUp`, and the flush of a live run
(:meth:`stabmon.collect.flushing.Flusher.flush`) runs the follow-ups once the change is whole: applied, told to
the engine, recorded, and followed by every rank. Each follow-up returns facts for the change's record (where the
checkpoint went, or why it could not be written); a follow-up that raises is caught and its failure becomes a
fact, never an exception into training.

>>> ups = FollowUps()
>>> ups.add("rollback", lambda: {"rolled_back_state": "ckpt-00000040.pt"})
>>> ups.claim("rec-1")
>>> ups.pending, ups.run(), ups.pending
(True, {'rec-1': {'rolled_back_state': 'ckpt-00000040.pt'}}, False)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

FOLLOW_UP_ERROR = "follow_up_error"
"""The fact a follow-up that raised leaves on its change's record."""


@dataclass
class FollowUp:
    """One thing to do after ``action`` is committed; ``record_id``: the record of the change it follows (None:
    a change made outside the executor, such as the kill switch's stop)."""

    action: str
    run: Callable[[], dict[str, Any]]
    record_id: str | None = None


class FollowUps:
    """The follow-ups of the changes of one flush, in the order the changes were made; see the module docstring."""

    def __init__(self) -> None:
        self._pending: list[FollowUp] = []

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    @property
    def actions(self) -> list[str]:
        """The actions whose follow-ups are pending, in order, each once."""
        return list(dict.fromkeys(f.action for f in self._pending))

    def add(self, action: str, run: Callable[[], dict[str, Any]]) -> None:
        """Leave ``run`` to do once ``action`` is committed."""
        self._pending.append(FollowUp(action, run))

    def claim(self, record_id: str) -> None:
        """The follow-ups left since the last claim belong to the change recorded as ``record_id``."""
        for follow_up in self._pending:
            if follow_up.record_id is None:
                follow_up.record_id = record_id

    def run(self) -> dict[str | None, dict[str, Any]]:
        """Do every pending follow-up, oldest first; their facts by the record they belong to."""
        pending, self._pending = self._pending, []
        facts: dict[str | None, dict[str, Any]] = {}
        for follow_up in pending:
            try:
                found = follow_up.run()
            except Exception as exc:  # noqa: BLE001 - the change stands; its record says what did not follow
                log.error("stabmon: after %s: %s: %s", follow_up.action, type(exc).__name__, exc)
                found = {FOLLOW_UP_ERROR: f"{type(exc).__name__}: {exc}"}
            facts.setdefault(follow_up.record_id, {}).update(found)
        return facts
