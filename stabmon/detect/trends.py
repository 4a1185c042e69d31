"""Slow detectors: upward drift, frozen embeddings, step-time regression."""

from __future__ import annotations

import bisect
import copy
import math
from collections import deque
from dataclasses import dataclass

from river import drift, stats

from stabmon.detect import window
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


@dataclass(frozen=True)
class DriftConfig(DetectorConfig):
    """Parameters of :class:`Drift` (config key ``drift``).

    >>> DriftConfig().metrics
    ('grad_norm', 'act_rms/*')
    """

    metrics: tuple[str, ...] = param((Metric.GRAD_NORM, Metric.ACT_RMS_PREFIX + "*"), non_empty,
                                     "metrics watched (globs allowed)")
    delta: float = param(0.005, non_negative, "tolerated upward deviation of the log-value per step")
    threshold: float = param(25.0, positive, "Page-Hinkley statistic (log units) that signals a drift")
    min_instances: int = param(100, at_least_one, "observations before the test can fire")
    alpha: float = param(0.999, open_unit, "forgetting factor of the cumulative sum")
    evidence: int = param(32, at_least_one, "length of the (step, value) evidence window")


_PH_INTERNALS = all(
    hasattr(drift.PageHinkley(), a) for a in ("_x_mean", "_sum_increase", "_min_increase", "min_instances")
)
# the whole of river's PageHinkley.update, for the inline copy in Drift.update (checked against river's own
# update, bit for bit, by the contract suite)
_PH_UPDATE_INLINE = _PH_INTERNALS and all(
    hasattr(drift.PageHinkley(), a) for a in ("_sum_decrease", "_max_decrease", "_drift_detected", "alpha", "delta")
) and all(hasattr(drift.PageHinkley()._x_mean, a) for a in ("n", "_mean"))


