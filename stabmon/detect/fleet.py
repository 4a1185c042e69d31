"""Detectors on the per-rank ``fleet/*`` metrics (:mod:`stabmon.collect.ranks`): one slow rank, replicas
that disagree.

A fleet-wide slow-down is :class:`~stabmon.detect.trends.StepTimeRegression` on ``fleet/step_time``; these two
look at the one rank that differs, which a mean across ranks hides.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from stabmon.detect.base import Detector, X
from stabmon.detect.config import DetectorConfig, at_least_one, at_least_two, non_empty, param, positive
from stabmon.events import Metric, Severity


@dataclass(frozen=True)
class StragglerConfig(DetectorConfig):
    """Parameters of :class:`Straggler` (config key ``straggler``).

    >>> StragglerConfig().min_ratio, StragglerConfig().patience, StragglerConfig().window
    (1.1, 8, 16)
    """

    metrics: tuple[str, ...] = param((Metric.STRAGGLER_RATIO,), non_empty, "slowest-rank ratio metric")
    min_ratio: float = param(1.1, positive, "slowest / median time from which a step counts as slow")
    window: int = param(16, at_least_two, "recent steps looked at")
    patience: int = param(8, at_least_one, "slow steps of the same rank within the window that are reported")


class Straggler(Detector):
    """One rank slower than the fleet median in ``patience`` of the last ``window`` steps (NVRx-style: a
    rank's time against the fleet median). The anomaly names the rank and how much slower it is (the median
    of its slow steps' ratios). ``warning``; the window restarts after a report, so a rank that stays slow
    is reported again once the window has filled again.

    >>> d = Straggler(Metric.STRAGGLER_RATIO, StragglerConfig(window=4, patience=3))
    >>> found = [d.update(s, {Metric.STRAGGLER_RATIO: 1.25, Metric.STRAGGLER_RANK: 3.0}) for s in range(4)]
    >>> [a.message for a in found if a is not None]
    ['rank 3 is 1.25x slower than the fleet median in 3 of the last 3 steps']
    """

    name = "straggler"
    kind = "straggler"
    Config = StragglerConfig
    config: StragglerConfig
    _state_attrs = ("_window",)

    def _reset(self) -> None:
        self._window: deque[tuple[int, float]] = deque(maxlen=self.config.window - 1)
        self._last: tuple[int, list[float]] = (-1, [])

    def _value(self, x: X) -> float | None:
        v, rank = x.get(self.metric), x.get(Metric.STRAGGLER_RANK)
        ok = v is not None and math.isfinite(v) and v > 0 and rank is not None and math.isfinite(rank)
        return float(v) if ok else None  # type: ignore[arg-type]

    def _learn(self, v: float, x: X) -> None:
        self._window.append((int(x[Metric.STRAGGLER_RANK]), v))

    def _score(self, v: float, x: X) -> float:
        rank = int(x[Metric.STRAGGLER_RANK])
        slow = [r for k, r in (*self._window, (rank, v)) if k == rank and r >= self.config.min_ratio]
        self._last = (rank, slow)
        return statistics.median(slow) if len(slow) >= self.config.patience else 0.0

    def _on_flag(self) -> None:
        self._window.clear()

    @property
    def threshold(self) -> float:
        return float(self.config.min_ratio)

    def _message(self, v: float | None, score: float) -> str:
        rank, slow = self._last
        return (f"rank {rank} is {score:.2f}x slower than the fleet median in {len(slow)} of the last "
                f"{len(self._window) + 1} steps")

    @classmethod
    def example(cls) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
        healthy = [{Metric.STRAGGLER_RATIO: 1.02 + 0.01 * (s % 3), Metric.STRAGGLER_RANK: float(s % 4)}
                   for s in range(40)]
        bad = [{Metric.STRAGGLER_RATIO: 1.2, Metric.STRAGGLER_RANK: 2.0}] * 20
        return Metric.STRAGGLER_RATIO, healthy, bad


@dataclass(frozen=True)
class DivergenceConfig(DetectorConfig):
    """Parameters of :class:`Divergence` (config key ``divergence``).

    >>> DivergenceConfig().tolerance
    1e-06
    """

    metrics: tuple[str, ...] = param((Metric.DIVERGENCE,), non_empty, "cross-rank divergence metric")
    tolerance: float = param(1e-6, positive, "relative distance from the median from which replicas disagree")


class Divergence(Detector):
    """Replicas that must agree do not (metaseq-style consistency check): under DDP every rank holds the
    same parameters and the same reduced gradients, so their checksums and gradient norms are equal; a rank
    whose value is ``tolerance`` (relative) away from the median holds corrupt state (silent data corruption,
    a bad host, a missed broadcast). ``error``, naming the rank.

    >>> d = Divergence(Metric.DIVERGENCE)
    >>> d.update(0, {Metric.DIVERGENCE: 0.0, Metric.DIVERGENT_RANK: 0.0}) is None
    True
    >>> d.update(1, {Metric.DIVERGENCE: 0.02, Metric.DIVERGENT_RANK: 2.0}).message
    'rank 2 disagrees with the other replicas: 0.02 relative distance from the median >= 1e-06'
    """

    name = "divergence"
    kind = "divergence"
    Config = DivergenceConfig
    config: DivergenceConfig

    def _reset(self) -> None:
        self._rank = -1  # of the point being scored; not state

    def _learn(self, v: float, x: X) -> None:
        return None

    def _score(self, v: float, x: X) -> float:
        rank = x.get(Metric.DIVERGENT_RANK)
        self._rank = int(rank) if rank is not None and math.isfinite(rank) else -1
        return v

    @property
    def threshold(self) -> float:
        return float(self.config.tolerance)

    def _severity(self, score: float, streak: int) -> Severity:
        return Severity.ERROR

    def _message(self, v: float | None, score: float) -> str:
        return (f"rank {self._rank} disagrees with the other replicas: {score:.3g} relative distance from the "
                f"median >= {self.threshold:.3g}")

    @classmethod
    def example(cls) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
        healthy = [{Metric.DIVERGENCE: 0.0, Metric.DIVERGENT_RANK: 0.0} for _ in range(20)]
        return Metric.DIVERGENCE, healthy, [{Metric.DIVERGENCE: 0.5, Metric.DIVERGENT_RANK: 1.0}]


FLEET_DETECTORS: tuple[type[Detector], ...] = (Straggler, Divergence)
