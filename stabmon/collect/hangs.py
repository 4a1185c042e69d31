"""What the monitor does when its hang watchdog fires: record it where someone will see it, then optionally
end the process so the scheduler restarts the job.

Rank 0 publishes the hang anomaly (every thread's stack in its message) to the store and the alert channels
like any other event, from the watchdog thread but never at the same time as the training thread
(:meth:`stabmon.collect.flushing.Flusher.publish_from_thread`). Another rank has no store of its own during
training (only rank 0 writes), so a hung rank k opens the monitor's store at that moment, writes its own
anomaly into the same run, and closes it again: the stuck rank is often not rank 0, and its stacks are the
ones that say why. With ``exit_code`` set, the reporter waits (bounded) until the anomaly is written and the
alerts are sent, then calls ``os._exit``: a hung process cannot be asked to return from its training loop.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stabmon.collect.cluster.hang_alarm import PeerAlarm
from stabmon.collect.config import MonitorConfig
from stabmon.detect.hang import HangWatchdog
from stabmon.events import Anomaly, Severity

SILENT = "no hang report"
"""What rank 0 says of a rank that did not report its hang (:func:`stabmon.runbook.hangs.hang_summary` reads it)."""

log = logging.getLogger(__name__)


@dataclass
class LoopActivity:
    """What the training loop is doing besides steps, written by the training thread and read by the watchdog's:
    the pauses it declared (``monitor.paused(...)``, innermost last) and whether its ``steps()`` loop has ended.

    >>> activity = LoopActivity()
    >>> activity.quiet() is None
    True
    >>> activity.pauses.append("eval"); activity.quiet()
    "paused for 'eval'"
    """

    pauses: list[str] = field(default_factory=list)
    ended: bool = False

    def quiet(self) -> str | None:
        """Why no step for a while is not a hang now; None: it is."""
        if self.pauses:
            return f"paused for {self.pauses[-1]!r}"
        if self.ended:
            return "the training loop has ended"
        return None


def write_last_words(drain: Callable[[], Any], outbox: Any, failsafe: Any) -> None:
    """Before a hang exit, on the watchdog thread (the training thread is stuck): the steps waiting in the
    buffer (``drain``) go to the store as recorded (the pipeline is not run) and the run is marked ``hung``. The
    read-back is bounded: a hung device may never answer."""
    records = failsafe.call_within("collect", drain, timeout=10.0) or []
    outbox.write_steps(records)
    outbox.mark("hung")


@dataclass
class HangReporter:
    """The watchdog's callback; see the module docstring.

    >>> seen, exits = [], []
    >>> report = HangReporter(rank=0, publish=seen.extend, settle=lambda: None, exit_code=87, exit=exits.append)
    >>> from stabmon.events import Anomaly, Severity
    >>> report(Anomaly(kind="hang", metric="step", step=3, score=9.0, severity=Severity.ERROR, detector="hang"))
    >>> [a.step for a in seen], exits
    ([3], [87])
    """

    rank: int
    publish: Callable[[list[Anomaly]], None]
    """Rank 0: to the store and the notifier (serialized with the training thread's flushes)."""
    settle: Callable[[], None]
    """Wait (bounded) until what was published is written and sent; called before exiting."""
    open_store: Callable[[], tuple[Any, bool]] = field(default=lambda: (None, False))
    """Other ranks: ``(store, owned)`` opened now, or ``(None, False)``."""
    run_id: Callable[[], str] = field(default=lambda: "")
    run_name: str = ""
    exit_code: int | None = None
    exit: Callable[[int], Any] = os._exit
    quiet: Callable[[], str | None] = field(default=lambda: None)
    """Why no step for a while is not a hang now (the loop declared a pause, or it has ended); None: it is."""
    last_words: Callable[[], None] = field(default=lambda: None)
    """Before a hang exit: store the steps still waiting and mark the run (bounded)."""
    alarm: PeerAlarm | None = None
    """Under torch.distributed: tells every rank to report its own stacks now, and counts the reports."""
    gather: float = 15.0
    """Seconds to wait, before exiting, for every rank's report (the first exit makes torchrun stop the rest)."""
    name_silent_after: float = 6.0
    """Rank 0: seconds after its own report (three polls of the peers' watchdogs) to name the ranks that have not
    reported: stopped, frozen or dead, the ones the others wait for."""
    linger: float = 2.0
    """Seconds a rank not waiting in a collective waits after every report, so that the others exit first."""
    exit_at_shutdown: Callable[[int], Any] = field(default=lambda code: atexit.register(os._exit, code))

    def __call__(self, anomaly: Anomaly) -> None:
        why = self.quiet()
        if why is not None:
            log.info("stabmon: rank %d: no step for %.3g s, but %s: not a hang", self.rank, anomaly.score, why)
            return
        log.error("stabmon: rank %d: %s", self.rank, anomaly.message)
        if self.alarm is not None:
            self.alarm.ring(rank=self.rank)
            if self.exit_code is not None:
                # a peer exiting first breaks this rank's collective: the main thread then raises and the
                # interpreter shuts down before this thread exits; the exit code must still say "hung"
                self.exit_at_shutdown(self.exit_code)
        if self.rank == 0:
            self.publish([anomaly])
        else:
            self._write_from_this_rank(anomaly)
        self._wait_for_peers(anomaly)
        if self.exit_code is None:
            return
        self.last_words()
        self.settle()
        log.error("stabmon: rank %d is hung; exiting with code %d so the job can be restarted", self.rank,
                  self.exit_code)
        for handler in logging.getLogger().handlers:
            handler.flush()
        self.exit(self.exit_code)

    def _wait_for_peers(self, anomaly: Anomaly) -> None:
        """Count this report; before exiting, give every other rank the time to store its own. A rank whose main
        thread is not in a collective then lingers a moment: the ranks waiting in one exit first, since any
        exit breaks their collective (their main thread would raise and end the process with another code)."""
        if self.alarm is None:
            return
        self.alarm.reported(rank=self.rank)
        if self.rank == 0:
            self._name_silent(anomaly)
        if self.exit_code is None:
            return
        if not self.alarm.wait_for_all(timeout=self.gather):
            log.error("stabmon: rank %d: not every rank reported its hang within %.0f s", self.rank, self.gather)
        from stabmon.runbook.hangs import in_collective, main_stack

        if not in_collective(main_stack(anomaly.message)):
            time.sleep(self.linger)

    def _name_silent(self, anomaly: Anomaly) -> None:
        """Rank 0: the ranks with no report soon after the alarm, as hang reports of their own (a stopped or
        frozen process cannot write one; :func:`stabmon.runbook.hangs.hang_summary` names it the culprit)."""
        assert self.alarm is not None
        if self.alarm.wait_for_all(timeout=self.name_silent_after):
            return
        silent = self.alarm.silent()
        if not silent:
            return
        log.error("stabmon: rank(s) %s sent no hang report within %.0f s of the alarm: stopped, frozen or dead",
                  ", ".join(map(str, silent)), self.name_silent_after)
        self.publish([Anomaly(kind="hang", metric="step", step=anomaly.step, score=anomaly.score,
                              severity=Severity.ERROR, detector="hang", threshold=anomaly.threshold,
                              message=f"rank {rank}: {SILENT} within {self.name_silent_after:.0f} s of rank 0's "
                                      f"alarm: stopped, frozen or dead (rank 0 waited since step {anomaly.step})")
                      for rank in silent])

    def _write_from_this_rank(self, anomaly: Anomaly) -> None:
        try:
            store, owned = self.open_store()
            if store is None:
                return
            run_id = store.start_run(name=self.run_name, resume_run_id=self.run_id(), environment={}, join=True)
            store.write_events(run_id=run_id, events=[anomaly])
            store.flush(timeout=30.0)
            if owned:
                store.close()
        except Exception:  # noqa: BLE001 - the log line above already holds the stacks
            log.exception("stabmon: rank %d could not store its hang report", self.rank)


def start_watchdog(config: MonitorConfig, reporter: HangReporter, *, label: str = "") -> HangWatchdog:
    """A started :class:`~stabmon.detect.hang.HangWatchdog` configured by ``config.hang_timeout`` and
    ``config.hang``, reporting through ``reporter``."""
    h = config.hang
    dog = HangWatchdog(config.hang_timeout or 0.0, reporter, factor=h.factor, floor=h.floor,
                       learn_after=h.learn_after, window=h.window, warmup=h.warmup, stacks=h.stacks, label=label,
                       peer=reporter.alarm.rung if reporter.alarm is not None else None)
    dog.start()
    return dog
