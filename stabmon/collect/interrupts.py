"""Ctrl-C, SIGTERM and interpreter exit end the run with its data, not in the middle of it.

A run left without ``close()`` (the quick start's loop interrupted by Ctrl-C, a scheduler's SIGTERM, a script
that simply ends) would keep its unflushed steps in memory and its status ``running`` forever.
:class:`ExitGuard` prevents both:

- SIGTERM: when the process still has Python's default handler (it would die on the spot, running no
  ``finally`` block), the guard installs one that raises ``SystemExit(128 + SIGTERM)`` in the main thread, so
  the loop unwinds like on Ctrl-C (``KeyboardInterrupt``): ``with Monitor(...)`` blocks and ``finally`` clauses
  run. A handler the user or a framework installed is left alone.
- interpreter exit: an ``atexit`` callback flushes and closes a monitor that was not closed, with the run status
  ``interrupted`` (after Ctrl-C, SIGTERM, or a script that ended without ``close()``). A SIGTERM during that
  close waits until its rows are stored (a second one does not), then ends the process as SIGTERM does: a
  launcher stopping the other ranks of a job whose rank failed (``torchrun``) no longer cuts the drain short.

``close()`` releases both. Only the main thread can install signal handlers; elsewhere only ``atexit`` is used.

>>> closed = []
>>> guard = ExitGuard(lambda status: closed.append(status))
>>> guard.release(); guard.fire()  # released: exit no longer closes anything
>>> closed
[]
"""

from __future__ import annotations

import _signal
import atexit
import os
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
        self._exiting = False
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
        if self._exiting:  # the interpreter is ending: no SystemExit to unwind into, the default action ends it
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise SystemExit(128 + signum)

    def fire(self) -> None:
        """Close the run now as ``interrupted`` (idempotent); ``atexit`` calls it. The SIGTERM handler stays
        while it closes, so that the close can hold a SIGTERM until the run's rows are stored."""
        close, self._close = self._close, None
        self._exiting = True
        self.disarm()
        try:
            if close is not None:
                close(INTERRUPTED)
        finally:
            self.release()

    def disarm(self) -> None:
        """The run is being closed: exit no longer closes it (its SIGTERM handler stays until :meth:`release`)."""
        self._close = None
        atexit.unregister(self._atexit)

    def release(self) -> None:
        """The run was closed by its owner: undo the signal handler and the exit callback."""
        self.disarm()
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


_HELD = (int(signal.SIGINT), int(signal.SIGTERM))

HOLD_AT_MOST_S = 5.0
"""How long a held Ctrl-C or SIGTERM waits at most (:class:`InterruptHold`): a step's update that takes longer
is interrupted where it is, as without the hold (schedulers send SIGKILL some 30 s after SIGTERM; the interrupt
checkpoint needs the rest)."""


class InterruptHold:
    """Ctrl-C and SIGTERM wait while held, then take effect as if they came just after :meth:`release`.

    What is held is a piece of work that must not be cut in two: a load of the training state, or a step from
    its ``optimizer.step()`` to its end (a step cut there would be checkpointed with the update half-applied,
    or counted with its scheduler not stepped). A second signal of the same kind does not wait, nor does one
    held longer than ``at_most_s`` (its timer sends it again). Only Python handlers can wait (the default
    SIGTERM handler ends the process at once anyway), and only in the main thread; elsewhere nothing is held.

    >>> hold = InterruptHold()
    >>> hold.hold(); hold.holding
    True
    >>> hold.release(), hold.holding
    ([], False)
    """

    def __init__(self, *, at_most_s: float | None = HOLD_AT_MOST_S) -> None:
        self.at_most_s = at_most_s
        self.holding = False
        self._previous: dict[int, Callable[[int, FrameType | None], Any]] = {}
        self._held: list[tuple[int, FrameType | None]] = []
        self._timer: threading.Timer | None = None

    def hold(self) -> None:
        if self.holding or threading.current_thread() is not threading.main_thread():
            return
        for sig in _HELD:  # the C functions: the signal module's wrappers build enums (~10 us a step)
            handler = _signal.getsignal(sig)
            if callable(handler):
                try:
                    _signal.signal(sig, self._hold)
                except (ValueError, OSError):
                    continue
                self._previous[sig] = handler
        self.holding = True

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        if any(s == signum for s, _ in self._held):  # the second one: now
            self._held.clear()
            self._previous[signum](signum, frame)
            return
        self._held.append((signum, frame))
        if self.at_most_s is not None and self._timer is None:
            main = threading.main_thread().ident
            assert main is not None
            # a real signal to the main thread (it wakes a blocking call there, as the first one did)
            self._timer = threading.Timer(self.at_most_s, signal.pthread_kill, args=(main, signum))
            self._timer.daemon = True
            self._timer.start()

    def release(self, *, deliver: bool = True) -> list[tuple[Callable[..., Any], int, FrameType | None]]:
        """Stop holding; with ``deliver`` the held signals take effect now (their handlers may raise), else they
        are returned, to be passed to :func:`deliver` once the caller's own work is done."""
        if not self.holding:
            return []
        self.holding = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for signum, handler in self._previous.items():
            try:
                _signal.signal(signum, handler)
            except (ValueError, OSError):
                pass
        held = [(self._previous[s], s, f) for s, f in self._held]
        self._previous, self._held = {}, []
        if deliver:
            deliver_held(held)
            return []
        return held


def deliver_held(held: list[tuple[Callable[..., Any], int, FrameType | None]]) -> None:
    """Call the handlers of signals :meth:`InterruptHold.release` kept back (the first that raises ends it)."""
    for handler, signum, frame in held:
        handler(signum, frame)
