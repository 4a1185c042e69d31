"""Live-only hang detection: no step has arrived for ``timeout`` seconds.

A hang cannot be seen in the metrics of the steps that did arrive, so it is not a :class:`~.base.Detector`;
the Monitor starts a :class:`HangWatchdog` thread, calls :meth:`HangWatchdog.beat` once per step and receives
an ``Anomaly(kind="hang")`` through its callback. BLOOM-176B sat in a hung evaluation for hours with nothing
in the log but the scheduler's heartbeat.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from stabmon.events import Anomaly, Severity

log = logging.getLogger(__name__)


class HangWatchdog:
    """Calls ``callback(Anomaly(kind="hang"))`` once when no :meth:`beat` came for ``timeout`` seconds.

    Re-armed by the next beat. The callback runs on the watchdog thread; exceptions in it are logged and
    counted (``errors``), never raised. ``clock`` is injectable for tests.

    >>> seen = []
    >>> dog = HangWatchdog(timeout=0.01, callback=seen.append, poll=0.005)
    >>> dog.start(); dog.beat(7)
    >>> _ = dog.fired.wait(5.0); dog.stop()
    >>> seen[0].kind, seen[0].step, seen[0].severity.value
    ('hang', 7, 'error')
    """

    def __init__(self, timeout: float, callback: Callable[[Anomaly], None], *, poll: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not timeout > 0:
            raise ValueError(f"detectors.hang.timeout must be > 0, got {timeout!r}")
        self.timeout = float(timeout)
        self.callback = callback
        self.poll = float(poll if poll is not None else min(self.timeout / 4, 5.0))
        self.clock = clock
        self.errors = 0
        self.fired = threading.Event()
        self._last = clock()
        self._step = -1
        self._armed = True
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def beat(self, step: int) -> None:
        """A step arrived."""
        with self._lock:
            self._last = self.clock()
            self._step = step
            self._armed = True

    def check(self) -> Anomaly | None:
        """One poll: the hang anomaly if the timeout passed since the last beat (once per hang)."""
        with self._lock:
            waited = self.clock() - self._last
            if not self._armed or waited < self.timeout:
                return None
            self._armed = False
            step = self._step
        return Anomaly(kind="hang", metric="step", step=step, score=waited, severity=Severity.ERROR,
                       detector="hang", evidence=((step, waited),), threshold=self.timeout,
                       message=f"no step for {waited:.0f} s after step {step}")

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
