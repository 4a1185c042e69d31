"""Live export of stabmon's signals and events over OTLP/HTTP (extra ``otel``), for the fleet's dashboards.

When ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, or the monitor is given
``otlp=`` (a URL, True, or an :class:`OtlpConfig`), the monitor builds an :class:`OtlpExporter` into its outbox
(:func:`exporter_for`). At each flush the outbox hands it the flushed step records and events: an append to an
in-memory queue, nothing else on the training thread. The exporter's own thread turns them into OpenTelemetry
instruments and exports one OTLP request per flush (at most one per ``OtlpConfig.interval`` seconds) with the
OpenTelemetry SDK. An endpoint that is down costs a counted drop (:attr:`OtlpExporter.drops`) and one log line.

The instruments mirror Megatron-LM's ``megatron.training.*`` ones (same types and units), so one dashboard serves
both (``dashboards/stabmon-fleet.json``); what each record and event becomes is
:mod:`stabmon.integrations.otel_metrics`. Every data point carries ``run.name``, ``run.id`` and ``rank``, so one
dashboard shows many runs. Only rank 0 exports (its records hold the values reduced across ranks) unless
``OtlpConfig(per_rank=True)``: then every rank exports its own records under its ``rank``.

>>> OtlpConfig(endpoint="http://collector:4318").url
'http://collector:4318/v1/metrics'
>>> check_otlp("collector:4318")
Traceback (most recent call last):
...
ValueError: otlp: expected None, True, False, an http(s):// URL or an OtlpConfig, got 'collector:4318'
>>> exporter_for(False, rank=0, run_name="doc") is None
True
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from stabmon.events import StepRecord
from stabmon.integrations.otel_metrics import Instruments

log = logging.getLogger(__name__)

ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
"""The standard variables, in the order they win: the first is the full URL, the second a base URL."""
DEFAULT_URL = "http://localhost:4318/v1/metrics"
SDK_LOGGER = "opentelemetry.exporter.otlp.proto.http.metric_exporter"
"""The SDK exporter's logger: its lines from the exporter's own thread become stabmon's one counted line."""

@dataclass(frozen=True)
class OtlpConfig:
    """Settings of the OTLP export (``Monitor(..., otlp=OtlpConfig(...))``); ``otlp="http://..."`` is
    ``OtlpConfig(endpoint=...)`` and ``otlp=True`` is ``OtlpConfig()``.

    >>> OtlpConfig(timeout=0).validate()
    Traceback (most recent call last):
    ...
    ValueError: otlp.timeout: must be a number > 0, got 0
    """

    endpoint: str | None = None
    """The OTLP/HTTP metrics URL; a URL with no path gets ``/v1/metrics``. None:
    ``$OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``, else ``$OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/metrics``, else
    ``http://localhost:4318/v1/metrics``."""
    per_rank: bool = False
    """Every rank exports its own records under its ``rank`` (False: rank 0 only, the reduced values)."""
    layers: bool = True
    """Export the per-module signals (``grad_norm/<module>``, ``act_rms/<module>``, ...) as ``stabmon.layer.*``."""
    interval: float = 1.0
    """At most one export per this many seconds (0: one per flush); what arrives between is folded in."""
    timeout: float = 5.0
    """Seconds one export may take, retries included (on the exporter's thread, never the training thread)."""
    close_timeout: float = 5.0
    """Seconds ``close()`` waits for the last export (none is tried while the endpoint is down)."""
    queue: int = 256
    """Flushes held while an export is under way; beyond, the oldest are dropped (counted)."""

    def validate(self) -> None:
        if self.endpoint is not None:
            _check_url("otlp.endpoint", self.endpoint)
        for name, value, least in (("interval", self.interval, ">= 0"), ("timeout", self.timeout, "> 0"),
                                   ("close_timeout", self.close_timeout, "> 0")):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or \
                    value < 0 or (value == 0 and least == "> 0"):
                raise ValueError(f"otlp.{name}: must be a number {least}, got {value!r}")
        if not isinstance(self.queue, int) or isinstance(self.queue, bool) or self.queue < 1:
            raise ValueError(f"otlp.queue: must be an int >= 1, got {self.queue!r}")

    @property
    def url(self) -> str:
        """The metrics URL in force (see :attr:`endpoint`)."""
        if self.endpoint is not None:
            return _signal_url(self.endpoint)
        full, base = (os.environ.get(name, "").strip() for name in ENDPOINT_ENV)
        if full:
            return full
        return base.rstrip("/") + "/v1/metrics" if base else DEFAULT_URL


