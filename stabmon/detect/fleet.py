"""Detectors on the per-rank ``fleet/*`` metrics (:mod:`stabmon.collect.cluster.ranks`): one slow rank, replicas
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
from stabmon.detect.config import (
    DetectorConfig,
    at_least_one,
    at_least_two,
    non_empty,
    non_negative,
    param,
    positive,
)
from stabmon.detect.scorer import Scorer
from stabmon.events import Metric, Severity


@dataclass(frozen=True)
class StragglerConfig(DetectorConfig):
    """Parameters of :class:`Straggler` (config key ``straggler``).

    >>> StragglerConfig().min_ratio, StragglerConfig().patience, StragglerConfig().window
    (1.1, 12, 16)
    """

    metrics: tuple[str, ...] = param((Metric.STRAGGLER_RATIO,), non_empty, "slowest-rank ratio metric")
    min_ratio: float = param(1.1, positive, "slowest / median time from which a step counts as slow")
    window: int = param(16, at_least_two, "recent steps looked at")
    patience: int = param(12, at_least_one, "slow steps of the same rank within the window that are reported")
    min_seconds: float = param(
        0.02, non_negative, "smallest time a slow step costs the fleet (slowest - median), in seconds"
    )
    noise_factor: float = param(
        2.0, non_negative, "times the fleet's noise (the median excess ratio of the steps other ranks were the "
        "slowest in) a slow step must exceed"
    )
    noise_window: int = param(64, at_least_two, "recent steps the fleet's noise is measured over")


class Straggler(Scorer):
    """One rank slower than the fleet median in ``patience`` of the last ``window`` steps (NVRx-style: a
    rank's time against the fleet median), judged against the fleet's own noise. A step counts as slow for
    its slowest rank when its ratio reaches ``min_ratio`` and ``1 + noise_factor x`` the fleet's noise (the
    median excess ratio of the recent steps in which *other* ranks were the slowest: on a shared machine every
    rank is the slowest now and then, by about that much), and it cost at least ``min_seconds`` (slowest minus
    median, from ``fleet/step_time``). The same rank must be the slow one in ``patience`` (12) of ``window``
    (16) steps: on two ranks that flip by chance, 12 of 16 happens in under 3% of windows even before the
    ratio and seconds bars. The anomaly names the rank and what was seen. ``warning``; the window restarts
    after a report, so a rank that stays slow is reported again once the window has filled again.

    >>> d = Straggler(Metric.STRAGGLER_RATIO, StragglerConfig(window=4, patience=3))
    >>> x = {Metric.STRAGGLER_RATIO: 1.25, Metric.STRAGGLER_RANK: 3.0, Metric.FLEET_STEP_TIME: 0.4}
    >>> found = [d.update(s, x) for s in range(4)]
    >>> [a.message for a in found if a is not None]  # doctest: +NORMALIZE_WHITESPACE
    ['rank 3 was the slowest in 3 of the last 3 steps, 1.25x the fleet median (+0.1 s per step; bar 1.1x,
      fleet noise 0x)']
    """

    name = "straggler"
    kind = "straggler"
    Config = StragglerConfig
    config: StragglerConfig
    _state_attrs = ("_window", "_history")

    def _reset(self) -> None:
        # (rank, ratio, seconds the step cost the fleet; NaN when fleet/step_time was not recorded)
        self._window: deque[tuple[int, float, float]] = deque(maxlen=self.config.window - 1)
        self._history: deque[tuple[int, float]] = deque(maxlen=self.config.noise_window)  # (rank, ratio)
        self._last: tuple[int, list[tuple[float, float]], float, float] = (-1, [], 0.0, 0.0)  # not state

    def _value(self, x: X) -> float | None:
        v, rank = x.get(self.metric), x.get(Metric.STRAGGLER_RANK)
        ok = v is not None and math.isfinite(v) and v > 0 and rank is not None and math.isfinite(rank)
        return float(v) if ok else None  # type: ignore[arg-type]

    @staticmethod
    def _cost(v: float, x: X) -> float:
        median = x.get(Metric.FLEET_STEP_TIME)
        return (v - 1.0) * median if median is not None and math.isfinite(median) else math.nan

    def _learn(self, v: float, x: X) -> None:
        rank = int(x[Metric.STRAGGLER_RANK])
        self._window.append((rank, v, self._cost(v, x)))
        self._history.append((rank, v))

    def _noise(self, rank: int) -> float:
        """The median excess ratio of the recent steps in which another rank was the slowest."""
        others = [r - 1.0 for k, r in self._history if k != rank]
        return statistics.median(others) if others else 0.0

    def _score(self, v: float, x: X) -> float:
        rank = int(x[Metric.STRAGGLER_RANK])
        noise = self._noise(rank)
        bar = max(self.config.min_ratio, 1.0 + self.config.noise_factor * noise)
        floor = self.config.min_seconds
        slow = [(r, c) for k, r, c in (*self._window, (rank, v, self._cost(v, x)))
                if k == rank and r >= bar and not c < floor]  # an unknown cost (NaN) does not veto
        self._last = (rank, slow, bar, noise)
        return statistics.median(r for r, _ in slow) if len(slow) >= self.config.patience else 0.0

    def _on_flag(self) -> None:
        self._window.clear()

    @property
    def threshold(self) -> float:
        return float(self.config.min_ratio)

    def _message(self, v: float | None, score: float) -> str:
        rank, slow, bar, noise = self._last
        costs = [c for _, c in slow if math.isfinite(c)]
        cost = f"+{statistics.median(costs):.3g} s per step; " if costs else ""
        return (f"rank {rank} was the slowest in {len(slow)} of the last {len(self._window) + 1} steps, "
                f"{score:.3g}x the fleet median ({cost}bar {bar:.3g}x, fleet noise {noise:.3g}x)")

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


class Divergence(Scorer):
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
