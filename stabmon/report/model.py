"""What a run report shows, as plain data: charts on one step axis, event marks, rollback bands, the causal
trace and the environment fingerprint. :mod:`stabmon.report.render` turns it into one HTML file.

>>> from stabmon.events import Anomaly, Severity, StepRecord
>>> recs = [StepRecord(step=s, metrics={"loss": 2.0, "grad_norm": 9.0 if s == 5 else 1.0}) for s in range(10)]
>>> a = Anomaly(kind="spike", metric="grad_norm", step=5, score=8.0, severity=Severity.ERROR, detector="z",
...             evidence=((4, 1.0), (5, 9.0)), id="a1")
>>> data = build_report(records_frame(recs), [a], run=RunInfo(id="r1", name="demo"))
>>> [c.id for c in data.charts], data.step_range
(['loss', 'grad_norm'], (0, 9))
>>> m = data.marks[0]
>>> (m.kind, m.step, m.label, m.row)
('anomaly', 5, 'spike on grad_norm', 'ev-a1')
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from stabmon.events import Anomaly, Decision, InterventionRecord, Metric, Outcome
from stabmon.interventions.traits import recorded_traits
from stabmon.report.series import Series, build_series, records_frame  # noqa: F401 - records_frame re-exported


@dataclass(frozen=True)
class ChartSpec:
    """One chart: the metrics it draws, by exact name or by ``prefix/``."""

    id: str
    title: str
    names: tuple[str, ...] = ()
    prefix: str | None = None
    log: bool = False
    """Draw the y axis on a log scale (values <= 0 are left out)."""


CHARTS = (
    ChartSpec("loss", "Loss", ("loss", "val_loss")),
    ChartSpec("grad_norm", "Gradient norm (global, before clipping)", ("grad_norm", "clip")),
    ChartSpec("grad_norm_layers", "Gradient norm per layer", prefix="grad_norm/"),
    ChartSpec("loss_scale", "Loss scale", ("loss_scale",), log=True),
    ChartSpec("act_rms", "Activation norms (RMS)", prefix="act_rms/"),
    ChartSpec("emb_drift", "Embedding drift ||W - W0|| / ||W0||", prefix="emb_drift/"),
    ChartSpec("emb_update", "Embedding update ratio ||W_t - W_t-1|| / ||W_t||", prefix="emb_update/", log=True),
    ChartSpec("lr", "Learning rate in force", ("lr",)),
    ChartSpec("step_time", "Step time (s)", ("step_time",)),
    ChartSpec("tokens_per_sec", "Tokens per second", ("tokens_per_sec",)),
)


@dataclass(frozen=True)
class Chart:
    id: str
    title: str
    series: list[Series]
    log: bool = False
    y_range: tuple[float, float] | None = None
    """The y axis: the kept trajectory's smallest and largest finite value (positive ones on a log axis), so
    the values of an attempt a rollback abandoned do not flatten the curve the run kept. None: nothing kept."""
    off_scale: int = 0
    """Abandoned points outside ``y_range``: drawn at its edge (clipped) and counted in the legend."""


@dataclass(frozen=True)
class Mark:
    """An event drawn at its step on every chart; ``row`` is the id of its line in the trace table."""

    kind: str  # anomaly | decision | intervention | rollback | outcome
    step: int
    label: str
    detail: list[tuple[str, str]]
    row: str
    severity: str | None = None
    """An anomaly's severity (the reader can hide the marks below a severity); None for the runbook's acts."""


@dataclass(frozen=True)
class Band:
    """A stretch of steps trained twice: ``start`` (the checkpoint restored) to ``stop`` (where it rolled back)."""

    start: int
    stop: int
    label: str


@dataclass(frozen=True)
class TraceRow:
    incident: str
    stage: str
    step: int
    what: str
    detail: str
    row: str


@dataclass(frozen=True)
class RunInfo:
    id: str
    name: str
    kind: str = ""
    status: str = ""
    source: str | None = None
    parent_run_id: str | None = None


@dataclass(frozen=True)
class ReportData:
    run: RunInfo
    charts: list[Chart]
    marks: list[Mark]
    bands: list[Band]
    trace: list[TraceRow]
    environment: Mapping[str, Any]
    step_range: tuple[int, int]
    records: int
    missing: list[str] = field(default_factory=list)
    """Titles of charts with nothing recorded."""
    dropped_marks: int = 0
    goodput: Any = None
    """The run's :class:`~stabmon.goodput.Ledger` (a live run's; None for a log without step times)."""


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}" if math.isfinite(v) else str(v)
    if isinstance(v, Mapping):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def _evidence(ev: Sequence[tuple[int, float]]) -> str:
    shown = list(ev)[-10:]
    return ", ".join(f"{s}: {_fmt(float(v))}" for s, v in shown)


def _anomaly_mark(a: Anomaly) -> Mark:
    detail = [("score", _fmt(a.score)), ("threshold", _fmt(a.threshold)), ("severity", a.severity.value),
              ("detector", a.detector), ("evidence", _evidence(a.evidence))]
    if a.message:
        detail.append(("message", a.message))
    return Mark("anomaly", a.step, f"{a.kind} on {a.metric}", detail, f"ev-{a.id}", a.severity.value)


def _decision_mark(d: Decision) -> Mark:
    detail = [("status", d.status.value), ("params", _fmt(dict(d.params))), ("rule", f"{d.rule} rung {d.rung + 1}"),
              ("runbook", d.runbook), ("reason", d.reason)]
    return Mark("decision", d.step, f"decision {d.action} ({d.status.value})", detail, f"ev-{d.id}")


def _intervention_mark(i: InterventionRecord) -> Mark:
    kind = "rollback" if recorded_traits(i.action).rewinds_step and not i.reverted else "intervention"
    label = ("revert " if i.reverted else "") + i.action + (" (simulated)" if i.simulated else "")
    detail = [("before", _fmt(dict(i.before))), ("after", _fmt(dict(i.stored_after())))]
    return Mark(kind, i.step, label, detail, f"ev-{i.id}")


def _outcome_mark(o: Outcome) -> Mark:
    return Mark("outcome", o.step, f"outcome {o.verdict.value}", [("evidence", _fmt(dict(o.evidence)))],
                f"ev-{o.id}")


def event_marks(events: Sequence[Any], *, limit: int = 5000) -> tuple[list[Mark], int]:
    """One mark per event (every status of a decision is its own mark); at most ``limit`` anomaly marks, the
    rest counted. Returns (marks, anomaly marks left out)."""
    marks: list[Mark] = []
    anomalies = dropped = 0
    for e in events:
        if isinstance(e, Anomaly):
            anomalies += 1
            if anomalies > limit:
                dropped += 1
                continue
            marks.append(_anomaly_mark(e))
        elif isinstance(e, Decision):
            marks.append(_decision_mark(e))
        elif isinstance(e, InterventionRecord):
            marks.append(_intervention_mark(e))
        elif isinstance(e, Outcome):
            marks.append(_outcome_mark(e))
    return marks, dropped


def rollback_bands(events: Sequence[Any]) -> list[Band]:
    """The re-trained stretch of each rollback: from the restored checkpoint's step to where it rolled back."""
    bands = []
    for e in events:
        if not isinstance(e, InterventionRecord) or not recorded_traits(e.action).rewinds_step or e.reverted:
            continue
        start = e.after.get("checkpoint_step")
        stop = e.after.get("from_step", e.before.get("step"))
        if isinstance(start, int) and isinstance(stop, int) and stop >= start:
            what = "would be re-trained after the simulated" if e.simulated else "re-trained after"
            bands.append(Band(start, stop, f"{what} rollback at step {stop} to checkpoint {start}"))
    return bands


