"""What a replay says first: the verdict on the run, each detector that fired, and what to tune.

:func:`summarize` reads a replay's events: the **verdict** (``quiet``: nothing at warning or above and no decision;
``alerts only``: reports or decisions, no change to training; ``would change training``: a simulated intervention
that changes training), and per detector its reports by severity. :func:`advise` then takes each **noisy**
detector (at least ``noisy`` reports below what it should keep: info reports when it also raised warnings or
errors, else warnings when it raised errors) and looks for the setting of its threshold parameter (the config
field whose value the reports carry as their threshold: ``spike.z_threshold``, ...) just above the scores of
what it should drop and not above the scores of what it should keep. Candidates are **checked**: the records are
replayed again with each (from that setting down towards the one in force, ``checks`` of them), and the highest
that still reports everything the detector should keep, at the same steps, is the advice (raising a threshold
changes what a detector learns: what it no longer flags it learns from, so a guess from the scores alone can
silence the incident too). A
detector whose threshold is no plain parameter, or whose noise and signal overlap, gets the ``stabmon tune``
command that searches for a setting against labelled incidents instead.

>>> from stabmon.events import Anomaly, Severity
>>> reports = [Anomaly("spike", "grad_norm", s, z, sev, "spike", threshold=6.0)
...            for s, z, sev in ((10, 7.0, Severity.INFO), (20, 8.0, Severity.INFO), (30, 9.5, Severity.INFO),
...                              (40, 31.0, Severity.WARNING))]
>>> summary = summarize(reports)
>>> summary.verdict, [(f.detector, f.counts) for f in summary.firings]
('alerts only', [('spike', {'info': 3, 'warning': 1, 'error': 0})])
>>> candidate(summary.firings[0], noisy=3)
(9.6, 'warning', 3)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stabmon.events import Anomaly, Decision, InterventionRecord, Severity
from stabmon.interventions.traits import traits_of

QUIET, ALERTS, CHANGES = "quiet", "alerts only", "would change training"
ORDER = (Severity.INFO, Severity.WARNING, Severity.ERROR)
NOISY = 3
"""Reports below what a detector should keep that make it noisy."""


@dataclass(frozen=True)
class Firing:
    """One detector's reports in a replay."""

    detector: str
    metrics: tuple[str, ...]
    counts: dict[str, int]
    """Reports by severity (``info``, ``warning``, ``error``)."""
    reports: tuple[Anomaly, ...]

    def at(self, severity: Severity) -> list[Anomaly]:
        return [a for a in self.reports if a.severity == severity]


@dataclass(frozen=True)
class Summary:
    verdict: str
    firings: tuple[Firing, ...]
    changes: tuple[str, ...]
    """The simulated interventions that change training (action at step)."""


@dataclass(frozen=True)
class Advice:
    """What to do about one noisy detector."""

    detector: str
    line: str
    setting: str | None = None
    """``detector.param=value`` (checked by a second replay), or None (the tune command instead)."""
    checked: dict[str, Any] = dataclasses.field(default_factory=dict)


def summarize(events: Iterable[Any]) -> Summary:
    """The verdict and each detector's reports of a replay's ``events``."""
    by_detector: dict[str, list[Anomaly]] = {}
    loud = decided = False
    changes: list[str] = []
    for e in events:
        if isinstance(e, Anomaly):
            by_detector.setdefault(e.detector, []).append(e)
            loud = loud or e.severity != Severity.INFO
        elif isinstance(e, Decision):
            decided = True
        elif isinstance(e, InterventionRecord) and not e.reverted and _changed(e):
            changes.append(f"{e.action} at step {e.step}")
    firings = tuple(
        Firing(name, tuple(sorted({a.metric for a in found})),
               {s.value: sum(a.severity == s for a in found) for s in ORDER}, tuple(found))
        for name, found in sorted(by_detector.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    )
    verdict = CHANGES if changes else ALERTS if (loud or decided) else QUIET
    return Summary(verdict, firings, tuple(changes))


def _changed(record: InterventionRecord) -> bool:
    after = record.after or {}
    if "error" in after or "not_applied" in after or record.error or record.not_applied:
        return False
    try:
        return traits_of(record.action).changes_training
    except KeyError:
        return True


def candidate(firing: Firing, *, noisy: int = NOISY) -> tuple[float, str, int] | None:
    """``(threshold, lowest severity kept, reports dropped)`` that drops a noisy detector's reports below what it
    should keep and keeps the rest, judged on their scores; None when it is not noisy or noise and signal
    overlap."""
    counts = firing.counts
    if counts["warning"] + counts["error"] and counts["info"] >= noisy:
        keep = Severity.WARNING
    elif counts["error"] and counts["warning"] >= noisy:
        keep = Severity.ERROR
    elif not counts["warning"] and not counts["error"] and counts["info"] >= noisy:
        keep = Severity.WARNING  # only info reports: all of them are noise
    else:
        return None
    kept_index = ORDER.index(keep)
    drop = [a.score for a in firing.reports if ORDER.index(a.severity) < kept_index and math.isfinite(a.score)]
    keep_scores = [a.score for a in firing.reports if ORDER.index(a.severity) >= kept_index]
    if not drop:
        return None
    value = _just_above(max(drop))
    if keep_scores and value > min(keep_scores):
        return None
    return value, keep.value, len(drop)


def _just_above(x: float) -> float:
    """A round value just above ``x`` (two significant digits)."""
    if x <= 0:
        return 0.0
    scale = 10 ** (math.floor(math.log10(x)) - 1)
    value = math.floor(x / scale + 1) * scale
    return float(f"{value:.6g}")


def threshold_param(config: Any, threshold: float | None) -> str | None:
    """The field of a detector's ``config`` whose value is the reports' ``threshold`` (None: none is)."""
    if threshold is None or not dataclasses.is_dataclass(config):
        return None
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value) == float(threshold):
            return f.name
    return None