class Drift(Scorer):
    """Slow upward trend of a log-metric (grad norm, activation RMS): river's ``drift.PageHinkley``, mode
    ``up``.

    The Page-Hinkley statistic accumulates ``log(x) - mean - delta``; a level that creeps up by a few percent
    per hundred steps crosses ``threshold`` after a few hundred steps, long before a spike detector would
    notice (OPT-175B run 12.43: activation norms and grad norm drifting up ahead of divergence). ``info``
    severity: a trend of the grad norm or of an activation is context for the trace, not a reason to message
    anyone: healthy runs have them - the grad norm rises while the LR warms up and again as it decays (the
    healthy llm.c GPT-2 run is reported drifting at step 3221) - and a drift that matters shows up in the
    loss, which the spike and regression detectors judge. After reporting, the test restarts.

    >>> d = Drift("grad_norm", DriftConfig(min_instances=20, threshold=2.0))
    >>> found = [d.update(s, {"grad_norm": 1.0 + (0.0 if s < 50 else 0.02 * (s - 50))}) for s in range(200)]
    >>> first = next(a for a in found if a is not None)
    >>> first.kind, first.step > 50
    ('drift', True)
    """

    name = "drift"
    kind = "drift"
    Config = DriftConfig
    config: DriftConfig
    _state_attrs = ("_ph",)

    def _reset(self) -> None:
        c = self.config
        self._ph = drift.PageHinkley(min_instances=c.min_instances, delta=c.delta, threshold=c.threshold,
                                     alpha=c.alpha, mode="up")

    def _value(self, x: X) -> float | None:
        v = x.get(self.metric)
        return math.log(v) if v is not None and math.isfinite(v) and v > 0 else None

    def _learn(self, v: float, x: X) -> None:
        self._ph.update(v)

    def _score(self, v: float, x: X) -> float:
        ph = self._ph
        try:  # what the test statistic would be after seeing v (river's arithmetic), without learning v
            n, mean = ph._x_mean.n, ph._x_mean.get()
            new_mean = mean + (1.0 / (n + 1)) * (v - mean)
            s = ph.alpha * ph._sum_increase + (v - new_mean) - ph.delta
            stat = s - min(ph._min_increase, s)
            return stat if n + 1 >= ph.min_instances else 0.0
        except AttributeError:  # a river release with different internals: probe a copy
            probe = copy.deepcopy(ph)
            probe.update(v)
            return self.threshold if probe.drift_detected else 0.0

    @property
    def threshold(self) -> float:
        return float(self.config.threshold)

    def _on_flag(self) -> None:
        self._reset()

    def _observe(self, raw: float | None, x: X, scoring: bool) -> float | None:
        if not (scoring and _PH_INTERNALS) or raw is None or not 0.0 < raw < _INF:
            return super()._observe(raw, x, scoring)
        # learn first, then read the test statistic. Equivalent to score-then-learn because a report restarts
        # the test (`_on_flag`), discarding the point with the old statistics; it saves computing the
        # statistic twice.
        ph = self._ph
        v = math.log(raw)
        if not _PH_UPDATE_INLINE or ph._drift_detected:
            ph.update(v)
            return ph._sum_increase - ph._min_increase if ph._x_mean.n >= ph.min_instances else 0.0
        # river's PageHinkley.update (mode "up"; its Mean.update with weight 1), inline: the same arithmetic in
        # the same order, without six Python calls per record (the contract suite compares it with river's)
        mean = ph._x_mean
        mean.n += 1.0
        mean._mean += (1.0 / mean.n) * (v - mean._mean)
        dev = v - mean._mean
        up = ph._sum_increase = ph.alpha * ph._sum_increase + dev - ph.delta
        down = ph._sum_decrease = ph.alpha * ph._sum_decrease + dev + ph.delta
        if up < ph._min_increase:
            ph._min_increase = up
        if down > ph._max_decrease:
            ph._max_decrease = down
        if mean.n < ph.min_instances:
            return 0.0
        score = up - ph._min_increase
        ph._drift_detected = score > ph.threshold
        return score

    def _severity(self, score: float, streak: int) -> Severity:
        return Severity.INFO

    def _message(self, v: float | None, score: float) -> str:
        return f"{self.metric} is drifting upward (Page-Hinkley {score:.3g} >= {self.threshold:.3g}), now {v}"

    @classmethod
    def example(cls) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
        stream = [{Metric.GRAD_NORM: 1.0 + 0.01 * (i % 2)} for i in range(150)]
        return Metric.GRAD_NORM, stream, [{Metric.GRAD_NORM: 1e30}]


@dataclass(frozen=True)
class FrozenEmbeddingConfig(DetectorConfig):
    """Parameters of :class:`FrozenEmbedding` (config key ``frozen_embedding``).

    >>> FrozenEmbeddingConfig().epsilon, FrozenEmbeddingConfig().patience
    (1e-07, 100)
    """

    metrics: tuple[str, ...] = param((Metric.EMB_UPDATE_PREFIX + "*",), non_empty, "update-ratio metrics")
    epsilon: float = param(1e-7, positive, "update ratio below which a matrix did not move")
    patience: int = param(100, at_least_one, "training steps frozen (first to last frozen sample) that are reported")