def trace_rows(events: Sequence[Any]) -> list[TraceRow]:
    """The causal trace (evidence -> anomaly -> decision -> intervention -> outcome) as table rows."""
    from stabmon.runbook.trace import build_trace

    rows: list[TraceRow] = []
    trace = build_trace(events)
    for r in (trace["hang"] or {}).get("ranks", []):
        culprit = " (the culprit)" if r["rank"] == trace["hang"]["culprit"] else ""
        where = r["where"][0] if r["where"] else "no stack recorded"
        state = "waiting in a collective" if r["in_collective"] else "not in a collective"
        what, detail = f"no step for {_fmt(r['waited'])} s", f"{state}: {where}"
        if r["silent"]:
            what, detail = "sent no hang report", "stopped, frozen or dead: its peers wait for it"
        rows.append(TraceRow("hang", f"rank {r['rank']}{culprit}", r["step"], what, detail, f"ev-{r['id']}"))
    for inc in trace["incidents"]:
        key = inc["incident"]
        a = inc["anomaly"]
        if a:
            what = f"{a['kind']} on {a['metric']} ({a['severity']}, {a['detector']})"
            detail = f"score {_fmt(a['score'])} >= {_fmt(a['threshold'])}; evidence {_evidence(a['evidence'])}"
            rows.append(TraceRow(key, "anomaly", a["step"], what, detail, f"ev-{a['id']}"))
        for s in inc["steps"]:
            rows.extend(_step_rows(key, s))
    return rows


