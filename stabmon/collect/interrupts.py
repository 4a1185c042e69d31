"""Ctrl-C, SIGTERM and interpreter exit end the run with its data, not in the middle of it.

A run left without ``close()`` (the quick start's loop interrupted by Ctrl-C, a scheduler's SIGTERM, a script
that simply ends) would keep its unflushed steps in memory and its status ``running`` forever.
:class:`ExitGuard` prevents both:

- SIGTERM: when the process still has Python's default handler (it would die on the spot, running no
  ``finally`` block), the guard installs one that raises ``SystemExit(128 + SIGTERM)`` in the main thread, so
  the loop unwinds like on Ctrl-C (``KeyboardInterrupt``): ``with Monitor(...)`` blocks and ``finally`` clauses
  run. A handler the user or a framework installed is left alone.
- interpreter exit: an ``atexit`` callback flushes and closes a monitor that was not closed, with the run status
  ``interrupted`` (after Ctrl-C, SIGTERM, or a script that ended without ``close()``).

``close()`` releases both. Only the main thread can install signal handlers; elsewhere only ``atexit`` is used.

>>> closed = []
>>> guard = ExitGuard(lambda status: closed.append(status))
>>> guard.release(); guard.fire()  # released: exit no longer closes anything
>>> closed
[]
"""

from __future__ import annotations

import atexit
import signal
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

INTERRUPTED = "interrupted"
"""Run status of a run ended by Ctrl-C, SIGTERM, or a process exit without ``close()``."""


class ExitGuard:
    """Closes a run at interpreter exit if nobody did, and turns SIGTERM into an unwinding ``SystemExit``."""

    def __init__(self, close: Callable[[str], None], *, sigterm: bool = True) -> None:
        self._close: Callable[[str], None] | None = close
        self._previous: Any = None
        self._installed = False
        self._atexit = _fire_later(weakref.ref(self))
        atexit.register(self._atexit)
        if sigterm and threading.current_thread() is threading.main_thread():
            self._install()

    def _install(self) -> None:
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return  # somebody else's handler: theirs decides
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        except (ValueError, OSError):  # not the main interpreter, or a platform without SIGTERM
            self._installed = False

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    def fire(self) -> None:
        """Close the run now as ``interrupted`` (idempotent); ``atexit`` calls it."""
        close, self._close = self._close, None
        self.release()
        if close is not None:
            close(INTERRUPTED)

    def release(self) -> None:
        """The run was closed by its owner: undo the signal handler and the exit callback."""
        self._close = None
        atexit.unregister(self._atexit)
        if self._installed:
            self._installed = False
            try:
                if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                    signal.signal(signal.SIGTERM, self._previous)
            except (ValueError, OSError):
                pass


def _fire_later(ref: weakref.ref[ExitGuard]) -> Callable[[], None]:
    """The exit callback holds the guard weakly: a monitor that was dropped is not kept alive by it."""

    def fire() -> None:
        guard = ref()
        if guard is not None:
            guard.fire()

    return fire
