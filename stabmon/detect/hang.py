"""Live-only hang detection: no step has arrived within a deadline learned from the run's own step times.

A hang cannot be seen in the metrics of the steps that did arrive, so it is not a :class:`~.base.Detector`;
the Monitor starts a :class:`HangWatchdog` thread, calls :meth:`HangWatchdog.beat` once per step and receives
an ``Anomaly(kind="hang")`` through its callback. BLOOM-176B sat in a hung evaluation for hours with nothing
in the log but the scheduler's heartbeat.

The deadline is learned from the run's own step times. The first ``warmup`` steps are timed but not learned
(compilation, autotuning, the first batches); until ``learn_after`` steps after them have been timed the deadline
is ``timeout`` (the user's cap); from then on it is ``factor`` times the slowest step since the warm-up (or of the
last ``window`` steps), at least ``floor`` and at most ``timeout``. A run of 1-second steps is thus declared hung
after ``max(floor, 10 x 1 s)`` = 40 s with the defaults, not after the half hour a fixed timeout needs to be safe
for every run. Work outside the steps that the monitor sees (its own checkpoint saves, a framework's evaluation
and checkpoint: :meth:`HangWatchdog.outside`) is neither learned as a step nor judged by the step deadline: the
cap applies while it lasts. The anomaly's message carries every thread's stack (:func:`dump_stacks`, from
:mod:`faulthandler`), so the store and the alert say *where* the process is stuck.
"""

from __future__ import annotations

import faulthandler
import logging
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable

from stabmon.events import Anomaly, Severity

log = logging.getLogger(__name__)

POLL = 2.0
"""Seconds between two looks of the watchdog at most (a quarter of the floor when that is less): a hang is
reported within a poll of its deadline, and a peer's alarm is seen within one."""