def _step_rows(key: str, s: Mapping[str, Any]) -> list[TraceRow]:
    d = s["decision"]
    history = " -> ".join(f"{st}@{step}" for st, step in s["statuses"])
    rows = [TraceRow(key, "decision", d["step"], f"{d['action']}({_fmt(d['params'])}) rung {d['rung'] + 1}",
                     f"{history}; {d['reason']}", f"ev-{d['id']}")]
    iv = s["intervention"]
    if iv:
        rewinds = recorded_traits(iv["action"]).rewinds_step
        stage = "revert" if iv["reverted"] else ("rollback" if rewinds else "intervention")
        rows.append(TraceRow(key, stage, iv["step"], iv["action"] + (" (simulated)" if iv["simulated"] else ""),
                             f"before {_fmt(iv['before'])}; after {_fmt(iv['after'])}", f"ev-{iv['id']}"))
    o = s["outcome"]
    if o:
        rows.append(TraceRow(key, "outcome", o["step"], o["verdict"], _fmt(o["evidence"]), f"ev-{o['id']}"))
    return rows


def build_charts(df: pl.DataFrame, *, buckets: int) -> tuple[list[Chart], list[str]]:
    """The charts of :data:`CHARTS` that have data, and the titles of those that have none."""
    names = df["name"].unique(maintain_order=True).to_list() if not df.is_empty() else []
    charts, missing = [], []
    for spec in CHARTS:
        wanted = [n for n in spec.names if n in names]
        if spec.prefix:
            wanted += sorted(n for n in names if n.startswith(spec.prefix))
        if not wanted:
            missing.append(spec.title)
            continue
        per_series = buckets if len(wanted) <= 4 else max(100, 4 * buckets // len(wanted))  # a few MB at most
        series = [_no_clip_as_infinity(s) for s in build_series(df, buckets=per_series, names=wanted)]
        series = [s for s in series if s.steps or s.nonfinite]
        y_range = kept_range(series, log=spec.log)
        charts.append(Chart(spec.id, spec.title, series, spec.log, y_range, off_scale(series, y_range)))
    return charts, missing


def kept_range(series: Sequence[Series], *, log: bool = False) -> tuple[float, float] | None:
    """Smallest and largest finite value the run kept (positive ones on a log axis); None when it kept none.

    >>> s = Series("act", steps=[0, 1], values=[0.4, 0.6], abandoned=([1], [500.0]))
    >>> kept_range([s])
    (0.4, 0.6)
    """
    values = [v for s in series for v in s.values if math.isfinite(v) and (v > 0 or not log)]
    return (min(values), max(values)) if values else None


def off_scale(series: Sequence[Series], y_range: tuple[float, float] | None) -> int:
    """Abandoned points outside ``y_range`` (drawn clipped at its edge)."""
    if y_range is None:
        return 0
    lo, hi = y_range
    return sum(1 for s in series for v in s.abandoned[1] if v < lo or v > hi)


def _no_clip_as_infinity(s: Series) -> Series:
    """``clip`` is inf while the run does not clip: that is a setting, not a non-finite value to flag."""
    return dataclasses.replace(s, nonfinite=[]) if s.name == Metric.CLIP else s


def build_report(
    metrics: pl.DataFrame,
    events: Sequence[Any],
    *,
    run: RunInfo,
    environment: Mapping[str, Any] | None = None,
    buckets: int = 1000,
) -> ReportData:
    """Everything a report shows, from a run's long metric table (``seq, step, name, value``) and its events."""
    if buckets < 10:
        raise ValueError(f"report.buckets must be >= 10, got {buckets}")
    from stabmon.report.series import mark_abandoned

    df = mark_abandoned(metrics) if not metrics.is_empty() else metrics
    charts, missing = build_charts(df, buckets=buckets)
    marks, dropped = event_marks(events)
    steps = [int(x) for x in (df["step"].min(), df["step"].max())] if not df.is_empty() else [0, 0]  # type: ignore[arg-type]
    for m in marks:
        steps = [min(steps[0], m.step), max(steps[1], m.step)]
    return ReportData(
        run=run,
        charts=charts,
        marks=marks,
        bands=rollback_bands(events),
        trace=trace_rows(events),
        environment=dict(environment or {}),
        step_range=(steps[0], steps[1]),
        records=df["seq"].n_unique() if not df.is_empty() else 0,
        missing=missing,
        dropped_marks=dropped,
    )
