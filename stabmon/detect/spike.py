"""Spike detectors: upward outliers of heavy-tailed positive metrics (grad norm, loss), on log-values.

Grad norms and losses are multiplicative and heavy-tailed: a jump from 0.25 to 1.0 matters as much as one from
250 to 1000. Both detectors therefore work on ``log(value)`` and score only upward deviations (a falling loss
or grad norm is not a spike). Non-positive values (a grad norm printed as ``0.000`` by a run that did not log
it, a negative RL loss) are not observed, with one exception: a finite negative value whose size is at least
``tolerance`` times the learned positive baseline (``error_ratio`` times during grace) is flagged as a spike and
not learned - a loss of -230 where it has been 2.3 is as corrupt as +230, and its severity is judged by its
size the same way. Positive values are scored exactly as without this rule.

Defaults, and why:

- ``z_threshold = 6``: six standard deviations of the log-value. Real grad norms are heavy-tailed, so the
  Gaussian reading of "4 sigma" (1 in 30,000) is far off: on a healthy 19.5k-step llm.c GPT-2 run a 4-sigma
  rule flags about one step in a hundred; 6 flags one in 350, each a visible excursion.
- ``min_std = 0.05``: a floor on the standard deviation in log units (about 5 % relative noise), so a
  perfectly quiet history (variance 0, or only a few points) does not make every wobble infinite; with it, the
  smallest jump that can ever be flagged is ``exp(6 * 0.05) = 1.35`` times the baseline.
- Severity: one signal alone is never evidence of damage, so a spike detector reports at most a ``warning``
  (Slack) and the runbook changes nothing for it. A flagged point is ``info`` (the trace only) while it is no
  larger than the largest excursion this detector has already seen the run come back from on its own (any
  metric: a per-example classifier logged per step jumps 100-500x on single hard examples and is back at the
  next record), and, for the metrics in ``tolerated`` (the grad norm and activations: signals the loss may or
  may not follow), while it is no larger than ``tolerance`` (8x) its baseline: the 40 healthy fine-tunes of
  ``real-finetunes`` have lone grad-norm blips of up to 6.4x in their first 50 steps (batch size 1-2), the
  healthy llm.c GPT-2 run 1.35-15.3x; BLOOM tr11-176B's grad norm climbs 3.9x, then 9.9x three steps before its
  loss spike. 8x sits between the two (docs/detectors.md has the leave-one-run-out check). Beyond that it is
  a ``warning``, and a loss flagged on ``persist = 3`` consecutive records is one too. It becomes an
  ``error`` only in the suite (:mod:`stabmon.detect.suite`): a loss spike that follows a grad-norm spike and
  is still up on the next record (two signals, and it did not come back). A loss that stays up longer is the
  regression detector's to judge.
- A score is measured against the baseline's spread, floored at ``min_std`` and at half the log's rounding
  step (a Trainer log writes 4 decimals: near 1e-4, 0.0001 -> 0.0002 is one step, not a 2x spike).
- ``grace_period = 10`` training steps at the start of training (LR warm-up: the baseline of the first steps
  means little), or 10 observations after ``enter_grace`` (an intervention, rollback or resume). A stream that
  starts mid-run (a log fragment from step 31214) is past the start of training and scores from its second
  observation, the first being its baseline (see :meth:`stabmon.detect.scorer.Scorer._begin`).
- ``relearn_after = 50``: a shift that lasts 50 consecutive flagged points is a new regime; it has been
  reported, and the detector re-baselines instead of alarming forever.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
from stabmon.detect.scorer import Scorer
from stabmon.events import Anomaly, Metric, Severity

_INF = math.inf
_ROUNDING_SAMPLES = 4  # changes between earlier values needed to estimate a log's rounding step


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
    tolerance: float = param(8.0, at_least_one, "multiple of the baseline up to which a flagged point of a "
                             "tolerated metric is info (1: every flag is at least a warning)")
    tolerated: tuple[str, ...] = param((Metric.GRAD_NORM, "grad_norm/*", Metric.ACT_RMS_PREFIX + "*"),
                                       doc="metrics (globs) whose excursions are judged against tolerance and "
                                       "the run's own history; the loss never is")
    error_ratio: float = param(100.0, at_least_one, "multiple of the baseline that is flagged at any step, "
                               "grace included (then the baseline is the run's first values)")
    corroborate_within: int = param(10, non_negative, "steps after a grad-norm spike in which a loss spike is "
                                    "an error (the loss followed: corroborated), read by the detector suite")
    corroborate_records: int = param(2, at_least_one, "consecutive records on which the loss must be flagged "
                                     "before a corroborated loss spike is an error (one that is back at the next "
                                     "record did no lasting damage), read by the detector suite")


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


class _LogSpike(Scorer):
    kind = "spike"
    config: _LogSpikeConfig
    _centre_core: Any  # set by _bind
    _spread_core: Any
    #: what :meth:`_observe` reads on every record, in one attribute: the two compiled statistics, whether the
    #: spread is a variance, ``min_std`` and the threshold (set by :meth:`_hold`)
    _hot: tuple[Any, Any, bool, float, float]

    def _value(self, x: X) -> float | None:
        v = x.get(self.metric)
        return math.log(v) if v is not None and 0.0 < v < _INF else self._negative_log(v, not self.in_grace)

    @property
    def threshold(self) -> float:
        return float(self.config.z_threshold)

    def _reset(self) -> None:
        self._min_std = float(self.config.min_std)
        self._log_error_ratio = math.log(self.config.error_ratio)
        self._tolerates = any(fnmatch.fnmatchcase(self.metric, p) for p in self.config.tolerated)
        #: log of the largest excursion (value / baseline) that the run came back from without an error
        self._survived = 0.0
        self._peak = 0.0  # log-ratio of the current (or last) excursion's largest point
        self._peak_error = False  # whether that excursion lasted `persist` records (not shrugged off)
        self._log_ratio = 0.0  # of the point being flagged

    def _flag(self, step: int, raw: float | None, score: float) -> Anomaly | None:
        if self._streak == 1:  # a new excursion: the previous one is over and, unless it was an error, survived
            if not self._peak_error:
                self._survived = max(self._survived, self._peak)
            self._peak, self._peak_error = 0.0, False
        size = abs(raw) if raw is not None else 0.0  # a negative value is judged by its size
        self._log_ratio = math.log(size) - self._centre() if size > 0 else 0.0
        self._peak = max(self._peak, self._log_ratio)
        return super()._flag(step, raw, score)

    def _severity(self, score: float, streak: int) -> Severity:
        """At most a warning: one signal is not evidence of damage (the suite raises a corroborated one)."""
        r = self._log_ratio
        if streak >= self.config.persist and not self._tolerates:
            self._peak_error = True  # a lasting excursion is not one the run shrugged off: it raises no bar
            return Severity.WARNING
        if r <= self._survived:
            return Severity.INFO  # no larger than an excursion the run already came back from on its own
        if self._tolerates and r <= math.log(self.config.tolerance):
            return Severity.INFO  # persistence alone does not lift it: a slow climb is a drift (info)
        return Severity.WARNING

    def _message(self, v: float | None, score: float) -> str:
        base = math.exp(self._centre())
        ratio = f" ({v / base:.3g}x its baseline {base:.3g})" if v is not None and base > 0 else ""
        return f"{self.metric} spike: {v}{ratio}, z={score:.3g} for {self._streak} step(s)"

    def _grace_score(self, v: float, x: X) -> float:
        """During grace only an excursion of ``error_ratio`` over the first values counts (the prior)."""
        if not self.n_learned or v - self._centre() < self._log_error_ratio:
            return 0.0
        return max(self._z(v), self._threshold)

    def _on_flag(self) -> None:
        relearn = self.config.relearn_after
        if relearn and self._streak >= relearn:
            self._rebaseline()

    def _bind(self) -> None:
        """Set ``_centre_core`` and ``_spread_core``: the compiled statistics of the baseline's centre and spread
        inside river's ``stats`` objects, which have the same ``update`` and ``get`` without a Python call
        around each (the ``stats`` object itself where a river release has none); again after a reload
        replaced them. A compiled rolling quantile aborts when read before its first ``update`` (the Python
        wrapper returns None), so the detector reads them only once ``n_learned`` is positive."""
        raise NotImplementedError

    def _hold(self) -> None:
        """Gather what :meth:`_observe` reads on every record into ``_hot`` (after :meth:`_bind`)."""
        c = self.config
        self._hot = (self._centre_core, self._spread_core, self._spread_is_variance, float(c.min_std),
                     float(c.z_threshold))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self._bind()
        self._hold()

    #: the spread statistic is a variance (its square root is the std), else an inter-quartile range
    _spread_is_variance = True

    def _centre(self) -> float:
        return float(self._centre_core.get()) if self.n_learned else 0.0

    def _std(self) -> float:
        """The std of the learned log-values, floored at ``min_std``."""
        s = self._spread_core.get() if self.n_learned else 0.0
        std = (math.sqrt(s) if s > 0.0 else 0.0) if self._spread_is_variance else s / 1.349
        return std if std > self._min_std else self._min_std

    def _score(self, v: float, x: X) -> float:
        if self.n_learned == 0:
            return 0.0
        return max(self._z(v), self._threshold) if x.get(self.metric, 0.0) < 0.0 else self._z(v)

    def _z(self, v: float) -> float:
        """The upward z-score of the log-value ``v`` against the learned baseline (0 at or below it). The
        spread is at least half the log's rounding step at the baseline (see :meth:`_rounding`)."""
        centre = self._centre()
        d = v - centre
        if d <= 0.0:
            return 0.0  # at or below the centre: no spike, whatever the spread
        return d / max(self._std(), self._rounding(centre))

    def _rounding(self, centre: float) -> float:
        """Half a rounding step at the baseline, in log units: the smallest change between consecutive values of
        the recent window (a Trainer log writes 4 decimals: near 1e-4, 0.0001 -> 0.0002 is one step, not a
        2x spike). Computed only for a point that the statistics alone would flag."""
        values = [v for _, v in self._recent_evidence()][:-1]  # the point being judged is not its own yardstick
        steps = [abs(b - a) for a, b in itertools.pairwise(values) if b != a and math.isfinite(b - a)]
        if len(steps) < _ROUNDING_SAMPLES:
            return 0.0
        return 0.5 * math.log1p(min(steps) / math.exp(centre))

    def _learn(self, v: float, x: X) -> None:
        self._centre_core.update(v)
        self._spread_core.update(v)

    def _observe(self, raw: float | None, x: X, scoring: bool) -> float | None:
        # the default with the statistics read in place: the value comes from ``raw``, the score is finite and
        # >= 0, and a point that cannot flag even on the floored spread alone skips the rounding step (a score
        # below the threshold need not be exact)
        if raw is None or not 0.0 < raw < _INF:
            neg = self._negative_log(raw, scoring)
            return None if neg is None else max(self._z(neg), self._threshold)
        v = math.log(raw)
        centre, spread, is_variance, min_std, threshold = self._hot
        if not scoring:
            score = self._grace_score(v, x)
        elif not self.n_learned:
            score = 0.0
        else:
            d = v - centre.get()
            if d <= 0.0:
                score = 0.0
            else:
                s = spread.get()
                std = (math.sqrt(s) if s > 0.0 else 0.0) if is_variance else s / 1.349
                score = d / (std if std > min_std else min_std)
                if score >= threshold:
                    score = self._z(v)  # with the rounding step
        if score < threshold:
            centre.update(v)
            spread.update(v)
        return score

    def _negative_log(self, raw: float | None, scoring: bool) -> float | None:
        """``log(-raw)`` of a finite negative value at least ``tolerance`` (in grace: ``error_ratio``) times the
        size of the learned positive baseline, which then scores as a spike (never learned); None for any other
        non-positive value (not observed)."""
        if raw is None or not -_INF < raw < 0.0 or not self.n_learned:
            return None
        v = math.log(-raw)
        bound = math.log(self.config.tolerance) if scoring else self._log_error_ratio
        return v if v - self._centre() >= bound else None

    @classmethod
    def example(cls) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
        stream = [{Metric.GRAD_NORM: 1.0 + 0.05 * math.sin(i)} for i in range(40)]
        return Metric.GRAD_NORM, stream, [{Metric.GRAD_NORM: 20.0}]