class FrozenEmbedding(Scorer):
    """An embedding whose update ratio ``||W_t - W_{t-1}|| / ||W_t||`` stays below ``epsilon`` for
    ``patience`` training steps while the rest of the model moves (non-zero finite grad norm, learning rate
    not 0). ``warning``. Counted in steps, not samples: the monitor samples embeddings every 10 steps, and a
    frozen embedding must be reported within a few hundred steps whatever the sampling.

    ``epsilon = 1e-7`` is about fp32's relative precision: a smaller ratio cannot be told from no update at
    all. OPT-175B trained for a while with frozen positional embeddings without anyone noticing.

    >>> d = FrozenEmbedding("emb_update/wpe", FrozenEmbeddingConfig(patience=3))
    >>> found = [d.update(s, {"emb_update/wpe": 0.0, "grad_norm": 0.5}) for s in range(3)]
    >>> found[-1].kind
    'frozen_embedding'
    >>> d.update(3, {"emb_update/wpe": 0.0, "grad_norm": 0.0}) is None   # nothing moves at all
    True
    """

    name = "frozen_embedding"
    kind = "frozen_embedding"
    Config = FrozenEmbeddingConfig
    config: FrozenEmbeddingConfig
    _state_attrs = ("_since",)

    def _reset(self) -> None:
        self._since: int | None = None  # first step of the current frozen stretch

    def _clock(self) -> int:
        """The training step of the record being judged: the last in the evidence window, which holds it (the
        guard, or the suite, fills it before the detector sees the record); in the river API, which has no
        steps, one observation is one step."""
        return self._evidence[-1][0] if self._evidence else self.n_learned

    @staticmethod
    def _rest_moves(x: X) -> bool:
        g = x.get(Metric.GRAD_NORM)
        lr = x.get(Metric.LR)
        return g is not None and math.isfinite(g) and g > 0 and (lr is None or lr > 0)

    def _is_frozen(self, v: float, x: X) -> bool:
        return abs(v) < self.config.epsilon and self._rest_moves(x)

    def _learn(self, v: float, x: X) -> None:
        if not self._is_frozen(v, x):
            self._since = None
        elif self._since is None:
            self._since = self._clock()

    def _score(self, v: float, x: X) -> float:
        if not self._is_frozen(v, x):
            return 0.0
        since = self._since if self._since is not None else self._clock()
        return float(self._clock() - since + 1)

    def _on_flag(self) -> None:
        self._since = None

    @property
    def threshold(self) -> float:
        return float(self.config.patience)

    def _message(self, v: float | None, score: float) -> str:
        return f"{self.metric} below {self.config.epsilon:g} for {score:.0f} steps while the model trains"

    @classmethod
    def example(cls) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
        m = Metric.EMB_UPDATE_PREFIX + "wte"
        stream = [{m: 1e-4, Metric.GRAD_NORM: 1.0} for _ in range(20)]
        return m, stream, [{m: 0.0, Metric.GRAD_NORM: 1.0}] * 100


@dataclass(frozen=True)
class StepTimeConfig(DetectorConfig):
    """Parameters of :class:`StepTimeRegression` (config key ``step_time``).

    >>> StepTimeConfig().max_regression
    0.05
    """

    metrics: tuple[str, ...] = param(
        (Metric.STEP_TIME, Metric.FLEET_STEP_TIME), non_empty, "step-time metrics (this rank's, the fleet median)"
    )
    max_regression: float = param(0.05, positive, "relative slow-down of the recent median that is reported")
    short_window: int = param(20, at_least_two, "recent steps whose median is compared")
    long_window: int = param(500, at_least_two, "baseline steps (median)")
    min_seconds: float = param(0.02, non_negative, "smallest slow-down of the recent median, in seconds per step")
    noise_factor: float = param(
        2.0, non_negative, "times the run's own noise (the 90th percentile of the recent median's healthy "
        "excursions from the baseline) a slow-down must exceed"
    )
    patience: int = param(20, at_least_one, "consecutive slow steps (recent median over the bar) before a report")
    grace_period: int = param(50, non_negative, "steps from the start (observations after enter_grace) unscored")
    evidence: int = param(20, at_least_one, "length of the (step, value) evidence window")


