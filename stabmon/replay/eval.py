"""Evaluate stabmon and the peer rules against labelled incidents in recorded runs.

For every run named by a LABELS.csv (segments stitched), the records are replayed through stabmon's pipeline
(the live detector and engine classes) and through each peer rule of :mod:`stabmon.replay.baselines`. An
*alert* is a step at which a method fired: for stabmon, a step with an anomaly of at least ``min_severity``
(default ``warning``); for a peer rule, a step at which it returned True. Then, per labelled incident and
method:

- ``detected``: an alert in ``[step_start - pre, step_end]`` (``pre`` = 100 steps);
- ``first_alert_step``: the first alert in that window; ``lead_steps = step_start - first_alert_step``
  (negative when the alert came after the onset);
- ``severity``: stabmon's highest anomaly severity in the window (None for peer rules, which have none);

and per run and method: ``steps`` (records replayed) and ``false_alarms``: alert *episodes* outside every
numeric or other incident window of that run (control windows do not excuse alerts), also per 10k steps. An
episode is a run of alert steps each at most ``episode_gap`` (10) steps after the previous one: one excursion
that a method flags on five consecutive steps is one false page, not five (10 steps also spans the
10-iteration log interval of the BigScience Megatron logs, so a log's cadence does not change the count). The
same rule applies to every method; ``false_alarm_steps`` keeps the raw count of alert steps. stabmon rows add
``decisions`` and ``intervention_decisions`` (decisions whose action is not ``alert_only``): what the runbook
would have done there.

stabmon's anomalies carry a severity, which gives it a second operating point for free: counting only
``error``-or-worse anomalies as alerts (what pages a human by default: the ``pagerduty://`` channel's minimum
severity, and what the default runbook acts on). The summary reports both: ``recall`` / ``false_alarms`` at
``min_severity`` and ``recall_at_error`` / ``false_alarms_at_error`` (the same replay, alerts filtered by
severity; nothing is re-run or re-fitted).

What a person hears is a third view: the alerts that the default routing would have *sent*. stabmon's events
are composed into alerts exactly as the live notifier composes them (:class:`stabmon.alerts.message.Composer`:
a decision carries its anomaly, an intervention is at least ``error``, an ``info`` anomaly stays ``info``), and
each default channel keeps those its own filter admits (:data:`DEFAULT_CHANNELS`: Slack hears ``warning`` and
worse, PagerDuty ``error`` and worse; resolutions, which follow an alert already sent, are not counted). Per
run, ``sent_<channel>`` counts the episodes of sent alerts (all of them: on a healthy control every one is a
false page) and ``false_sent_<channel>`` those outside incident windows; per incident, ``first_sent_<channel>``
is the first sent alert in its window; the summary gives ``recall_sent_<channel>`` beside them. Rate limits and
time-based deduplication are not simulated (a replay has no wall clock); episodes stand in for them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stabmon.alerts.config import ChannelConfig
from stabmon.alerts.message import Composer
from stabmon.events import Anomaly, Decision, Event, Severity, StepRecord
from stabmon.interventions.traits import recorded_traits
from stabmon.pipeline import Pipeline
from stabmon.replay.baselines import peer_rules
from stabmon.replay.engines import Engine, make_engine
from stabmon.replay.importers.pattern import compile_patterns
from stabmon.replay.importers.sniff import nothing_read
from stabmon.replay.labels import Label, RunSpec, read_labels, runs_of
from stabmon.replay.replay import replay, simulated_pipeline

log = logging.getLogger(__name__)

STABMON = "stabmon"
PEERS = ("llm_foundry", "olmo_core", "zclip", "lightning", "megatron")
PipelineFactory = Callable[[], Pipeline]
DEFAULT_CHANNELS: dict[str, ChannelConfig] = {
    "slack": ChannelConfig(url="slack://T000/B000/XXXX"),
    "pagerduty": ChannelConfig(url="pagerduty://integration@routing"),
}
"""The default routing the ``sent_*`` columns simulate: each channel with its default filter (no events
filter; ``min_severity`` warning for Slack, error for PagerDuty)."""


@dataclass
class RunAlerts:
    """What each method flagged on one run."""

    run: str
    steps: int = 0
    alerts: dict[str, list[int]] = field(default_factory=dict)  # method -> sorted alert steps
    severities: dict[int, str] = field(default_factory=dict)  # stabmon: step -> highest severity
    decisions: list[tuple[int, str]] = field(default_factory=list)  # stabmon: (step, action)
    sent: dict[str, list[int]] = field(default_factory=dict)  # stabmon: channel -> steps of alerts sent there
    restarts: list[int] = field(default_factory=list)
    malformed: int = 0
    error: str | None = None


def default_factory(
    *, runbook: Any = "default", overrides: Sequence[str] = (), detector_config: dict[str, Any] | None = None
) -> Pipeline:
    """stabmon's live pipeline (detectors + runbook engine, simulated executor)."""
    return simulated_pipeline(runbook=runbook, overrides=overrides, detector_config=detector_config)[0]