def _signal_url(url: str) -> str:
    return url.rstrip("/") + "/v1/metrics" if urlsplit(url).path in ("", "/") else url


def _check_url(name: str, value: str) -> None:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{name}: expected an http(s):// URL, got {value!r}")


def check_otlp(value: Any) -> None:
    """A one-line ``ValueError`` naming ``otlp`` for a value :func:`exporter_for` cannot take."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, OtlpConfig):
        value.validate()
        return
    if isinstance(value, str):
        parts = urlsplit(value)
        if parts.scheme in ("http", "https") and parts.netloc:
            return
    raise ValueError(f"otlp: expected None, True, False, an http(s):// URL or an OtlpConfig, got {value!r}")


def config_of(value: Any) -> OtlpConfig | None:
    """The export ``otlp=`` asks for: None (the default) when one of :data:`ENDPOINT_ENV` is set and
    ``OTEL_SDK_DISABLED`` is not true; False: none; True: the defaults; a URL: that endpoint.

    >>> config_of("http://127.0.0.1:4318/").url, config_of(False)
    ('http://127.0.0.1:4318/v1/metrics', None)
    """
    check_otlp(value)
    if value is False:
        return None
    if value is None:
        if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return None
        return OtlpConfig() if any(os.environ.get(name, "").strip() for name in ENDPOINT_ENV) else None
    if value is True:
        return OtlpConfig()
    return value if isinstance(value, OtlpConfig) else OtlpConfig(endpoint=value)


def exporter_for(value: Any, *, rank: int, run_name: str) -> OtlpExporter | None:
    """The exporter ``otlp=`` asks for on this rank, or None: not asked, another rank than 0 without
    ``per_rank``, or the SDK is not installed (one warning line; training goes on without it)."""
    config = config_of(value)
    if config is None or (rank != 0 and not config.per_rank):
        return None
    try:
        return OtlpExporter(config, rank=rank, run_name=run_name)
    except ImportError as exc:
        log.warning("stabmon: OTLP export to %s is off: the OpenTelemetry SDK is not installed (%s; pip install "
                    "'stabmon[otel]')", config.url, exc)
        return None


class _Quiet(logging.Filter):
    """Takes the SDK exporter's lines logged from one thread (the exporter's) and keeps the last one."""

    def __init__(self) -> None:
        super().__init__()
        self.thread: int | None = None
        self.last = ""
        self.failing = False
        """A warning or error was taken since the export under way began (it is retrying, or failed)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread != self.thread:
            return True
        if record.levelno >= logging.WARNING and not self.failing:
            self.last, self.failing = reason(record.getMessage()), True
        return False


def reason(message: str) -> str:
    """The short reason in one of the SDK exporter's log lines.

    >>> reason("Transient error HTTPConnectionPool(host='h', port=1): Max retries exceeded (Caused by "
    ...        "NewConnectionError('...: [Errno 111] Connection refused')) encountered while exporting metrics "
    ...        "batch, retrying in 0.80s.")
    'Connection refused'
    >>> reason("Failed to export metrics batch code: 404, reason: Not Found")
    'Failed to export metrics batch code: 404, reason: Not Found'
    """
    errno = re.search(r"\[Errno -?\d+\] ([^\"')]+)", message)
    if errno:
        return errno.group(1).strip()
    message = re.sub(r" encountered while exporting .*$", "", message.removeprefix("Transient error "))
    return message if len(message) <= 160 else message[:157] + "..."


