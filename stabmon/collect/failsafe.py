"""The failsafe around training-path I/O: catch, log with ``log.exception``, count per category, continue.

Store writes, alert delivery, checkpoint saves and the pipeline are all called through one :class:`Failsafe`
owned by the :class:`~stabmon.monitor.Monitor`; its ``errors`` counter is ``monitor.errors``. Only an explicit
stop (a runbook's checkpoint-and-stop, the kill switch, the hang watchdog's exit code) ends a run, or Ctrl-C and
SIGTERM: an error raised while one was being handled (``torch.save`` closing its writer on the way out) is the
interrupt, raised as such (:func:`~stabmon.checkpoints.interruption`), never a failure to carry on from.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import Counter
from collections.abc import Callable
from typing import Protocol, TypeVar

from stabmon.checkpoints import interruption

log = logging.getLogger(__name__)

T = TypeVar("T")


class Reported(Exception):
    """An error already said in the log, in one line, where it happened (a peer rank gone:
    :class:`~stabmon.collect.cluster.distributed.PeerLost`): the failsafe counts it and adds no traceback."""


class HasStep(Protocol):
    """Where the current step is read (:class:`~stabmon.collect.run_state.RunState`)."""

    step: int


class Failsafe:
    """Run callables that must never raise into training.

    >>> from stabmon.collect.run_state import RunState
    >>> safe = Failsafe(RunState(step=7))
    >>> safe.call("store", lambda: 1 / 0) is None, safe.call("store", lambda: 2), safe.errors["store"]
    (True, 2, 1)
    """

    def __init__(self, run: HasStep | None = None) -> None:
        self.errors: Counter[str] = Counter()
        """Failures per category (``store``, ``alerts``, ``pipeline``, ``checkpoint``, ``collect``, ...)."""
        self.run = run
        """Where the current step is read, for the log line (None: -1)."""

    def call(self, what: str, fn: Callable[[], T], *, let_through: tuple[type[Exception], ...] = ()) -> T | None:
        """``fn()``, or None after logging the exception and counting it under ``what``. Exceptions of the
        ``let_through`` types are raised (for the start of a run, before training: a refused run)."""
        handled = sys.exc_info()[1]  # an interrupt already on its way (a close from __exit__) is not a new one
        try:
            return fn()
        except let_through:
            raise
        except Exception as exc:  # noqa: BLE001 - never raise into training
            interrupt = interruption(exc, handled=handled)
            if interrupt is not None:  # Ctrl-C or SIGTERM that a library turned into an error: still a stop
                raise interrupt from None
            self.errors[what] += 1
            if not isinstance(exc, Reported):
                log.exception("stabmon: %s failed at step %d (continuing)", what, self._current_step())
            return None

    def call_within(self, what: str, fn: Callable[[], T], timeout: float) -> T | None:
        """:meth:`call` on a helper thread, given up (None, logged and counted) after ``timeout`` seconds: for
        work that may never return, like a read-back from a device that hung.

        >>> Failsafe().call_within("collect", lambda: 3, timeout=5.0)
        3
        """
        done: list[T | None] = []
        worker = threading.Thread(target=lambda: done.append(self.call(what, fn)), name=f"stabmon-{what}",
                                  daemon=True)
        worker.start()
        worker.join(timeout)
        if not done:
            self.errors[what] += 1
            log.error("stabmon: %s did not finish within %.3g s (given up)", what, timeout)
            return None
        return done[0]

    def _current_step(self) -> int:
        return -1 if self.run is None else self.run.step
