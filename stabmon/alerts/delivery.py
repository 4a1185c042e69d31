"""Sending alerts through apprise, one background thread per channel, with a timeout and retries.

Each channel has its own FIFO queue and thread, so a hanging webhook delays only its own channel, and a
channel's alerts arrive in order (a PagerDuty ``resolve`` never overtakes its ``trigger``). ``submit`` only
appends to a deque under a lock the thread holds for a few instructions: the caller never waits for the
network. Failed attempts back off exponentially (``backoff_initial * 2**(n-1)``, capped at ``backoff_max``) up
to ``max_attempts``; every attempt updates the alert's row through the recorder.

Every alert gets exactly one final status (``sent``, ``failed`` or ``abandoned``), recorded before the notifier's
``close()`` returns, so it lands in the store before the store closes: an attempt still waiting on a hung
endpoint at the close deadline is recorded ``abandoned`` by ``close()`` itself, and what that attempt reports
later is only logged (the store may be closed by then; before, its late write was dropped and the alert stayed
``retrying``).

PagerDuty goes through apprise's ``pagerduty://`` plugin, which speaks Events v2 and accepts ``action`` and
``dedup`` URL parameters: each send adds ``action=trigger|resolve``, ``dedup=<incident key>`` and the alert's
``severity`` (unless the URL sets one) to the configured URL.

>>> ch = Channel(ChannelConfig.parse("json://127.0.0.1:9/hook"), timeout=0.5)
>>> ch.name
'json://127.0.0.1:9/***'
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import apprise

from stabmon.alerts.config import AlertsConfig, ChannelConfig, join_query, query_key, split_query
from stabmon.alerts.message import Alert
from stabmon.alerts.pagerduty import plugin_speaks_dedup, send_events_v2
from stabmon.alerts.record import AlertRecorder
from stabmon.alerts.redact import install_log_scrubber, redact, register_secrets, scrub
from stabmon.alerts.routing import RESOLVE
from stabmon.events import Severity

log = logging.getLogger("stabmon.alerts")

_NOTIFY_TYPE = {
    Severity.INFO: apprise.NotifyType.INFO,
    Severity.WARNING: apprise.NotifyType.WARNING,
    Severity.ERROR: apprise.NotifyType.FAILURE,
    Severity.CRITICAL: apprise.NotifyType.FAILURE,
}


class _ThreadCapture(logging.Handler):
    """Collects apprise's warnings raised on one thread (apprise reports HTTP errors only through its log)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.thread = threading.get_ident()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:
            self.messages.append(record.getMessage())