class OtlpExporter:
    """Exports what :meth:`steps` and :meth:`events` are fed on a thread of its own; see the module docstring.
    Nothing here raises into training or waits on the network, except :meth:`close`, bounded.

    >>> import http.server, threading
    >>> class Receiver(http.server.BaseHTTPRequestHandler):
    ...     def do_POST(self):
    ...         self.rfile.read(int(self.headers["Content-Length"])); self.send_response(200); self.end_headers()
    ...     def log_message(self, *args): pass
    >>> server = http.server.HTTPServer(("127.0.0.1", 0), Receiver)
    >>> threading.Thread(target=server.serve_forever, daemon=True).start()
    >>> exporter = OtlpExporter(OtlpConfig(endpoint=f"http://127.0.0.1:{server.server_port}", interval=0),
    ...                         rank=0, run_name="doc")
    >>> exporter.steps(run_id="r1", records=[StepRecord(step=0, metrics={"loss": 2.0, "step_time": 0.1})])
    >>> exporter.close(); server.shutdown()
    >>> exporter.exports, dict(exporter.drops)
    (1, {})
    """

    def __init__(self, config: OtlpConfig, *, rank: int, run_name: str) -> None:
        config.validate()
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter  # noqa: F401
        from opentelemetry.sdk.metrics import MeterProvider  # noqa: F401 - both raise ImportError here, not later

        self.config, self.rank, self.run_name = config, rank, run_name
        self.url = config.url
        self.drops: Counter[str] = Counter()
        """What was lost: ``exports`` (requests that failed), ``points`` (their data points), ``flushes`` (fed
        batches dropped from a full queue or left at close)."""
        self.exports = 0
        """Requests the endpoint accepted."""
        self._queue: deque[tuple[str, Sequence[StepRecord], Sequence[Any]]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._down = False
        self._quiet = _Quiet()
        self._meters: Instruments | None = None
        self._thread = threading.Thread(target=self._run, name="stabmon-otlp", daemon=True)
        self._thread.start()
        log.info("stabmon: exporting metrics over OTLP/HTTP to %s (rank %d)", self.url, rank)

    # -- the training thread: an append, nothing else --
    def steps(self, *, run_id: str, records: Sequence[StepRecord]) -> None:
        """Queue one flush's step records (never blocks)."""
        if records:
            self._put(run_id, tuple(records), ())  # a copy of the references: the caller may reuse its list

    def events(self, *, run_id: str, events: Sequence[Any]) -> None:
        """Queue anomalies, decisions, interventions and outcomes (never blocks; any thread)."""
        if events:
            self._put(run_id, (), tuple(events))

    def _put(self, run_id: str, records: Sequence[StepRecord], events: Sequence[Any]) -> None:
        with self._lock:
            if self._closing:
                return
            if len(self._queue) >= self.config.queue:
                self._queue.popleft()
                self.drops["flushes"] += 1
            self._queue.append((run_id, records, events))
        self._wake.set()

    def close(self, timeout: float | None = None) -> None:
        """The last export (skipped while the endpoint is down), bounded by ``timeout`` (default
        ``config.close_timeout``); then the SDK is shut down. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wake.set()
        deadline = time.monotonic() + (self.config.close_timeout if timeout is None else timeout)
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._thread.join(min(0.05, max(deadline - time.monotonic(), 0.0)))
            if self._down or self._quiet.failing:  # the endpoint does not answer: no retry is waited for
                self._abort()
                self._thread.join(max(deadline - time.monotonic(), 0.0))
                break
        if self._thread.is_alive():
            log.warning("stabmon: OTLP export to %s did not finish within the close timeout: its last batch is "
                        "dropped", self.url)
            self.drops["flushes"] += 1
        if self.drops:
            log.warning("stabmon: OTLP export to %s: %d export(s) made, dropped %s", self.url, self.exports,
                        ", ".join(f"{n} {k}" for k, n in sorted(self.drops.items())))

    # -- the exporter's thread --
    def _run(self) -> None:
        sdk_log = logging.getLogger(SDK_LOGGER)
        self._quiet.thread = threading.get_ident()
        sdk_log.addFilter(self._quiet)
        try:
            self._loop()
        except Exception:  # noqa: BLE001 - a bug here must not go unsaid, nor reach training
            log.exception("stabmon: the OTLP exporter's thread failed; export is off for this run")
        finally:
            sdk_log.removeFilter(self._quiet)

    def _loop(self) -> None:
        due = 0.0  # when the next export may go
        dirty = False  # recorded since the last export
        while True:
            wait = None if not dirty else max(due - time.monotonic(), 0.0)
            self._wake.wait(wait)
            self._wake.clear()
            with self._lock:
                batch, closing = list(self._queue), self._closing
                self._queue.clear()
            for run_id, records, events in batch:
                self._instruments(run_id).record(records, events)
                dirty = True
            if closing:
                if dirty and not self._down:
                    self._export()
                elif dirty:
                    self.drops["flushes"] += 1
                self._shutdown()
                return
            if dirty and time.monotonic() >= due:
                self._export()
                dirty, due = False, time.monotonic() + self.config.interval

    def _instruments(self, run_id: str) -> Instruments:
        if self._meters is None or self._meters.run_id != run_id:
            if self._meters is not None:  # a new run id (a resumed run's): export what the old one holds
                self._export()
                self._shutdown()
            exporter = _exporter_class()(self, endpoint=self.url, timeout=self.config.timeout)
            self._meters = Instruments(exporter, run_name=self.run_name, run_id=run_id, rank=self.rank,
                                       layers=self.config.layers)
        return self._meters

    def _export(self) -> None:
        if self._meters is not None:
            self._quiet.failing = False
            self._meters.reader.collect(timeout_millis=self.config.timeout * 1000)

    def _abort(self) -> None:
        """Cut short the retries of an export under way (the SDK exporter's shutdown ends its backoff wait)."""
        meters = self._meters
        if meters is not None:
            try:
                meters.exporter.shutdown()
            except Exception:  # noqa: BLE001 - closing anyway
                log.debug("stabmon: OTLP exporter shutdown failed", exc_info=True)

    def _shutdown(self) -> None:
        if self._meters is not None:
            self._meters.provider.shutdown(timeout_millis=self.config.timeout * 1000)

    def exported(self, ok: bool, points: int) -> None:
        """The SDK exporter's result (its thread): counted, said once when the endpoint goes down or comes back."""
        if ok:
            self.exports += 1
            if self._down:
                log.warning("stabmon: OTLP export to %s works again", self.url)
            self._down = False
            return
        self.drops["exports"] += 1
        self.drops["points"] += points
        if not self._down:
            log.warning("stabmon: OTLP export to %s failed (%s): dropped, training goes on (counted; said again "
                        "when it works)", self.url, self._quiet.last or "no reason given")
        self._down = True


def _exporter_class() -> type:
    """The SDK's OTLP/HTTP exporter, counting its results into an :class:`OtlpExporter` (made here: the SDK is
    imported only when an export is asked for)."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import MetricExportResult

    class Counted(OTLPMetricExporter):  # type: ignore[misc]
        def __init__(self, owner: OtlpExporter, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.owner = owner
            self.stopped = threading.Event()

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            if not self.stopped.is_set():  # once, from whichever thread comes first (close() cuts retries short)
                self.stopped.set()
                super().shutdown(timeout_millis=timeout_millis, **kwargs)

        def export(self, metrics_data: Any, timeout_millis: float | None = 10_000, **kwargs: Any) -> Any:
            try:
                result = super().export(metrics_data, timeout_millis=timeout_millis, **kwargs)
            except Exception as exc:  # noqa: BLE001 - a drop, never a traceback
                self.owner.exported(False, _points(metrics_data))
                log.debug("stabmon: OTLP export raised %s: %s", type(exc).__name__, exc)
                return MetricExportResult.FAILURE
            self.owner.exported(result == MetricExportResult.SUCCESS, _points(metrics_data))
            return result

    return Counted


def _points(metrics_data: Any) -> int:
    return sum(len(m.data.data_points) for rm in metrics_data.resource_metrics for sm in rm.scope_metrics
               for m in sm.metrics)
