"""The configured set of detectors that the pipeline runs on every StepRecord."""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from stabmon.detect.base import Detector, X
from stabmon.detect.config import apply_overrides, build
from stabmon.detect.fleet import FLEET_DETECTORS
from stabmon.detect.progress import PROGRESS_DETECTORS
from stabmon.detect.rules import RULE_DETECTORS
from stabmon.detect.spike import SPIKE_DETECTORS
from stabmon.detect.trends import TREND_DETECTORS
from stabmon.events import Anomaly, Metric, Severity, StepRecord

DETECTORS: dict[str, type[Detector]] = {
    c.name: c for c in (*SPIKE_DETECTORS, *RULE_DETECTORS, *TREND_DETECTORS, *PROGRESS_DETECTORS, *FLEET_DETECTORS)
}
ROOT = "detectors"
_Update = Callable[[int, X], "Anomaly | None"]  # a detector's bound update method
_Window = deque[tuple[int, float]]  # a metric's recent (step, raw value) pairs: the evidence of its detectors
_MAX_PLANS = 256  # distinct metric-name sets remembered (a stream rarely has more than a handful)
_LEAD = ("spike", Metric.GRAD_NORM)  # corroboration: a grad-norm spike, then
_FOLLOW = ("spike", Metric.LOSS)  # a loss spike within ``spike.corroborate_within`` steps: an error


@dataclass
class _Plan:
    """What a record with a given set of metric names goes through."""

    windows: list[tuple[str, _Window]]  # the evidence windows of its metrics, filled before the detectors run
    updates: list[_Update]  # the bound ``update`` methods of the detectors that watch it
    # the metrics whose detectors skip finite values (Detector.skips_finite), and the updates without those
    # detectors: what a record whose values of these metrics are all finite goes through (the same order)
    guarded: list[str]
    finite_updates: list[_Update]


def _is_glob(pattern: str) -> bool:
    return any(ch in pattern for ch in "*?[")