class Channel:
    """One apprise destination. ``name`` (the redacted URL unless configured) is what logs and rows show."""

    def __init__(self, config: ChannelConfig, *, timeout: float, path: str = "alerts.channels[0]") -> None:
        register_secrets(config.url)
        install_log_scrubber()
        if apprise.Apprise.instantiate(config.url) is None:
            raise ValueError(
                f"{path}.url: apprise cannot use {redact(config.url)} (unknown scheme or bad URL)"
            )
        self.config = config
        self.timeout = timeout
        self.name = config.name or redact(config.url)
        # apprise's own pagerduty:// plugin when it can carry dedup_key and resolve (stabmon.alerts.pagerduty)
        self.native_pagerduty = plugin_speaks_dedup()

    def url_for(self, alert: Alert | None, action: str) -> str:
        """The URL of one send: for PagerDuty, with the Events v2 action, dedup key and severity added."""
        if not self.config.is_pagerduty or alert is None:
            return self.config.url
        base, pieces = split_query(self.config.url)
        pieces = [p for p in pieces if query_key(p) not in ("action", "dedup")]
        keys = {query_key(p) for p in pieces}
        pieces += [
            f"action={'resolve' if action == RESOLVE else 'trigger'}",
            f"dedup={quote(alert.dedup_key, safe='')}",
        ]
        if "severity" not in keys:
            pieces.append(f"severity={alert.severity.value}")
        if "overflow" not in keys:
            pieces.append("overflow=truncate")  # Events v2 caps the summary at 1024 characters
        return join_query(base, pieces)

    def send(
        self, *, title: str, body: str, notify_type: Any, alert: Alert | None = None, action: str = "notify"
    ) -> tuple[bool, str | None]:
        """One delivery attempt: (delivered, scrubbed error)."""
        install_log_scrubber()  # again: a logger configured after this channel was built must not leak either
        capture = _ThreadCapture()
        apprise_log = logging.getLogger("apprise")
        apprise_log.addHandler(capture)
        try:
            plugin = apprise.Apprise.instantiate(self.url_for(alert, action))
            if plugin is None:
                return False, "apprise could not build the channel"
            plugin.socket_connect_timeout = self.timeout
            plugin.socket_read_timeout = self.timeout
            plugin.request_rate_per_sec = 0  # stabmon rate-limits per channel itself
            ok = bool(plugin.notify(body=body, title=title, notify_type=notify_type))
        except Exception as exc:  # noqa: BLE001 - any plugin failure is a failed attempt, never a crash
            return False, scrub(f"{type(exc).__name__}: {exc}")
        finally:
            apprise_log.removeHandler(capture)
        if ok:
            return True, None
        detail = " | ".join(dict.fromkeys(capture.messages)) or "delivery failed (apprise gave no detail)"
        return False, scrub(detail)[:2000]

    def send_alert(self, alert: Alert, action: str) -> tuple[bool, str | None]:
        if self.config.is_pagerduty and not self.native_pagerduty:
            return send_events_v2(
                self.config.url,
                alert=alert,
                action="resolve" if action == RESOLVE else "trigger",
                timeout=self.timeout,
            )
        notify_type = apprise.NotifyType.SUCCESS if alert.resolves else _NOTIFY_TYPE[alert.severity]
        return self.send(
            title=alert.title, body=alert.body, notify_type=notify_type, alert=alert, action=action
        )


@dataclass
class Job:
    alert: Alert
    action: str
    alert_id: str
    attempts: int = 0
    recorded: bool = False
    settled: bool = False
    """Its final status is recorded; nothing more is written for it."""


