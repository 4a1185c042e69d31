"""OpenTelemetry instruments named like Megatron-LM's, from stabmon's step records and events.

What :mod:`stabmon.integrations.otel` exports (Megatron-LM's ``megatron.training.*`` names, types and units, under
``stabmon.``)::

    stabmon.training.loss              gauge               stabmon.anomalies        counter (severity, kind, metric)
    stabmon.training.grad_norm         gauge               stabmon.decisions        counter (action, status)
    stabmon.training.learning_rate     gauge               stabmon.interventions    counter (action, status)
    stabmon.training.skipped_iters     counter             stabmon.outcomes         counter (verdict)
    stabmon.training.step_duration_ms  histogram (ms)      stabmon.goodput          gauge (1): productive share
    stabmon.training.tokens_per_sec    gauge (tokens/s)    stabmon.goodput.seconds  counter (s), by cause
    stabmon.training.loss_scale, stabmon.training.step, stabmon.signal.<name>, stabmon.fleet.<name>: gauges
    stabmon.layer.<signal>             gauge per module (attribute ``module``): grad_norm, act_rms, emb_drift, ...

Every data point carries ``run.name``, ``run.id`` and ``rank`` (Prometheus: ``run_name``, ``run_id``, ``rank``).
A gauge exports its last value: each flush sets it once, from the latest finite value of its metric.

>>> gauge_of("loss")[0], gauge_of("act_rms/h.0")[::3], gauge_of("checkpoint_time")
('stabmon.training.loss', ('stabmon.layer.act_rms', 'h.0'), None)
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from stabmon.events import Anomaly, Decision, InterventionRecord, Metric, Outcome, StepRecord

GAUGES: dict[str, tuple[str, str, str]] = {  # stabmon metric -> (instrument, unit, description): Megatron's names
    Metric.LOSS: ("stabmon.training.loss", "", "Training loss (last value per flush)."),
    Metric.GRAD_NORM: ("stabmon.training.grad_norm", "", "Global gradient norm, before clipping."),
    Metric.LR: ("stabmon.training.learning_rate", "", "Learning rate in force (overrides included)."),
    Metric.TOKENS_PER_SEC: ("stabmon.training.tokens_per_sec", "tokens/s", "Training throughput."),
    Metric.LOSS_SCALE: ("stabmon.training.loss_scale", "", "fp16 dynamic loss scale in force."),
}
NOT_GAUGES = frozenset({  # exported otherwise (histogram, counters, goodput) or meaningless on a dashboard
    Metric.STEP_TIME, Metric.SKIPPED, Metric.OVERFLOW, Metric.SEGMENT_START, Metric.CHECKPOINT_TIME,
    Metric.OUTSIDE_TIME, Metric.MONITOR_TIME, Metric.STARTUP_TIME, Metric.PARAM_CHECKSUM,
})
GOODPUT_TIMES = {  # metric -> goodput cause (stabmon.goodput's names)
    Metric.CHECKPOINT_TIME: "checkpoint", Metric.OUTSIDE_TIME: "outside_steps",
    Metric.MONITOR_TIME: "monitor", Metric.STARTUP_TIME: "startup",
}
STEP_MS_BUCKETS = (0, 5, 10, 25, 50, 75, 100, 250, 500, 750, 1000, 2500, 5000, 7500, 10_000, 30_000, 60_000,
                   120_000)
_BAD = re.compile(r"[^A-Za-z0-9_.-]")


def resource_of(run_id: str, rank: int, run_name: str) -> Any:
    """``service.name`` stabmon unless ``OTEL_SERVICE_NAME``/``OTEL_RESOURCE_ATTRIBUTES`` name one."""
    from opentelemetry.sdk.resources import Resource

    resource = Resource.create({"stabmon.run.name": run_name, "stabmon.run.id": run_id, "stabmon.rank": rank})
    ours = {}
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        ours["service.name"] = "stabmon"
    if "service.instance.id" not in resource.attributes:
        ours["service.instance.id"] = f"{run_id}/{rank}"
    return resource.merge(Resource(ours)) if ours else resource


class Instruments:
    """One run's meter provider, reader and instruments, exporting through ``exporter`` (an SDK
    ``MetricExporter``) when :attr:`reader` is collected. Used from one thread (the exporter's).

    >>> from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
    >>> class Names(MetricExporter):
    ...     def export(self, data, timeout_millis=None, **kwargs):
    ...         print(sorted(m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics))
    ...         return MetricExportResult.SUCCESS
    ...     def shutdown(self, timeout_millis=None, **kwargs): pass
    ...     def force_flush(self, timeout_millis=None): return True
    >>> meters = Instruments(Names(), run_name="doc", run_id="r1", rank=0)
    >>> meters.record([StepRecord(step=0, metrics={"loss": 2.0, "step_time": 0.1})], [])
    >>> meters.reader.collect()  # doctest: +NORMALIZE_WHITESPACE
    ['stabmon.goodput', 'stabmon.goodput.seconds', 'stabmon.training.loss', 'stabmon.training.skipped_iters',
     'stabmon.training.step', 'stabmon.training.step_duration_ms']
    """

    def __init__(self, exporter: Any, *, run_name: str, run_id: str, rank: int, layers: bool = True) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        self.run_id = run_id
        self.layers = layers
        self.attrs: dict[str, Any] = {"run.name": run_name, "run.id": run_id, "rank": rank}
        self.exporter = exporter
        # no period of its own: it exports when its owner calls collect(), after each flush
        self.reader = PeriodicExportingMetricReader(exporter, export_interval_millis=math.inf)
        self.provider = MeterProvider(resource=resource_of(run_id, rank, run_name), metric_readers=[self.reader],
                                      shutdown_on_exit=False)  # its owner shuts it down
        meter = self.meter = self.provider.get_meter("stabmon")
        self.gauges: dict[str, Any] = {}
        self.targets: dict[str, tuple[str, str, str, str | None] | None] = {}  # metric -> gauge_of(metric)
        self.step_ms = meter.create_histogram("stabmon.training.step_duration_ms", unit="ms",
                                              description="Duration of one training step in milliseconds.",
                                              explicit_bucket_boundaries_advisory=STEP_MS_BUCKETS)
        self.skipped = meter.create_counter("stabmon.training.skipped_iters",
                                            description="Optimizer steps whose update was discarded (stabmon's "
                                                        "skip guard or an fp16 overflow).")
        self.skipped.add(0, self.attrs)  # the series exists from the start: a dashboard's increase() sees the first
        self.anomalies = meter.create_counter("stabmon.anomalies", description="Anomalies stabmon flagged.")
        self.decisions = meter.create_counter("stabmon.decisions", description="Runbook decisions.")
        self.interventions = meter.create_counter("stabmon.interventions",
                                                  description="Interventions applied, reverted, failed or skipped.")
        self.outcomes = meter.create_counter("stabmon.outcomes", description="Judged interventions, by verdict.")
        self.seconds = meter.create_counter("stabmon.goodput.seconds", unit="s",
                                            description="Wall time by goodput cause (this process's live view).")
        self.goodput = meter.create_gauge("stabmon.goodput", unit="1",
                                          description="Share of the wall time seen so far that trained the model.")
        self.productive = 0.0
        self.total = 0.0

    def _gauge(self, name: str, unit: str = "", description: str = "") -> Any:
        gauge = self.gauges.get(name)
        if gauge is None:
            gauge = self.gauges[name] = self.meter.create_gauge(name, unit=unit, description=description)
        return gauge

    def record(self, records: Sequence[StepRecord], events: Sequence[Any]) -> None:
        """One flush: gauges take each metric's latest value (a gauge exports its last value only), the histogram
        every step's duration, the counters their sums."""
        attrs = self.attrs
        latest: dict[str, float] = {}
        seconds: defaultdict[str, float] = defaultdict(float)
        for r in records:
            latest.update(r.metrics)
            self._step(r, seconds)
        for name, value in latest.items():
            if name not in self.targets:
                self.targets[name] = gauge_of(name, self.layers)
            target = self.targets[name]
            if target is not None and math.isfinite(value):  # the SDK refuses NaN/inf; the anomalies count them
                instrument, unit, description, module = target
                self._gauge(instrument, unit, description).set(value, {**attrs, "module": module} if module else attrs)
        for cause, value in seconds.items():
            self.seconds.add(value, {**attrs, "cause": cause})
            self.total += value
        self.productive += seconds["productive"]
        if records:
            self._gauge("stabmon.training.step", description="Last optimizer step flushed.").set(records[-1].step,
                                                                                                attrs)
        if self.total > 0:
            self.goodput.set(self.productive / self.total, attrs)
        for e in events:
            self._event(e)

    def _step(self, r: StepRecord, seconds: defaultdict[str, float]) -> None:
        skipped = r.metrics.get(Metric.SKIPPED) == 1.0 or r.metrics.get(Metric.OVERFLOW) == 1.0
        if skipped:
            self.skipped.add(1, self.attrs)
        step_time = r.finite(Metric.STEP_TIME)
        if step_time is not None and step_time >= 0:
            self.step_ms.record(step_time * 1000.0, self.attrs)
            seconds["skipped_update" if skipped else "productive"] += step_time
        for name, cause in GOODPUT_TIMES.items():
            value = r.finite(name)
            if value is not None and value > 0:
                seconds[cause] += value

    def _event(self, e: Any) -> None:
        attrs = self.attrs
        if isinstance(e, Anomaly):
            self.anomalies.add(1, {**attrs, "severity": e.severity.value, "kind": e.kind, "metric": e.metric})
        elif isinstance(e, Decision):
            self.decisions.add(1, {**attrs, "action": e.action, "status": e.status.value})
        elif isinstance(e, InterventionRecord):
            self.interventions.add(1, {**attrs, "action": e.action, "status": _status(e)})
        elif isinstance(e, Outcome):
            self.outcomes.add(1, {**attrs, "verdict": e.verdict.value})


def _status(e: InterventionRecord) -> str:
    if e.error is not None:
        return "failed"
    if e.not_applied is not None:
        return "not_applied"
    return "reverted" if e.reverted else "applied"


def gauge_of(metric: str, layers: bool = True) -> tuple[str, str, str, str | None] | None:
    """(instrument, unit, description, module) of a step metric exported as a gauge, or None.

    >>> gauge_of("grad_norm/h.0"), gauge_of("fleet/step_time")[0], gauge_of("step_time")
    (('stabmon.layer.grad_norm', '', 'Per-module grad_norm.', 'h.0'), 'stabmon.fleet.step_time', None)
    """
    if metric in GAUGES:
        return (*GAUGES[metric], None)
    if metric in NOT_GAUGES:
        return None
    head, sep, rest = metric.partition("/")
    if not sep:
        return f"stabmon.signal.{_BAD.sub('_', metric)}"[:255], "", f"stabmon's {metric}.", None
    if head == "fleet":
        return f"stabmon.fleet.{_BAD.sub('_', rest)}"[:255], "", f"Fleet summary {metric}.", None
    if not layers:
        return None
    return f"stabmon.layer.{_BAD.sub('_', head)}"[:255], "", f"Per-module {head}.", rest