def advise(summary: Summary, configs: Mapping[str, Any], rerun: Callable[[list[str]], Sequence[Any]] | None,
           *, noisy: int = NOISY, tune_hint: str = "stabmon tune --labels LABELS.csv", checks: int = 4
           ) -> list[Advice]:
    """Advice for each noisy detector; ``configs``: the detectors' configs by name (the suite's);
    ``rerun(overrides)``: the replay's events with ``detector.param=value`` overrides (the check; None: none)."""
    out = []
    for firing in summary.firings:
        found = candidate(firing, noisy=noisy)
        param = threshold_param(configs.get(firing.detector), firing.reports[0].threshold)
        counts = ", ".join(f"{n} {s}" for s, n in firing.counts.items() if n)
        head = f"{firing.detector} ({', '.join(firing.metrics)}): {counts}"
        if found is None and not _is_noisy(firing, noisy):
            continue
        if found is None or param is None:
            why = "its threshold is no single setting" if param is None else "its noise and its signal overlap"
            out.append(Advice(firing.detector, f"{head}; {why}: search for a setting against labelled incidents "
                                               f"with `{_tune_command(tune_hint, configs, firing.detector, param)}`"))
            continue
        value, keep, dropped = found
        if rerun is None:
            setting = f"{firing.detector}.{param}={value:g}"
            out.append(Advice(firing.detector, f"{head}; {setting} drops {dropped} report(s) below {keep} and keeps "
                                               f"the rest, judged on their scores (not checked)", setting))
            continue
        now = float(getattr(configs[firing.detector], param))
        advice = _checked(firing, head, param, keep, _ladder(now, value, checks), rerun)
        command = _tune_command(tune_hint, configs, firing.detector, param)
        out.append(advice or Advice(firing.detector, f"{head}; no setting of {firing.detector}.{param} between "
                                                     f"{now:g} and {value:g} keeps its {keep} reports once replayed "
                                                     f"(what it no longer flags, it learns): search against labelled "
                                                     f"incidents with `{command}`"))
    return out


def _tune_command(hint: str, configs: Mapping[str, Any], detector: str, param: str | None) -> str:
    """The exact ``stabmon tune`` command: over the detector's threshold (``param``: from its setting in force to
    4x it), or over the default space when it has no single threshold setting."""
    if param is None or detector not in configs:
        return f"{hint} --out tuned.yaml"
    now = float(getattr(configs[detector], param))
    values = ", ".join(f"{now * f:g}" for f in (1, 1.5, 2, 3, 4))
    return f"echo '{detector}.{param}: [{values}]' > space.yaml && {hint} --space space.yaml --out tuned.yaml"


def _ladder(now: float, top: float, n: int) -> list[float]:
    """``n`` round settings from ``top`` down towards ``now`` (geometric), highest first."""
    if n <= 1 or top <= now:
        return [top]
    ratio = (top / now) ** (1.0 / n) if now > 0 else 2.0
    values = [top]
    for k in range(1, n):
        values.append(float(f"{top / ratio ** k:.2g}"))
    return sorted({v for v in values if v > now}, reverse=True)


def _checked(firing: Firing, head: str, param: str, keep: str, values: list[float],
             rerun: Callable[[list[str]], Sequence[Any]]) -> Advice | None:
    """The highest of ``values`` whose replay keeps every report at ``keep`` or above at its step."""
    level = ORDER.index(Severity(keep))
    kept_before = {a.step for a in firing.reports if ORDER.index(a.severity) >= level}
    for value in values:
        setting = f"{firing.detector}.{param}={value:g}"
        reports = [a for a in rerun([setting]) if isinstance(a, Anomaly)]
        again = [a for a in reports if a.detector == firing.detector]
        # kept: reported at that step and severity again, by this detector or by another that now takes it
        kept_after = {a.step for a in reports if ORDER.index(a.severity) >= level}
        if kept_before <= kept_after:
            checked = {"reports": len(again), "was": len(firing.reports), "kept": len(kept_before)}
            line = (f"{head}; {setting}: {len(again)} report(s) from it, was {len(firing.reports)}, and every "
                    f"{keep}-or-above report still made at its step ({len(kept_before)}; checked by replaying again)")
            return Advice(firing.detector, line, setting, checked)
    return None


def _is_noisy(firing: Firing, noisy: int) -> bool:
    c = firing.counts
    return c["info"] >= noisy or (c["error"] > 0 and c["warning"] >= noisy)


def together(summary: Summary, advice: Sequence[Advice], rerun: Callable[[list[str]], Sequence[Any]]) -> str | None:
    """Every checked setting at once, replayed: how many reports remain, and whether every warning-or-above
    report is still made at its step (None: fewer than two settings)."""
    settings = [a.setting for a in advice if a.setting is not None]
    if len(settings) < 2:
        return None
    before = [a for f in summary.firings for a in f.reports]
    loud = {a.step for a in before if a.severity != Severity.INFO}
    after = [a for a in rerun(settings) if isinstance(a, Anomaly)]
    kept = loud <= {a.step for a in after if a.severity != Severity.INFO}
    return (f"all {len(settings)} together: {len(after)} report(s), was {len(before)}; "
            + ("every warning-or-above report still made at its step" if kept else
               "some warning-or-above report is lost: apply them one at a time") + " (checked by replaying again)")