def alerts_for(
    records: Sequence[StepRecord],
    *,
    run: str,
    factory: PipelineFactory | None,
    min_severity: Severity = Severity.WARNING,
    restarts: Sequence[int] = (),
    peers: bool = True,
) -> RunAlerts:
    """Run stabmon (when ``factory`` is given) and the peer rules over one run's records."""
    out = RunAlerts(run=run, steps=len(records), restarts=list(restarts))
    if factory is not None:
        result = replay(records, pipeline=factory(), restarts=restarts)
        steps: set[int] = set()
        for ev in result.events:
            if isinstance(ev, Anomaly) and ev.severity >= min_severity:
                steps.add(ev.step)
                prev = out.severities.get(ev.step)
                if prev is None or ev.severity > Severity(prev):
                    out.severities[ev.step] = ev.severity.value
            elif isinstance(ev, Decision):
                out.decisions.append((ev.step, ev.action))
        out.alerts[STABMON] = sorted(steps)
        out.sent = sent_steps(result.events, run=run)
    if peers:
        rules = peer_rules(total_steps=len(records))
        fired: dict[str, list[int]] = {r.name: [] for r in rules}
        for rec in records:
            for rule in rules:
                if rule.update(rec):
                    fired[rule.name].append(rec.step)
        out.alerts.update(fired)
    return out


def sent_steps(
    events: Sequence[Event], *, run: str, channels: dict[str, ChannelConfig] | None = None
) -> dict[str, list[int]]:
    """The steps of the alerts each channel would have been sent (module docstring), composed from the events
    one step at a time, as the notifier composes one flush.

    >>> from stabmon.events import Anomaly, Severity
    >>> def a(step, sev):
    ...     return Anomaly(kind="spike", metric="grad_norm", step=step, score=9.0, severity=sev, detector="spike",
    ...                    evidence=(), threshold=6.0)
    >>> sent_steps([a(5, Severity.INFO), a(9, Severity.WARNING), a(12, Severity.ERROR)], run="r")
    {'slack': [9, 12], 'pagerduty': [12]}
    """
    channels = DEFAULT_CHANNELS if channels is None else channels
    composer = Composer()
    out: dict[str, list[int]] = {name: [] for name in channels}
    for group in _by_step(events):
        for alert in composer.compose(run_id=run, run_name=run, events=group):
            if alert.resolves or alert.step is None:
                continue
            for name, channel in channels.items():
                if channel.accepts(alert.kind) and alert.severity >= channel.effective_min_severity():
                    out[name].append(alert.step)
    return {name: sorted(set(steps)) for name, steps in out.items()}


def _by_step(events: Sequence[Event]) -> list[list[Event]]:
    """Events grouped by consecutive equal ``step`` (the unit the notifier composes)."""
    groups: list[list[Event]] = []
    last: object = object()
    for ev in events:
        step = ev.step
        if not groups or step != last:
            groups.append([])
            last = step
        groups[-1].append(ev)
    return groups


def _run_one(
    spec: RunSpec, factory: PipelineFactory | None, min_severity: Severity, peers: bool
) -> RunAlerts:
    """One run, imported from its files (each with its own reader) and replayed: the unit of work of an engine."""
    run = spec.name
    if spec.error is not None:
        return RunAlerts(run=run, error=spec.error)
    try:
        imported = spec.read()
    except Exception as exc:  # noqa: BLE001 - one unreadable run is reported, the others are still evaluated
        return RunAlerts(run=run, error=f"{type(exc).__name__}: {exc}")
    empty = nothing_read(imported, spec.files)
    if empty is not None:
        return RunAlerts(run=run, error=empty)
    try:
        out = alerts_for(
            imported.records,
            run=run,
            factory=factory,
            min_severity=min_severity,
            restarts=imported.restarts,
            peers=peers,
        )
    except Exception as exc:  # noqa: BLE001
        log.exception("evaluating %s failed", run)
        return RunAlerts(run=run, steps=len(imported.records), error=f"{type(exc).__name__}: {exc}")
    out.malformed = imported.malformed
    return out


@dataclass
class EvalReport:
    incidents: list[dict[str, Any]]  # one per (incident, method)
    files: list[dict[str, Any]]  # one per (run, method)
    summary: dict[str, dict[str, Any]]  # per method

    def rows(self) -> list[dict[str, Any]]:
        return [{"type": "incident", **r} for r in self.incidents] + [
            {"type": "file", **r} for r in self.files
        ]


def _windows(labels: Iterable[Label], pre: int) -> list[tuple[int, int]]:
    return [(lb.step_start - pre, lb.step_end) for lb in labels if lb.category != "control"]