class StepTimeRegression(Scorer):
    """A sustained step-time regression, judged against the run's own noise: the median of the last
    ``short_window`` steps is above the baseline median (river ``stats.RollingQuantile`` over ``long_window``
    unflagged steps) by at least ``max_regression`` (5 %), by ``noise_factor`` times the run's noise (the 90th
    percentile of how far that recent median strayed from the baseline on healthy steps), and by
    ``min_seconds`` per step, for ``patience`` consecutive steps.

    Medians make it blind to single slow steps (checkpoint saves, evaluation); more than half of the recent
    window must be slow. The noise bar and the patience keep a shared machine's contention bursts (slower and
    noisier for a few seconds) from being reported; a slow GPU stays slow. 5 % is the cost of one slow GPU in
    BLOOM-176B's run, where it went unnoticed for days: on a quiet cluster the noise bar is below it.
    ``warning``, reported once per episode, with what it saw (the medians, the seconds per step, the noise).

    >>> d = StepTimeRegression("step_time", StepTimeConfig(short_window=4, grace_period=8, patience=3))
    >>> found = [d.update(s, {"step_time": 1.0 if s < 20 else 1.2}) for s in range(30)]
    >>> [(a.step, a.message) for a in found if a is not None]  # doctest: +NORMALIZE_WHITESPACE
    [(23, 'step time regressed by 20.0% for 3 steps: recent median 1.2 s vs baseline 1 s (+0.2 s per step;
      noise 0.0%, bar 5.0%)')]
    """

    name = "step_time"
    kind = "step_time"
    Config = StepTimeConfig
    config: StepTimeConfig
    _state_attrs = ("_baseline", "_recent", "_sorted", "_noise")

    def _reset(self) -> None:
        self._baseline = stats.RollingQuantile(q=0.5, window_size=self.config.long_window)
        self._recent: deque[float] = deque(maxlen=self.config.short_window - 1)
        self._sorted: list[float] = []  # the same values, kept sorted (bisect) so the median costs no sort
        # how far the recent median strays from the baseline on healthy steps (its 90th percentile)
        self._noise = stats.RollingQuantile(q=0.9, window_size=self.config.long_window)
        # (recent median, baseline, bar, excursion) of the point being scored, None when unscored; not state
        self._seen: tuple[float, float, float, float] | None = None

    def _value(self, x: X) -> float | None:
        v = x.get(self.metric)
        return float(v) if v is not None and math.isfinite(v) and v > 0 else None

    def _learn(self, v: float, x: X) -> None:
        self._baseline.update(v)
        seen, self._seen = self._seen, None
        if seen is not None:  # a healthy excursion of the recent median from the baseline: the run's noise
            self._noise.update(abs(seen[3]))
        window.push(self._recent, self._sorted, v)  # the recent window holds every value, flagged or not

    def _score(self, v: float, x: X) -> float:
        self._seen = None
        if len(self._recent) < self._recent.maxlen:  # type: ignore[operator]
            return 0.0
        base = self._baseline.get()
        if not base:
            return 0.0
        ordered = self._sorted  # the recent values, sorted; v joins them for the median
        i = bisect.bisect_left(ordered, v)
        ordered.insert(i, v)
        median = window.median(ordered)
        del ordered[i]
        excursion = median / base - 1.0
        bar = max(self.config.max_regression, self.config.noise_factor * (self._noise.get() or 0.0))
        self._seen = (median, base, bar, excursion)
        return excursion if excursion >= bar and median - base >= self.config.min_seconds else 0.0

    @property
    def threshold(self) -> float:
        return float(self.config.max_regression)

    def _flag(self, step: int, raw: float | None, score: float) -> Anomaly | None:
        """Reported once per episode, once it has lasted ``patience`` steps; every flagged value joins the
        recent window."""
        anomaly = super()._flag(step, raw, score)
        if raw is not None:
            window.push(self._recent, self._sorted, raw)
        return anomaly if self._streak == self.config.patience else None

    def _on_flag(self) -> None:
        self._seen = None

    def _message(self, v: float | None, score: float) -> str:
        median, base, bar, _ = self._seen or (math.nan, math.nan, math.nan, math.nan)
        noise = self._noise.get() or 0.0
        return (f"step time regressed by {score:.1%} for {self._streak} steps: recent median {median:.4g} s vs "
                f"baseline {base:.4g} s ({median - base:+.3g} s per step; noise {noise:.1%}, bar {bar:.1%})")

    @classmethod
    def example(cls) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
        stream = [{Metric.STEP_TIME: 1.0 + 0.001 * (i % 3)} for i in range(120)]
        return Metric.STEP_TIME, stream, [{Metric.STEP_TIME: 2.0}] * 40  # flagged past half the window, for patience


TREND_DETECTORS: tuple[type[Detector], ...] = (Drift, FrozenEmbedding, StepTimeRegression)