class ChannelWorker:
    """The queue and delivery thread of one channel (module docstring)."""

    def __init__(
        self,
        channel: Channel,
        config: AlertsConfig,
        recorder: AlertRecorder | None,
        counters: dict[str, int],
        count_lock: threading.Lock,
    ) -> None:
        self.channel = channel
        self.config = config
        self.recorder = recorder
        self.counters = counters
        self._count_lock = count_lock
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._record_lock = threading.Lock()  # one job's status writes in order; never held by submit()
        self._closing = False
        self._abort = False
        # Backoff waits on these events, not on _cond, so that submit() never wakes a retrying thread.
        self._close_requested = threading.Event()
        self._aborted = threading.Event()
        self._idle = False  # the thread waits for work: only then does submit() wake it
        self._thread: threading.Thread | None = None

    # -- training thread ------------------------------------------------------------------------------------
    def submit(self, job: Job) -> bool:
        """Queue ``job``; False (and nothing queued) when the queue is full or the worker is closed."""
        with self._cond:
            if self._closing or len(self._queue) >= self.config.queue_size:
                return False
            self._queue.append(job)
            if self._idle:
                self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"stabmon-alerts[{self.channel.name}]", daemon=True
                )
                self._thread.start()
        return True

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def wait_idle(self, deadline: float) -> bool:
        """Wait until every queued alert is sent, failed or abandoned, or ``deadline`` (monotonic) passes."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue, timeout=max(0.0, deadline - time.monotonic()))

    # -- closing --------------------------------------------------------------------------------------------
    def begin_close(self) -> None:
        with self._cond:
            self._closing = True
            self._close_requested.set()
            self._cond.notify_all()

    def join(self, deadline: float) -> bool:
        """Wait until the queue is drained or ``deadline`` (monotonic) passes; then abandon what is left."""
        thread = self._thread
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._abort = True
            self._aborted.set()
            self._close_requested.set()
            hung = thread is not None and thread.is_alive()
            inflight = self._queue[0] if hung and self._queue else None
            left = list(self._queue)[1:] if hung else list(self._queue)
            for job in left:
                self._queue.remove(job)
            self._cond.notify_all()
        if inflight is not None:
            self._settle(inflight, "abandoned", f"notifier closed while attempt {inflight.attempts + 1} was still "
                         "waiting for the endpoint (it may yet arrive)")
        for job in left:
            self._settle(job, "abandoned", "notifier closed before delivery")
        return not left and not hung

    # -- delivery thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._idle = True
                    self._cond.wait()
                    self._idle = False
                if not self._queue or self._abort:
                    return
                job = self._queue[0]
            try:
                self._deliver(job)
            except Exception:  # noqa: BLE001 - the delivery thread must survive anything
                log.exception("alert delivery to %s failed unexpectedly", self.channel.name)
                self._count("errors")
            with self._cond:
                if self._queue and self._queue[0] is job:
                    self._queue.popleft()
                self._cond.notify_all()

    def _deliver(self, job: Job) -> None:
        self._record_add(job)
        while True:
            ok, error = self.channel.send_alert(job.alert, job.action)
            job.attempts += 1
            if ok:
                self._settle(job, "sent", None)
                return
            if job.attempts >= self.config.max_attempts or self._abort:
                log.warning(
                    "alert to %s failed after %d attempts: %s", self.channel.name, job.attempts, error
                )
                self._settle(job, "abandoned" if self._abort else "failed", error)
                return
            if self._record_update(job, "retrying", error):
                self._count("retries")
            self._backoff(job.attempts)
            if self._abort:  # closed while waiting to retry
                self._settle(job, "abandoned", error)
                return

    def _backoff(self, attempts: int) -> None:
        delay = min(self.config.backoff_max, self.config.backoff_initial * 2.0 ** min(attempts - 1, 60))
        if self._closing:  # draining: keep retrying, but do not sit out long backoffs
            self._aborted.wait(min(delay, self.config.backoff_initial))
        else:  # close() cuts a long backoff short; submit() does not touch it
            self._close_requested.wait(delay)

    def _record_add(self, job: Job) -> bool:
        """Create the alert's row (retried before each update until it succeeds, e.g. when the run's own row
        was not yet committed by the store's writer)."""
        if self.recorder is None or job.recorded:
            return job.recorded
        a = job.alert
        try:
            self.recorder.add_alert(
                alert_id=job.alert_id,
                run_id=a.run_id,
                channel=self.channel.name,
                severity=a.severity.value,
                status="queued",
                dedup_key=a.dedup_key,
                incident_id=(a.incident_id or a.incident_key)[:64],
                event_id=a.event_id,
                title=scrub(a.title),
            )
            job.recorded = True
        except Exception:  # noqa: BLE001 - recording must not stop delivery
            log.exception("recording alert for %s failed", self.channel.name)
            self._count("record_errors")
        return job.recorded

    def _settle(self, job: Job, status: str, error: str | None) -> None:
        """Record and count the job's final status, unless it has one already (close() settled an attempt that
        then returned: its outcome is only logged)."""
        if self._record_update(job, status, error, final=True):
            self._count(status)
        else:
            log.warning("alert to %s: %s after close() had recorded it abandoned", self.channel.name, status)

    def _record_update(self, job: Job, status: str, error: str | None, *, final: bool = False) -> bool:
        """Record the job's status (a ``final`` one once); False when it was settled already. Under a lock of its
        own (not the queue's, which submit() takes), so a late update can never follow the final one."""
        with self._record_lock:
            if job.settled:
                return False
            job.settled = final
            if self.recorder is None or not self._record_add(job):
                return True
            try:
                self.recorder.update_alert(
                    alert_id=job.alert_id, status=status, attempts=job.attempts, error=error
                )
            except Exception:  # noqa: BLE001 - recording must not stop delivery
                log.exception("recording alert status for %s failed", self.channel.name)
                self._count("record_errors")
        return True

    def _count(self, name: str) -> None:
        with self._count_lock:
            self.counters[name] = self.counters.get(name, 0) + 1