def _unwrap(cfg: Any) -> dict[str, Any]:
    raw = cfg if cfg is not None else {}
    if isinstance(raw, Mapping) and set(raw) == {ROOT}:
        raw = raw[ROOT] if raw[ROOT] is not None else {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{ROOT} must be a mapping of detector names, got {raw!r}")
    return dict(raw)


def parse_config(cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validate a ``{detector name: {param: value}}`` mapping (or ``{"detectors": {...}}``) into config
    objects."""
    raw = _unwrap(cfg)
    unknown = sorted(set(raw) - set(DETECTORS))
    if unknown:
        known = ", ".join(sorted(DETECTORS))
        raise ValueError(f"{ROOT}.{unknown[0]} is not a known detector (known: {known})")
    return {name: build(cls.Config, raw.get(name), f"{ROOT}.{name}") for name, cls in DETECTORS.items()}


class DetectorSuite:
    """Runs every enabled detector on each record; one Anomaly per (kind, metric, step).

    Exact metric names get their detector up front; glob patterns (``act_rms/*``, ``emb_update/*``) get one
    detector per matching metric the first time it appears. When two detectors report the same kind of event
    on the same metric and step (``spike`` and ``robust_spike``), the more severe report is kept.

    Corroboration across signals: a loss spike at most ``spike.corroborate_within`` steps after a grad-norm
    spike (or at the same step) is an ``error`` whatever its own severity - the grad norm led and the loss
    followed (BigScience tr8-104B it11447-11448, tr11-176B it31215-31219). A grad-norm spike that the loss
    does not follow keeps the severity its size earns (often ``info``: see :mod:`stabmon.detect.spike`).
    Deterministic, pickleable, and ``state_dict`` / ``load_state_dict`` round-trip.

    >>> suite = DetectorSuite.from_config(overrides={"spike.grace_period": 2, "robust_spike.grace_period": 2})
    >>> for s in range(20):
    ...     _ = suite.update(StepRecord(step=s, metrics={"loss": 3.0, "grad_norm": 0.5}))
    >>> found = suite.update(StepRecord(20, {"loss": 3.0, "grad_norm": 9.0}))
    >>> [(a.kind, a.metric, a.severity.value) for a in found]
    [('spike', 'grad_norm', 'warning')]
    """

    def __init__(self, configs: Mapping[str, Any] | None = None) -> None:
        self.configs = dict(configs) if configs is not None else parse_config(None)
        self._detectors: dict[tuple[str, str], Detector] = {}
        self._patterns: dict[str, list[str]] = {}
        self._seen: set[str] = set()
        # metric-name set of a record -> the evidence windows to fill and the detectors that must see it; built
        # once per new set of names, so the per-record path does no glob matching, no membership tests and no
        # method lookups per detector
        self._plans: dict[tuple[str, ...], _Plan] = {}
        # metric -> its (step, raw value) window, shared by the detectors of the metric (one append per record
        # instead of one per detector); as long as the longest evidence any detector reports
        self._windows: dict[str, _Window] = {}
        self._window_len = max((c.evidence for c in self.configs.values() if c.enabled), default=1)
        self._lead_step: int | None = None  # the step of the last grad-norm spike (corroboration)
        self._follow_streak = 0  # consecutive records with a loss whose loss was flagged as a spike
        spike = self.configs.get("spike")
        self._corroborate_within = spike.corroborate_within if spike is not None else 0
        self._corroborate_records = spike.corroborate_records if spike is not None else 1
        for name, config in self.configs.items():
            if not config.enabled:
                continue
            self._patterns[name] = [m for m in config.metrics if _is_glob(m)]
            for metric in config.metrics:
                if not _is_glob(metric):
                    self._add(name, metric)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None = None, *,
                    overrides: Mapping[str, Any] | Iterable[str] | None = None) -> DetectorSuite:
        """Build from a nested mapping (None = defaults) plus ``detector.param`` overrides."""
        raw = _unwrap(cfg)
        if overrides:
            raw = apply_overrides(raw, overrides)
        return cls(parse_config(raw))

    def _add(self, name: str, metric: str) -> Detector:
        cls = DETECTORS[name]
        window = None
        if cls.shares_evidence:
            window = self._windows.get(metric)
            if window is None:
                window = self._windows[metric] = deque(maxlen=self._window_len)
        det = cls(metric, self.configs[name], evidence=window)
        self._detectors[(name, metric)] = det
        self._plans = {}
        return det

    def _discover(self, metrics: Iterable[str]) -> None:
        for metric in metrics:
            if metric in self._seen:
                continue
            self._seen.add(metric)
            for name, patterns in self._patterns.items():
                new = (name, metric) not in self._detectors
                if new and any(fnmatch.fnmatchcase(metric, p) for p in patterns):
                    self._add(name, metric)

    @property
    def detectors(self) -> list[Detector]:
        return list(self._detectors.values())

    def _plan(self, names: tuple[str, ...]) -> _Plan:
        self._discover(names)
        present = set(names)
        watching = [d for d in self._detectors.values() if d.watches(present)]
        plan = _Plan(
            windows=[(metric, window) for metric, window in self._windows.items() if metric in present],
            updates=[d.update for d in watching],
            guarded=sorted({d.metric for d in watching if d.skips_finite and d.metric in present}),
            finite_updates=[d.update for d in watching if not (d.skips_finite and d.metric in present)],
        )
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[names] = plan
        return plan

    def update(self, record: StepRecord) -> list[Anomaly]:
        """Every detector that watches the record (:meth:`Detector.watches`) sees it; return the
        anomalies found, most severe first per (kind, metric)."""
        metrics = record.metrics
        if metrics.get(Metric.SKIPPED) == 1.0:
            metrics = _without_discarded(metrics)
        names = tuple(metrics)
        plan = self._plans.get(names)
        if plan is None:
            plan = self._plan(names)
        step = record.step
        for metric, window in plan.windows:
            window.append((step, metrics[metric]))
        updates = plan.finite_updates
        for metric in plan.guarded:
            if not math.isfinite(metrics[metric]):
                updates = plan.updates
                break
        best: dict[tuple[str, str], Anomaly] | None = None
        for update in updates:
            found = update(step, metrics)
            if found is None:
                continue
            if best is None:
                best = {}
            key = (found.kind, found.metric)
            old = best.get(key)
            if old is None or _rank(found) > _rank(old):
                best[key] = found
        if best is None:
            if self._follow_streak and Metric.LOSS in metrics:
                self._follow_streak = 0
            return []
        if Metric.LOSS in metrics:
            self._follow_streak = self._follow_streak + 1 if _FOLLOW in best else 0
        self._corroborate(step, best)
        return list(best.values())

    def _corroborate(self, step: int, best: dict[tuple[str, str], Anomaly]) -> None:
        """Raise a loss spike that follows a grad-norm spike to ``error`` (see the class docstring)."""
        if _LEAD in best:
            self._lead_step = step
        follow = best.get(_FOLLOW)
        lead = self._lead_step
        if follow is None or lead is None or follow.severity >= Severity.ERROR:
            return
        if 0 <= step - lead <= self._corroborate_within and self._follow_streak >= self._corroborate_records:
            best[_FOLLOW] = dataclasses.replace(
                follow, severity=Severity.ERROR,
                message=f"{follow.message}; the grad norm spiked first (step {lead}) and the loss has stayed up "
                        f"for {self._follow_streak} records: corroborated",
            )

    def enter_grace(self, steps: int | None = None) -> None:
        """Every detector re-enters its grace period (after an intervention, rollback, resume or LR
        warm-up)."""
        for det in self._detectors.values():
            det.enter_grace(steps)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "seen": sorted(self._seen),
            "lead_step": self._lead_step,
            "follow_streak": self._follow_streak,
            "detectors": {f"{n}|{m}": det.state_dict() for (n, m), det in self._detectors.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != 1:
            raise ValueError(f"unsupported detector state version {state.get('version')!r}")
        for key, det_state in state["detectors"].items():
            name, metric = key.split("|", 1)
            if name not in DETECTORS or name not in self._patterns:
                continue  # a detector disabled in this configuration
            det = self._detectors.get((name, metric)) or self._add(name, metric)
            det.load_state_dict(det_state)
        self._seen = set(state.get("seen", ()))
        self._lead_step = state.get("lead_step")
        self._follow_streak = int(state.get("follow_streak", 0))
        self._plans = {}


def _rank(a: Anomaly) -> tuple[int, float]:
    return a.severity.rank, a.score / a.threshold if a.threshold else a.score


def _without_discarded(metrics: Mapping[str, float]) -> dict[str, float]:
    """A record whose update stabmon discarded (the skip guard or a data screen: ``skipped == 1``) without its
    finite loss and gradient norms: they measured a batch the run did not learn from, and a detector that read
    them would see the trouble the guard kept out (a bad batch's loss) as the trouble coming back. Non-finite
    values stay: a NaN is reported whatever was done with its update.

    >>> _without_discarded({"loss": 4.6, "grad_norm": 3.0, "grad_norm/h.0": 1.0, "skipped": 1.0, "lr": 0.1})
    {'skipped': 1.0, 'lr': 0.1}
    >>> _without_discarded({"loss": float("nan"), "skipped": 1.0})
    {'loss': nan, 'skipped': 1.0}
    """
    return {k: v for k, v in metrics.items()
            if not ((k == Metric.LOSS or k == Metric.GRAD_NORM or k.startswith(Metric.GRAD_NORM_PREFIX))
                    and math.isfinite(v))}
