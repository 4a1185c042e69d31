"""Spike detectors: upward outliers of heavy-tailed positive metrics (grad norm, loss), on log-values.

Grad norms and losses are multiplicative and heavy-tailed: a jump from 0.25 to 1.0 matters as much as one from
250 to 1000. Both detectors therefore work on ``log(value)`` and score only upward deviations (a falling loss
or grad norm is not a spike). Non-positive values (a grad norm printed as ``0.000`` by a run that did not log
it, a negative RL loss) are not observed.

Defaults, and why:

- ``z_threshold = 6``: six standard deviations of the log-value. Real grad norms are heavy-tailed, so the
  Gaussian reading of "4 sigma" (1 in 30,000) is far off: on a healthy 19.5k-step llm.c GPT-2 run a 4-sigma
  rule flags about one step in a hundred; 6 flags one in 350, each a visible excursion.
- ``min_std = 0.05``: a floor on the standard deviation in log units (about 5 % relative noise), so a
  perfectly quiet history (variance 0, or only a few points) does not make every wobble infinite; with it, the
  smallest jump that can ever be flagged is ``exp(6 * 0.05) = 1.35`` times the baseline.
- ``persist = 3``: one flagged step is a ``warning`` (healthy runs have isolated one-step blips that recover
  on their own); three consecutive flagged steps are an ``error`` - the grad norm is climbing and the run
  needs an intervention (BLOOM tr11-176B it31215-31218: four rising steps before the loss spike).
- ``grace_period = 10`` training steps at the start of training (LR warm-up: the baseline of the first steps
  means little), or 10 observations after ``enter_grace`` (an intervention, rollback or resume). A stream that
  starts mid-run (a log fragment from step 31214) is past the start of training and scores from its second
  observation, the first being its baseline (see :meth:`stabmon.detect.base.Detector._begin`).
- ``relearn_after = 50``: a shift that lasts 50 consecutive flagged points is a new regime; it has been
  reported, and the detector re-baselines instead of alarming forever.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from river import stats

from stabmon.detect.base import Detector, X
from stabmon.detect.config import (
    DetectorConfig,
    at_least_one,
    at_least_two,
    non_empty,
    non_negative,
    open_unit,
    param,
    positive,
)
from stabmon.events import Metric, Severity

_INF = math.inf


@dataclass(frozen=True)
class _LogSpikeConfig(DetectorConfig):
    """The parameters both spike detectors have."""

    metrics: tuple[str, ...] = param((Metric.GRAD_NORM, Metric.LOSS), non_empty, "watched (globs allowed)")
    grace_period: int = param(10, non_negative, "start-of-training steps (or observations after enter_grace) "
                              "learned before scoring starts")
    z_threshold: float = param(6.0, positive, "z-score of the log-value that flags a spike")
    min_std: float = param(0.05, positive, "floor on the std of the log-value")
    persist: int = param(3, at_least_one, "consecutive flagged steps that make a spike an error")
    relearn_after: int = param(50, non_negative, "flags in a row that restart the baseline (0: never)")


@dataclass(frozen=True)
class SpikeConfig(_LogSpikeConfig):
    """Parameters of :class:`EWSpike` (config key ``spike``).

    >>> SpikeConfig().z_threshold, SpikeConfig().metrics
    (6.0, ('grad_norm', 'loss'))
    """

    alpha: float = param(0.05, open_unit, "fading factor of the EW mean/var of log-values (memory ~2/alpha)")


@dataclass(frozen=True)
class RobustSpikeConfig(_LogSpikeConfig):
    """Parameters of :class:`RobustSpike` (config key ``robust_spike``).

    >>> RobustSpikeConfig().window
    64
    """

    window: int = param(64, at_least_two, "rolling window of the median and IQR")
    z_threshold: float = param(6.0, positive, "robust z-score (IQR / 1.349 as sigma) that flags a spike")


class _LogSpike(Detector):
    kind = "spike"
    config: _LogSpikeConfig

    def _value(self, x: X) -> float | None:
        v = x.get(self.metric)
        return math.log(v) if v is not None and 0.0 < v < _INF else None

    @property
    def threshold(self) -> float:
        return float(self.config.z_threshold)

    def _severity(self, score: float, streak: int) -> Severity:
        return Severity.ERROR if streak >= self.config.persist else Severity.WARNING

    def _message(self, v: float | None, score: float) -> str:
        base = math.exp(self._centre())
        ratio = f" ({v / base:.3g}x its baseline {base:.3g})" if v is not None and base > 0 else ""
        return f"{self.metric} spike: {v}{ratio}, z={score:.3g} for {self._streak} step(s)"

    def _on_flag(self) -> None:
        relearn = self.config.relearn_after
        if relearn and self._streak >= relearn:
            self._rebaseline()

    def _centre(self) -> float:
        raise NotImplementedError

    def _score(self, v: float, x: X) -> float:
        return 0.0 if self.n_learned == 0 else self._z(v)

    def _z(self, v: float) -> float:
        """The upward z-score of the log-value ``v`` against the learned baseline (0 at or below it)."""
        raise NotImplementedError

    def _observe(self, raw: float | None, x: X, scoring: bool) -> float | None:
        # the general path with the value read from ``raw`` and the score known to be finite and >= 0
        if raw is None or not 0.0 < raw < _INF:
            return None
        v = math.log(raw)
        score = self._z(v) if scoring and self.n_learned else 0.0
        if score < self._threshold:
            self._learn(v, x)
        return score

    @classmethod
    def example(cls) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
        stream = [{Metric.GRAD_NORM: 1.0 + 0.05 * math.sin(i)} for i in range(40)]
        return Metric.GRAD_NORM, stream, [{Metric.GRAD_NORM: 20.0}]


class EWSpike(_LogSpike):
    """EWMA z-score of the log-value, with river's ``stats.EWMean`` / ``stats.EWVar``.

    >>> d = EWSpike("grad_norm", SpikeConfig(grace_period=5))
    >>> for s in range(30):
    ...     _ = d.update(s, {"grad_norm": 1.0 + 0.01 * (s % 3)})
    >>> a = d.update(30, {"grad_norm": 8.0})
    >>> a.kind, a.severity.value, a.step
    ('spike', 'warning', 30)
    >>> d.update(31, {"grad_norm": 1.01}) is None   # the spike was not learned: baseline unchanged
    True
    """

    name = "spike"
    Config = SpikeConfig
    config: SpikeConfig
    _state_attrs = ("_mean", "_var")

    def _reset(self) -> None:
        self._min_std = float(self.config.min_std)
        self._mean = stats.EWMean(fading_factor=self.config.alpha)
        self._var = stats.EWVar(fading_factor=self.config.alpha)

    def _learn(self, v: float, x: X) -> None:
        self._mean.update(v)
        self._var.update(v)

    def _centre(self) -> float:
        return float(self._mean.get() or 0.0)

    def _z(self, v: float) -> float:
        d = v - self._mean.get()
        if not d > 0.0:
            return 0.0  # at or below the mean: not a spike, whatever the spread
        var = self._var.get()
        std = math.sqrt(var) if var > 0.0 else 0.0
        return d / (std if std > self._min_std else self._min_std)


class RobustSpike(_LogSpike):
    """Rolling median and IQR of the log-value (river ``stats.RollingQuantile`` / ``stats.RollingIQR``).

    The median and inter-quartile range ignore a few wild points inside the window, so a short history that
    already contains a blip still gives a sound baseline.

    >>> d = RobustSpike("loss", RobustSpikeConfig(grace_period=3, window=16))
    >>> [d.update(s, {"loss": v}) for s, v in enumerate([2.0, 2.1, 1.9, 2.0])]
    [None, None, None, None]
    >>> d.update(4, {"loss": 5.0}).metric
    'loss'
    """

    name = "robust_spike"
    Config = RobustSpikeConfig
    config: RobustSpikeConfig
    _state_attrs = ("_median", "_iqr")

    def _reset(self) -> None:
        self._min_std = float(self.config.min_std)
        self._median = stats.RollingQuantile(q=0.5, window_size=self.config.window)
        self._iqr = stats.RollingIQR(window_size=self.config.window, q_inf=0.25, q_sup=0.75)

    def _learn(self, v: float, x: X) -> None:
        self._median.update(v)
        self._iqr.update(v)

    def _centre(self) -> float:
        return float(self._median.get() or 0.0)

    def _z(self, v: float) -> float:
        d = v - (self._median.get() or 0.0)
        if d <= 0.0:
            return 0.0  # at or below the median: not a spike, whatever the spread
        std = (self._iqr.get() or 0.0) / 1.349
        return d / (std if std > self._min_std else self._min_std)


SPIKE_DETECTORS: tuple[type[Detector], ...] = (EWSpike, RobustSpike)