class EWSpike(_LogSpike):
    """EWMA z-score of the log-value, with river's ``stats.EWMean`` / ``stats.EWVar``.

    >>> d = EWSpike("grad_norm", SpikeConfig(grace_period=5))
    >>> for s in range(30):
    ...     _ = d.update(s, {"grad_norm": 1.0 + 0.01 * (s % 3)})
    >>> a = d.update(30, {"grad_norm": 8.0})     # within 8x its baseline: info
    >>> a.kind, a.severity.value, a.step
    ('spike', 'info', 30)
    >>> d.update(31, {"grad_norm": 1.01}) is None   # the spike was not learned: baseline unchanged
    True
    >>> d.update(32, {"grad_norm": 30.0}).severity.value   # 30x: a warning (one signal: never an error)
    'warning'
    """

    name = "spike"
    Config = SpikeConfig
    config: SpikeConfig
    _state_attrs = ("_mean", "_var", "_survived", "_peak", "_peak_error")

    def _reset(self) -> None:
        super()._reset()
        self._mean = stats.EWMean(fading_factor=self.config.alpha)
        self._var = stats.EWVar(fading_factor=self.config.alpha)
        self._bind()
        self._hold()

    def _bind(self) -> None:
        self._centre_core = getattr(self._mean, "_ewmean", self._mean)  # see _LogSpike._bind
        self._spread_core = getattr(self._var, "_ewvar", self._var)


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
    _state_attrs = ("_median", "_iqr", "_survived", "_peak", "_peak_error")

    _spread_is_variance = False

    def _reset(self) -> None:
        super()._reset()
        self._median = stats.RollingQuantile(q=0.5, window_size=self.config.window)
        self._iqr = stats.RollingIQR(window_size=self.config.window, q_inf=0.25, q_sup=0.75)
        self._bind()
        self._hold()

    def _bind(self) -> None:
        self._centre_core = getattr(self._median, "_rolling_quantile", self._median)  # see _LogSpike._bind
        self._spread_core = getattr(self._iqr, "_rolling_iqr", self._iqr)


SPIKE_DETECTORS: tuple[type[Detector], ...] = (EWSpike, RobustSpike)