EPISODE_GAP = 10


def episodes(steps: Sequence[int], gap: int = EPISODE_GAP) -> list[int]:
    """The first step of each alert episode: sorted ``steps`` split where two are more than ``gap`` apart.

    >>> episodes([5, 6, 7, 30, 45, 52])
    [5, 30, 45]
    """
    out: list[int] = []
    prev: int | None = None
    for s in steps:
        if prev is None or s - prev > gap:
            out.append(s)
        prev = s
    return out


def _at_error(ra: RunAlerts) -> list[int]:
    return sorted(s for s, sev in ra.severities.items() if Severity(sev) >= Severity.ERROR)


def score(
    labels: Sequence[Label],
    runs: dict[str, RunAlerts],
    label_runs: dict[int, str],
    *,
    pre: int = 100,
    episode_gap: int = EPISODE_GAP,
) -> EvalReport:
    """Turn per-run alerts into the per-incident and per-run rows (see the module docstring)."""
    incidents: list[dict[str, Any]] = []
    files: list[dict[str, Any]] = []
    methods = sorted({m for r in runs.values() for m in r.alerts}, key=lambda m: (m != STABMON, m)) or [STABMON]
    # (every run unreadable: its error is still reported, under stabmon)
    for i, lb in enumerate(labels):
        ra = runs[label_runs[i]]
        for m in methods:
            steps = [s for s in ra.alerts.get(m, []) if lb.step_start - pre <= s <= lb.step_end]
            first = steps[0] if steps else None
            extra: dict[str, Any] = {}
            if m == STABMON:
                errs = [s for s in _at_error(ra) if lb.step_start - pre <= s <= lb.step_end]
                extra = {"first_error_step": errs[0] if errs else None}
                for ch, sent in ra.sent.items():
                    hit = [s for s in sent if lb.step_start - pre <= s <= lb.step_end]
                    extra[f"first_sent_{ch}"] = hit[0] if hit else None
            sev = None
            if m == STABMON and steps:
                sev = max(
                    (Severity(ra.severities[s]) for s in steps if s in ra.severities), key=lambda x: x.rank
                ).value
            incidents.append(
                {
                    "file": lb.file,
                    "step_start": lb.step_start,
                    "step_end": lb.step_end,
                    "kind": lb.kind,
                    "label_source": lb.label_source,
                    "category": lb.category,
                    "method": m,
                    "detected": bool(steps),
                    "first_alert_step": first,
                    "lead_steps": None if first is None else lb.step_start - first,
                    "severity": sev,
                    "run": ra.run,
                    "error": ra.error,
                    **extra,
                }
            )
    for run, ra in runs.items():
        run_labels = [lb for i, lb in enumerate(labels) if label_runs[i] == run]
        wins = _windows(run_labels, pre)
        healthy = all(lb.category == "control" for lb in run_labels)
        for m in methods:
            fa_steps = [s for s in ra.alerts.get(m, []) if not any(a <= s <= b for a, b in wins)]
            fa = episodes(fa_steps, episode_gap)
            row: dict[str, Any] = {
                "file": run,
                "method": m,
                "steps": ra.steps,
                "false_alarms": len(fa),
                "false_alarms_per_10k": round(1e4 * len(fa) / ra.steps, 3) if ra.steps else None,
                "false_alarm_steps": len(fa_steps),
                "alerts": len(ra.alerts.get(m, [])),
                "first_false_alarms": fa[:5],
                "restarts": ra.restarts,
                "malformed": ra.malformed,
                "error": ra.error,
                "healthy": healthy,
            }
            if m == STABMON:
                err_fa = [s for s in _at_error(ra) if not any(a <= s <= b for a, b in wins)]
                row["false_alarms_at_error"] = len(episodes(err_fa, episode_gap))
                row["decisions"] = len(ra.decisions)
                for ch, sent in ra.sent.items():
                    row[f"sent_{ch}"] = len(episodes(sent, episode_gap))
                    outside = [s for s in sent if not any(a <= s <= b for a, b in wins)]
                    row[f"false_sent_{ch}"] = len(episodes(outside, episode_gap))
                row["intervention_decisions"] = sum(1 for _, a in ra.decisions if recorded_traits(a).changes_training)
            files.append(row)
    return EvalReport(incidents, files, summarize(incidents, files, methods))


GROUND_TRUTH_SOURCES = ("author", "paper")


def is_ground_truth(label_source: str) -> bool:
    """Whether a label counts in ``recall_ground_truth``: its ``label_source`` begins with ``author`` or
    ``paper`` (labelled by the run's authors or a paper, not only observed by whoever collected the logs).

    >>> is_ground_truth("paper_outlier+observed_by_us"), is_ground_truth("observed_by_us")
    (True, False)
    """
    return label_source.startswith(GROUND_TRUTH_SOURCES)


