"""Progress detectors: the loss got persistently worse than it had been, or never improved at all.

Spike detectors compare each point with a learned baseline, so a run that was wrecked before its baseline
formed (a learning rate far too high from the start) or that degrades slowly enough to drag the baseline along
(a schedule that keeps raising the LR) never looks anomalous to them. These two compare the loss with the run's
own history instead, and need no grace period: both are about the loss, both are ``error`` severity, both
speak only after the condition has held for many steps.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from stabmon.detect import window
from stabmon.detect.base import Detector, X
from stabmon.detect.config import DetectorConfig, at_least_one, non_empty, open_unit, param
from stabmon.events import Anomaly, Metric, Severity


@dataclass(frozen=True)
class RegressionConfig(DetectorConfig):
    """Parameters of :class:`LossRegression` (config key ``regression``).

    >>> RegressionConfig().rise, RegressionConfig().patience
    (0.1, 20)
    """

    metrics: tuple[str, ...] = param((Metric.LOSS,), non_empty, "loss-like metrics (lower is better)")
    window: int = param(20, at_least_one, "steps in the rolling median compared with the best one")
    rise: float = param(0.1, open_unit, "relative rise of the rolling median over its best that counts")
    patience: int = param(20, at_least_one, "consecutive steps above best x (1 + rise) before reporting")
    evidence: int = param(48, at_least_one, "length of the (step, value) evidence window")


class LossRegression(Detector):
    """The loss's rolling median stays more than ``rise`` above the best rolling median the run has reached,
    for ``patience`` steps in a row: the run has got worse and is not coming back by itself. ``error``, reported
    once per excursion (again once the loss has come back, or after a rollback). Silent for a loss that has
    been zero or negative (an RL objective, not a likelihood).

    A healthy run's smoothed loss does not climb 10% above its best and stay there; a diverging run, a model
    wrecked by corrupted data or weights, or a learning rate that has crept past the edge of stability does.
    The evidence reaches back before the rise, so its first step is a usable onset for a rollback.

    >>> d = LossRegression("loss", RegressionConfig(window=5, patience=5))
    >>> losses = [3.0 - 0.01 * s for s in range(100)] + [2.6] * 30
    >>> found = [d.update(s, {"loss": v}) for s, v in enumerate(losses)]
    >>> first = next(a for a in found if a); first.step, first.severity.value
    (106, 'error')
    """

    name = "regression"
    kind = "regression"
    Config = RegressionConfig
    config: RegressionConfig
    grace_exempt = "it compares the loss with the run's own best, which no warm-up can fake"
    learns_flagged = "its rolling median must see every loss, flagged or not"
    _state_attrs = ("_recent", "_best", "_above", "_last_step", "_positive")

    def _reset(self) -> None:
        self._recent: deque[float] = deque(maxlen=self.config.window)
        self._sorted: list[float] = []  # the same values, sorted (derived, not saved)
        self._best = float("inf")
        self._above = 0
        self._last_step = -1
        self._positive = True  # a loss that has been <= 0 is no likelihood: a relative rise means nothing

    def update(self, step: int, x: X) -> Anomaly | None:
        if step <= self._last_step:  # the step counter went back (a rollback): a new timeline, same best
            self._recent.clear()
            self._sorted.clear()
            self._above = 0
        self._last_step = step
        raw = x.get(self.metric)
        if raw is not None:
            self._evidence.append((step, raw))
        v = self._value(x)
        if v is None or not self._positive:
            return None
        if v <= 0:
            self._positive = False
            return None
        window.push(self._recent, self._sorted, v)
        self.n_learned += 1
        if len(self._recent) < self._recent.maxlen:  # type: ignore[operator]
            return None
        median = window.median(self._sorted)
        if median <= self._best * (1 + self.config.rise):
            self._best, self._above = min(self._best, median), 0
            return None
        self._above += 1
        if self._above != self.config.patience:  # reported once per excursion, when it has lasted long enough
            return None
        return self._flag(step, raw, median / self._best)

    def _learn(self, v: float, x: X) -> None:  # river-shaped API: the window update() keeps
        window.push(self._recent, self._sorted, v)

    def load_state_dict(self, state: Any) -> None:
        super().load_state_dict(state)
        self._sorted = sorted(self._recent)

    def _score(self, v: float, x: X) -> float:
        if len(self._recent) < self._recent.maxlen or self._best == float("inf"):  # type: ignore[operator]
            return 0.0
        return statistics.median([*self._recent, v][1:]) / self._best

    @property
    def threshold(self) -> float:
        return 1.0 + self.config.rise

    def _severity(self, score: float, streak: int) -> Severity:
        return Severity.ERROR

    def _message(self, v: float | None, score: float) -> str:
        return (f"{self.metric} has stayed {score - 1:.0%} above its best (median {self._best:.4g}) for "
                f"{self._above} steps")

    @classmethod
    def example(cls) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
        stream = [{Metric.LOSS: 3.0 - 0.005 * i + 0.01 * (i % 3)} for i in range(120)]
        return Metric.LOSS, stream, [{Metric.LOSS: 4.0}] * 60


@dataclass(frozen=True)
class NoProgressConfig(DetectorConfig):
    """Parameters of :class:`NoProgress` (config key ``no_progress``).

    >>> NoProgressConfig().by_step, NoProgressConfig().min_drop
    (100, 0.1)
    """

    metrics: tuple[str, ...] = param((Metric.LOSS,), non_empty, "loss-like metrics (lower is better)")
    window: int = param(10, at_least_one, "steps in the rolling medians compared (the first ones, the last ones)")
    by_step: int = param(100, at_least_one, "training step by which the loss must have fallen")
    min_drop: float = param(0.1, open_unit, "relative fall of the loss from its first steps that counts as progress")


class NoProgress(Detector):
    """A run that starts from scratch and has not learned: by training step ``by_step``, the rolling median of
    the loss is still within ``min_drop`` of the median of its first ``window`` steps. ``error``.

    A model wrecked in its first steps (a learning rate far too high, no warm-up) sits at the loss of
    predicting token frequencies and never flags a spike: there was never a baseline to spike against. A
    healthy pre-training run falls by far more than 10% in its first hundred steps. It judges only a stream
    that begins at the start of training (its first step below ``window``), and it reports each time
    ``by_step`` is passed without progress (again after a rollback to before it). Fine-tuning a
    pre-trained model can fall more slowly: raise ``by_step`` or turn it off there (``enabled: false``).
    The evidence starts at the run's first step, which is where a rollback must go.

    >>> d = NoProgress("loss")
    >>> found = [d.update(s, {"loss": 2.6 - 0.001 * s}) for s in range(120)]
    >>> [a.step for a in found if a], found[100].severity.value
    ([100], 'error')
    """

    name = "no_progress"
    kind = "no_progress"
    Config = NoProgressConfig
    config: NoProgressConfig
    grace_exempt = "it judges the warm-up itself"
    learns_flagged = "its rolling median must see every loss, flagged or not"
    _state_attrs = ("_first", "_recent", "_judged", "_start")

    def _reset(self) -> None:
        self._first: list[tuple[int, float]] = []
        self._recent: deque[float] = deque(maxlen=self.config.window)
        self._judged = False
        self._start: int | None = None

    def update(self, step: int, x: X) -> Anomaly | None:
        v = self._value(x)
        if v is None:
            return None
        if self._start is None:
            self._start = step
        if self._start >= self.config.window:
            return None  # a stream cut from the middle of a run: its start is not ours to judge
        if len(self._first) < self.config.window:
            self._first.append((step, v))
        self._recent.append(v)
        self._evidence.append((step, v))
        self.n_learned += 1
        if step < self.config.by_step:
            self._judged = False  # back before by_step (a rollback): judge again when it is passed
            return None
        if self._judged:
            return None
        self._judged = True
        score = self._score(v, x)
        if score < self.threshold:
            return None
        anomaly = self._flag(step, v, score)
        return dataclasses.replace(anomaly, evidence=(self._first[0], *anomaly.evidence))

    def _learn(self, v: float, x: X) -> None:
        self._recent.append(v)

    def _score(self, v: float, x: X) -> float:
        if not self._first:
            return 0.0
        first = statistics.median(value for _, value in self._first)
        return statistics.median(self._recent) / first if first > 0 else 0.0

    @property
    def threshold(self) -> float:
        return 1.0 - self.config.min_drop

    def _severity(self, score: float, streak: int) -> Severity:
        return Severity.ERROR

    def _message(self, v: float | None, score: float) -> str:
        return (f"{self.metric} has fallen only {1 - score:.0%} from its first steps by step "
                f"{self.config.by_step} (needs {self.config.min_drop:.0%}): the run is not learning")

    @classmethod
    def example(cls) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
        return Metric.LOSS, [{Metric.LOSS: 2.6 + 0.01 * (i % 3)} for i in range(90)], [{Metric.LOSS: 2.6}] * 20


PROGRESS_DETECTORS: tuple[type[Detector], ...] = (LossRegression, NoProgress)