def dump_stacks() -> str:
    """Every thread's Python stack, as :func:`faulthandler.dump_traceback` writes it (it needs a real file).

    >>> "dump_stacks" in dump_stacks()
    True
    """
    with tempfile.TemporaryFile(mode="w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.flush()
        f.seek(0)
        return f.read()


class HangWatchdog:
    """Calls ``callback(Anomaly(kind="hang"))`` once when no :meth:`beat` came within :meth:`deadline`.

    Re-armed by the next beat. The callback runs on the watchdog thread; exceptions in it are logged and
    counted (``errors``), never raised. ``clock`` is injectable for tests; ``stacks=False`` leaves the
    thread dump out of the message.

    >>> seen = []
    >>> dog = HangWatchdog(timeout=0.01, callback=seen.append, poll=0.005)
    >>> dog.start(); dog.beat(7)
    >>> _ = dog.fired.wait(5.0); dog.stop()
    >>> seen[0].kind, seen[0].step, seen[0].severity.value, "Thread" in seen[0].message
    ('hang', 7, 'error', True)
    """

    def __init__(self, timeout: float, callback: Callable[[Anomaly], None], *, poll: float | None = None,
                 clock: Callable[[], float] = time.monotonic, factor: float = 10.0, floor: float = 40.0,
                 learn_after: int = 20, window: int | None = None, warmup: int = 0, stacks: bool = True,
                 label: str = "", peer: Callable[[], bool] | None = None) -> None:
        if not timeout > 0:
            raise ValueError(f"hang timeout must be > 0, got {timeout!r}")
        self.timeout = float(timeout)
        self.callback = callback
        self.factor, self.floor, self.learn_after = float(factor), float(floor), int(learn_after)
        self.poll = float(poll if poll is not None else min(min(self.timeout, self.floor) / 4, POLL))
        self.clock = clock
        self.stacks = stacks
        self.label = label
        self.peer = peer  # a peer rank is hung (stabmon.collect.cluster.hang_alarm): report now, whatever the deadline
        self.errors = 0
        self.fired = threading.Event()
        self.warmup = int(warmup)
        self._durations: deque[float] = deque(maxlen=max(int(window), 1)) if window else deque(maxlen=1)
        """The learned step times: the last ``window``, or (no window) the slowest since the warm-up."""
        self._learned = 0  # steps learned since the warm-up
        self._timed = 0  # steps timed, warm-up included
        self._outside: list[str] = []  # work outside the steps now (innermost last)
        self._fresh = False  # the next interval started inside the last step: it is no whole step
        self._window = bool(window)
        self._last = clock()
        self._step = -1
        self._armed = True
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def beat(self, step: int, *, learn: bool = True) -> None:
        """A step arrived (``learn=False``: a sign of life that is not a step, e.g. inside a long
        evaluation; its interval does not enter the learned deadline)."""
        with self._lock:
            now = self.clock()
            if learn and self._step >= 0 and not self._fresh:
                self._timed += 1
                if self._timed > self.warmup:
                    self._learn(now - self._last)
            self._fresh = not learn
            self._last = now
            self._step = step if learn else self._step
            self._armed = True

    def _learn(self, seconds: float) -> None:
        self._learned += 1
        if self._window:
            self._durations.append(seconds)
        elif not self._durations or seconds > self._durations[0]:
            self._durations.append(seconds)

    def outside(self, what: str) -> None:
        """Work outside the steps begins (``what``: "checkpoint", "evaluation"): until :meth:`inside`, the
        deadline is ``timeout`` and the time is not learned as a step."""
        with self._lock:
            self._outside.append(what)
            self._last = self.clock()
            self._armed = True

    def inside(self, what: str) -> None:
        """The work :meth:`outside` announced has ended: the step deadline applies again from now."""
        with self._lock:
            if what in self._outside:
                self._outside.remove(what)
            self._last = self.clock()
            self._fresh = True  # the interval to the next beat is part of a step only
            self._armed = True

    def deadline(self) -> float:
        """Seconds without a beat that count as a hang (see the module docstring).

        >>> dog = HangWatchdog(timeout=600, callback=print, factor=5, floor=2, learn_after=3)
        >>> for t in range(4): dog._learn(0.5)
        >>> dog.deadline()
        2.5
        >>> dog.outside("checkpoint"); dog.deadline()
        600.0
        """
        if self._outside or self._learned < self.learn_after:
            return self.timeout
        return min(self.timeout, max(self.floor, self.factor * max(self._durations)))

    def _how(self, deadline: float) -> str:
        if self._outside:
            return f"deadline {deadline:.3g} s (the cap) while outside the steps: {self._outside[-1]}"
        if self._learned < self.learn_after:
            return f"deadline {deadline:.3g} s (the cap), not learned yet"
        which = f"of the last {len(self._durations)} steps" if self._window else f"of {self._learned} steps"
        return (f"deadline {deadline:.3g} s = max(floor {self.floor:.3g} s, {self.factor:g} x slowest {which} "
                f"{max(self._durations):.3g} s), at most {self.timeout:.3g} s")

    def check(self) -> Anomaly | None:
        """One poll: the hang anomaly if the deadline passed since the last beat (once per hang)."""
        with self._lock:
            waited = self.clock() - self._last
            deadline = self.deadline()
            if not self._armed:
                return None
            early = waited < deadline
        if early and not (self.peer is not None and self.peer()):  # the peer check may touch the network
            return None
        with self._lock:
            if not self._armed:
                return None
            self._armed = False
            step = self._step
        how = self._how(deadline)
        if early:
            how = f"a peer rank is hung: reported before this rank's {how}"
        message = f"{self.label}no step for {waited:.3g} s after step {step} ({how})"
        if self.stacks:
            message += "\n\nstacks of every thread:\n" + dump_stacks()
        return Anomaly(kind="hang", metric="step", step=step, score=waited, severity=Severity.ERROR,
                       detector="hang", evidence=((step, waited),), threshold=deadline, message=message)

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            anomaly = self.check()
            if anomaly is None:
                continue
            try:
                self.callback(anomaly)
            except Exception:
                self.errors += 1
                log.exception("hang watchdog callback failed")
            self.fired.set()

    def start(self) -> None:
        if self._thread is None:
            self._last = self.clock()
            self._thread = threading.Thread(target=self._run, name="stabmon-hang-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(self.poll * 4, 1.0))
            self._thread = None