def summarize(
    incidents: list[dict[str, Any]], files: list[dict[str, Any]], methods: Sequence[str]
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for m in methods:
        num = [r for r in incidents if r["method"] == m and r["category"] == "numeric"]
        gt = [r for r in num if is_ground_truth(r["label_source"])]
        rows = [r for r in files if r["method"] == m]
        steps = sum(r["steps"] for r in rows)
        fa = sum(r["false_alarms"] for r in rows)
        leads = [r["lead_steps"] for r in num if r["lead_steps"] is not None]
        if m == STABMON:
            at_err = [r for r in num if r.get("first_error_step") is not None]
            extra = {
                "recall_at_error": round(len(at_err) / len(num), 3) if num else None,
                "false_alarms_at_error": sum(r.get("false_alarms_at_error", 0) for r in rows),
            }
            healthy = [r for r in rows if r["healthy"] and not r["error"]]
            healthy_steps = sum(r["steps"] for r in healthy)
            extra["healthy_runs"] = len(healthy)
            extra["healthy_runs_changed"] = sum(1 for r in healthy if r.get("intervention_decisions"))
            for ch in DEFAULT_CHANNELS:
                sent = sum(r.get(f"sent_{ch}", 0) for r in healthy)
                extra[f"healthy_sent_{ch}_per_10k"] = round(1e4 * sent / healthy_steps, 3) if healthy_steps else None
            for ch in DEFAULT_CHANNELS:
                hit = sum(1 for r in num if r.get(f"first_sent_{ch}") is not None)
                extra[f"detected_sent_{ch}"] = hit
                extra[f"recall_sent_{ch}"] = round(hit / len(num), 3) if num else None
                extra[f"sent_{ch}"] = sum(r.get(f"sent_{ch}", 0) for r in rows)
                extra[f"false_sent_{ch}"] = sum(r.get(f"false_sent_{ch}", 0) for r in rows)
        else:
            extra = {}
        out[m] = {
            "numeric_incidents": len(num),
            "detected": sum(r["detected"] for r in num),
            "recall": round(sum(r["detected"] for r in num) / len(num), 3) if num else None,
            "recall_ground_truth": round(sum(r["detected"] for r in gt) / len(gt), 3) if gt else None,
            "median_lead_steps": sorted(leads)[len(leads) // 2] if leads else None,
            "false_alarms": fa,
            "false_alarms_per_10k": round(1e4 * fa / steps, 3) if steps else None,
            "steps": steps,
            **extra,
        }
    return out


def evaluate(
    labels_path: str | Path,
    *,
    factory: PipelineFactory | None = None,
    stabmon: bool = True,
    runbook: Any = "default",
    overrides: Sequence[str] = (),
    min_severity: Severity = Severity.WARNING,
    pre: int = 100,
    jobs: int = 1,
    peers: bool = True,
    progress: Callable[[int], None] | None = None,
    patterns: Sequence[str] = (),
    engine: str | Engine = "local",
    group_wandb: bool = False,
) -> EvalReport:
    """Evaluate every method on every labelled run. Each run is one piece of work of ``engine``
    (:mod:`stabmon.replay.engines`: ``"local"``, ``jobs`` processes; ``"ray"``, one Ray task per run). A file is
    read with its row's ``format`` / ``pattern`` column, else with ``patterns`` when given (see
    ``importers/pattern.py``), else its sniffed format; ``group_wandb`` joins same-prefix W&B segments into one run
    (:mod:`stabmon.replay.labels`)."""
    if patterns:
        compile_patterns(patterns)  # a bad pattern is one error here, not one per run
    runner = make_engine(engine, jobs=jobs) if isinstance(engine, str) else engine
    labels_path = Path(labels_path)
    labels = read_labels(labels_path)
    if stabmon and factory is None:
        factory = functools.partial(default_factory, runbook=runbook, overrides=tuple(overrides))
    if not stabmon:
        factory = None
    label_runs, specs = runs_of(labels, labels_path.parent, patterns=patterns, group_wandb=group_wandb)
    runs = {name: RunAlerts(run=name, error=spec.error) for name, spec in specs.items() if spec.error}
    todo = [spec for spec in specs.values() if not spec.error]
    work = functools.partial(_run_one, factory=factory, min_severity=min_severity, peers=peers)
    for spec, result in zip(todo, runner.map(work, todo, progress=progress), strict=True):
        runs[spec.name] = result
    return score(labels, runs, label_runs, pre=pre)


def count_runs(labels_path: str | Path, *, group_wandb: bool = False) -> int:
    """How many distinct runs a labels file names (for a progress bar's total)."""
    labels_path = Path(labels_path)
    return len(runs_of(read_labels(labels_path), labels_path.parent, group_wandb=group_wandb)[1])
