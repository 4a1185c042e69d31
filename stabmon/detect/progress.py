"""Progress detectors: the loss got persistently worse than it had been, or never improved at all.

Spike detectors compare each point with a learned baseline, so a run that was wrecked before its baseline
formed (a learning rate far too high from the start) or that degrades slowly enough to drag the baseline along
(a schedule that keeps raising the LR) never looks anomalous to them. These two compare the loss with the run's
own history instead, and need no grace period: both are about the loss, both are ``error`` severity, both
speak only after the condition has held for many steps.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from stabmon.detect import window
from stabmon.detect.base import Detector, X
from stabmon.detect.config import (
    DetectorConfig,
    above_one,
    at_least_one,
    at_least_two,
    non_empty,
    non_negative,
    open_unit,
    param,
    positive,
)
from stabmon.detect.rule import Rule
from stabmon.events import Anomaly, Metric, Severity

_STALL_MIN_VALUES = 3
"""Values each window of the stall judgement needs (a log every 5+ steps is too sparse to call a stall)."""


@dataclass(frozen=True)
class RegressionConfig(DetectorConfig):
    """Parameters of :class:`LossRegression` (config key ``regression``).

    >>> c = RegressionConfig(); c.rise, c.z, c.records, c.patience, c.patience_records
    (0.1, 8.0, 12, 20, 6)
    """

    metrics: tuple[str, ...] = param((Metric.LOSS,), non_empty, "loss-like metrics (lower is better)")
    window: int = param(20, at_least_one, "training steps in the rolling median compared with the best one")
    records: int = param(12, at_least_two, "fewest records in the rolling median, whatever the logging interval "
                         "(the window is the longer of window steps and this many records), and fewest noise "
                         "samples before any judgement")
    rise: float = param(0.1, open_unit, "smallest relative rise of the rolling median over its best that counts")
    z: float = param(8.0, positive, "the rise must also exceed z standard errors of the rolling median, measured "
                     "from the run's own record-to-record noise")
    patience: int = param(20, at_least_one, "training steps above the threshold before reporting")
    patience_records: int = param(6, at_least_one, "records above the threshold before reporting (patience is the "
                                  "longer of the two)")
    lr_metric: str = param(Metric.LR, non_empty, "learning rate whose restart (a rise after it decayed below half "
                           "its peak) starts a new baseline")
    evidence: int = param(48, at_least_one, "length of the (step, value) evidence window")


BESTS = 128
"""The most (step, best) entries :class:`LossRegression` keeps to know the best a rollback goes back to."""


class LossRegression(Rule):
    """The loss's rolling median stays above the best rolling median the run has reached, by more than ``rise``
    (10%) *and* by more than ``z`` (8) standard errors of that median measured from the run's own noise, for
    ``patience``: the run has got worse and is not coming back by itself. ``error``, reported once per
    excursion (again once the loss has come back, or after a rollback). Silent for a loss that has been zero or
    negative (an RL objective, not a likelihood).

    **Sampling.** The rolling median covers the longer of ``window`` training steps and ``records`` records
    at the stream's own logging interval (:class:`~stabmon.detect.window.Cadence`), and the patience the longer
    of ``patience`` steps and ``patience_records`` records: a loss logged every 10 steps is judged on 12-record
    medians over 120 steps, not on 2-record ones. Nothing is judged before the window holds ``records`` values
    and the noise has been measured on as many.

    **Noise.** A fine-tune logged per step with short, varied sequences moves +-30% from one record to the next;
    a pre-training loss averaged over millions of tokens, +-1%. The run's record-to-record noise
    (:class:`~stabmon.detect.window.Noise`: median absolute log-difference, at least half a rounding step)
    gives the standard error of an ``n``-record median, ``1.2533 sigma / sqrt(n)``; the threshold is the larger
    of ``rise`` and ``z`` of those (the best median, a minimum over the run, sits a few standard errors below
    the typical one, hence 8). On the 40 healthy Hugging Face fine-tunes of ``real-finetunes`` the largest
    excursion of a 12-record median over its best is 0-10 standard errors with no patience; the labelled
    divergences reach 17 and 42 (docs/detectors.md).

    **Rollbacks.** The step counter going back starts a new timeline, judged against the best the run had
    reached before the step it went back to: a restart from step 0 (a run that did not learn) is not a regression
    against the best of the steps it undid, while one from a checkpoint before an incident still has to come back
    to the level it had there.

    **Restarts.** A learning rate that rises again after decaying below half its peak (a cyclic or restarted
    schedule) starts a new baseline: the loss is expected to rise with it. An evaluation entry is its own metric
    (``val_loss``) and never enters this window.

    The evidence reaches back before the rise, so its first step is a usable onset for a rollback.

    >>> d = LossRegression("loss", RegressionConfig(window=5, records=5, patience=5, patience_records=2))
    >>> losses = [3.0 - 0.01 * s + 0.01 * (s % 2) for s in range(100)] + [2.6] * 30
    >>> found = [d.update(s, {"loss": v}) for s, v in enumerate(losses)]
    >>> first = next(a for a in found if a); first.step, first.severity.value
    (104, 'error')
    >>> d = LossRegression("loss")  # logged every 10 steps: a 1.5x jump at step 500 that stays
    >>> found = [d.update(s, {"loss": 2 + 3 * 0.99 ** s + 0.01 * (s % 20) if s < 500 else 3.0})
    ...          for s in range(0, 900, 10)]
    >>> [a.step for a in found if a]   # the median of 12 records is up once 6 are: 6 records above, 60 steps
    [560]
    """

    name = "regression"
    kind = "regression"
    Config = RegressionConfig
    config: RegressionConfig
    _state_attrs = ("_recent", "_steps", "_best", "_bests", "_since", "_above_since", "_above_n", "_reported",
                    "_last_step", "_positive", "_cadence", "_noise", "_lr_peak", "_lr_last", "_ready")

    def _reset(self) -> None:
        self._recent: deque[float] = deque()
        self._steps: deque[int] = deque()  # the training step of each value in _recent
        self._sorted: list[float] = []  # the same values, sorted (derived, not saved)
        self._best = float("inf")
        self._bests: list[list[float]] = []  # [step, best] each time the best fell, oldest first (at most BESTS)
        self._since: int | None = None  # first step of this timeline (the window is full ``window`` steps on)
        self._above_since: int | None = None
        self._above_n = 0  # records above the threshold in the current excursion
        self._reported = False
        self._last_step = -1
        self._positive = True  # a loss that has been <= 0 is no likelihood: a relative rise means nothing
        self._cadence = window.Cadence()
        self._noise = window.Noise()
        self._lr_peak = 0.0
        self._lr_last = math.inf  # the last learning rate seen (inf: none yet)
        self._lr_metric = self.config.lr_metric
        self._ready = False  # the window holds its records and the noise its samples (until a new timeline)
        self._rise = 1 + self.config.rise  # the smallest multiple of the best median that can be a regression
        self._threshold_now = self._rise  # the multiple of the best median that is a regression (last report)
        self._sigma_now = 0.0

    def _new_timeline(self) -> None:
        self._recent.clear()
        self._steps.clear()
        self._sorted.clear()
        self._since, self._above_since, self._above_n, self._reported = None, None, 0, False
        self._noise.restart()
        self._ready = False

    def update(self, step: int, x: X) -> Anomaly | None:
        if step <= self._last_step:  # the step counter went back (a rollback): a new timeline, judged against the
            self._new_timeline()  # best reached before the step it went back to (the later steps were undone)
            self._rewind_best(step)
        self._last_step = step
        lr = x.get(self._lr_metric)
        if lr is not None and 0.0 < lr < math.inf:  # a restart: the LR rises again after decaying below half its peak
            last, self._lr_last = self._lr_last, lr
            if lr > 1.5 * last and last < 0.5 * self._lr_peak:
                self._lr_peak = lr
                self._new_timeline()  # a new schedule cycle: a new baseline too
                self._best, self._bests = float("inf"), []
            elif lr > self._lr_peak:
                self._lr_peak = lr
        raw = x.get(self.metric)
        if raw is None:
            return None
        if self._fills_evidence:
            self._evidence.append((step, raw))
        if not self._positive or not math.isfinite(raw):  # no usable value (see _value), or no likelihood
            return None
        v = float(raw)
        if v <= 0:
            self._positive = False
            return None
        cadence = self._cadence
        if cadence.steady and step - cadence.last == cadence.interval:
            cadence.last = step  # Cadence.see's steady case, inline (every record)
        else:
            cadence.see(step)
        self._noise.values.append(v)  # Noise.see, inline (every record)
        ordered = self._push(step, v)
        self.n_learned += 1
        if self._since is None:
            self._since = step
        c = self.config
        n = len(ordered)
        if not self._ready:
            if n < c.records or self._noise.count < c.records or step - self._since < c.window - 1:
                return None
            self._ready = True
        median = window.median(ordered)
        best = self._best
        if median <= best * self._rise:  # under the floor: no regression whatever the noise (the common case)
            if median < best:
                self._fell(step, median)
            if median < best or self._above_since is not None or self._reported:
                self._best, self._above_since, self._above_n, self._reported = min(best, median), None, 0, False
            return None
        sigma = self._noise.sigma(median)
        needed = max(math.log1p(c.rise), c.z * 1.2533 * sigma / math.sqrt(n))
        if math.log(median / best) <= needed:
            if median < best or self._above_since is not None or self._reported:
                self._best, self._above_since, self._above_n, self._reported = min(best, median), None, 0, False
            return None
        if self._above_since is None:  # the excursion began with the run of raw values above the threshold
            self._above_since, self._above_n = self._excursion_start(best * math.exp(needed), step)
        else:
            self._above_n += 1
        patience = self._cadence.span(steps=c.patience, records=c.patience_records)
        if self._reported or self._above_n < c.patience_records or step - self._above_since + 1 < patience:
            return None  # reported once per excursion, when it has lasted long enough
        if math.log(v / best) <= needed:
            return None  # the latest loss is back under the threshold: the median lags a recovery
        self._reported = True
        self._threshold_now, self._sigma_now = math.exp(needed), sigma
        anomaly = self._report(step, raw, median / best)
        return dataclasses.replace(anomaly, threshold=self._threshold_now)

    def _fell(self, step: int, best: float) -> None:
        """Remember that the best fell to ``best`` at ``step`` (for :meth:`_rewind_best`); past :data:`BESTS`
        entries, every other one of the older half is dropped (a rollback that far back is judged against a best
        a little higher than the one it had: a regression there is reported a little later, never sooner)."""
        bests = self._bests
        if bests and bests[-1][0] == step:
            bests[-1][1] = best
        else:
            bests.append([step, best])
        if len(bests) > BESTS:
            half = len(bests) // 2
            self._bests = bests[:half:2] + bests[half:]

    def _rewind_best(self, step: int) -> None:
        """A rollback to ``step``: the best is the one reached before it (none: the window learns a new one)."""
        self._bests = [e for e in self._bests if e[0] < step]
        self._best = self._bests[-1][1] if self._bests else float("inf")

    def _excursion_start(self, level: float, step: int) -> tuple[int, int]:
        """The first step, and the number of records, of the unbroken run of recent values above ``level`` that
        ends with this record (the median crosses only once half its window is up: the excursion began before)."""
        start, n = step, 0
        for s, value in zip(reversed(self._steps), reversed(self._recent), strict=True):
            if value <= level:
                break
            start, n = s, n + 1
        return start, max(n, 1)

    def _push(self, step: int, v: float) -> list[float]:
        """Add a value; drop those older than the window (in steps and records). Return its values, sorted."""
        c = self.config
        oldest = step - max(c.window, c.records * self._cadence.interval)  # Cadence.span, inline (every record)
        recent, steps, ordered = self._recent, self._steps, self._sorted
        while steps and steps[0] <= oldest:
            steps.popleft()
            del ordered[bisect.bisect_left(ordered, recent.popleft())]
        recent.append(v)
        steps.append(step)
        bisect.insort(ordered, v)
        return ordered

    def _learn(self, v: float, x: X) -> None:  # river-shaped API: one observation, one step
        self._push(self._last_step + 1, v)
        self._last_step += 1

    def load_state_dict(self, state: Any) -> None:
        super().load_state_dict(state)
        self._sorted = sorted(self._recent)

    def _score(self, v: float, x: X) -> float:
        if len(self._recent) < self.config.records or self._best == float("inf"):
            return 0.0
        return statistics.median([*self._recent, v][1:]) / self._best

    @property
    def threshold(self) -> float:
        return 1.0 + self.config.rise

    def _message(self, v: float | None, score: float) -> str:
        above = self._last_step - (self._above_since if self._above_since is not None else self._last_step) + 1
        return (f"{self.metric} has stayed {score - 1:.0%} above its best (median {self._best:.4g}) for "
                f"{above} steps ({self._above_n} records); the threshold is {self._threshold_now - 1:.0%} "
                f"(the run's record-to-record noise is {self._sigma_now:.1%})")

    @classmethod
    def example(cls) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
        stream = [{Metric.LOSS: 3.0 - 0.005 * i + 0.01 * (i % 3)} for i in range(120)]
        return Metric.LOSS, stream, [{Metric.LOSS: 4.0}] * 60


@dataclass(frozen=True)
class NoProgressConfig(DetectorConfig):
    """Parameters of :class:`NoProgress` (config key ``no_progress``).

    >>> NoProgressConfig().by_step, NoProgressConfig().min_drop, NoProgressConfig().ceiling
    (100, 0.1, 0.2)
    """

    metrics: tuple[str, ...] = param((Metric.LOSS,), non_empty, "loss-like metrics (lower is better)")
    window: int = param(10, at_least_one, "training steps in the medians compared (the first ones, the last ones)")
    by_step: int = param(100, at_least_one, "training step by which the loss must have fallen")
    min_drop: float = param(0.1, open_unit, "relative fall of the loss from its first steps that counts as progress")
    ceiling: float = param(0.2, positive, "relative rise of a loss over the run's first loss that is an error "
                           "before by_step: the model is worse than untrained")
    min_first: float = param(1.0, positive, "smallest first loss the ceiling judges against (an untrained "
                             "model's cross-entropy is ln(vocabulary size); smaller: no untrained model)")
    grad_metric: str = param(Metric.GRAD_NORM, non_empty, "gradient norm whose collapse, with a loss that has "
                             "stopped falling, means the run is stuck before by_step")
    grad_fall: float = param(7.0, above_one, "fall of the gradient norm (the median of its first window over the "
                             "median of the last window) that counts as collapsed")
    stall: float = param(0.01, open_unit, "relative fall of the loss's rolling median over its previous "
                         "window below which the loss has stopped falling")
    records: int = param(5, at_least_one, "fewest records in each window (a window is the longer of window steps "
                         "and this many records at the stream's logging interval)")
    by_records: int = param(20, at_least_one, "fewest records by the judgement (by_step is the longer of by_step "
                            "steps and this many records)")
    early_step: int = param(50, non_negative, "training step from which a run whose weights thrash (thrash) and "
                            "whose loss has not fallen min_drop is judged already, before by_step (0: never; "
                            "the longer of this and by_records / 2 records)")
    max_fall: float = param(0.4, open_unit, "a loss that has fallen this much below its first value has learned: "
                            "a stall after it is a plateau, not a run wrecked from its first steps")
    update_metric: str = param(Metric.UPDATE_RATIO, non_empty, "relative update size per step (||dtheta|| / "
                               "||theta||) that corroborates 'worse than untrained' and 'not learning'")
    untrained_loss: float = param(0.0, non_negative, "the loss of an untrained model, ln(number of classes); 0: "
                                  "read from the stream's untrained_loss metric (the live monitor records it once "
                                  "from the model's vocabulary), unknown in an imported log without it")
    untrained_fraction: float = param(0.75, open_unit, "a first loss at least this fraction of the untrained loss "
                                      "is a run from scratch (a pre-trained model starts a fine-tune far below)")
    thrash: float = param(0.02, positive, "median relative update per step, over the last window, at or above "
                          "which the weights are thrashing: a loss worse than at the start or not falling, while "
                          "2% of the weights' norm changes every step, is damage (the healthy scenarios: "
                          "0.003-0.005; 100x the stable LR: 0.03-0.06)")


class NoProgress(Rule):
    """A run that starts from scratch and is not learning, reported in three ways. Each is an ``error`` only
    when a second signal shows damage; otherwise it is ``info`` (in the trace, sent to nobody, acted on by no
    runbook), because the loss alone cannot tell a wrecked run from a fine-tune of a trained model that falls
    slowly or stays flat:

    - **worse than untrained**: before ``by_step``, a loss more than ``ceiling`` (20%) above the first loss - the
      loss of the untrained model (for a language model about the log of the vocabulary size, the entropy of
      a uniform guess). A learning rate far too high with no warm-up takes a model there within its first
      steps, inside every spike detector's grace period: the tiny GPT at LR 1e-1 peaks at 1.37-2.06x its first
      loss in steps 1-4 on each of 14 seeds (1-6, 22-29), then settles on a plateau near the loss of predicting
      character frequencies and ends 20-40% worse. A fine-tune logged per step with small batches goes there by
      noise alone: 4 of the 40 healthy ``real-finetunes`` runs pass 1.2x their first loss in their first 30
      steps (per-step SFT losses move +-30%).
    - **not learning**: by ``by_step``, the rolling median of the loss is still within ``min_drop`` (10%) of
      where it started: the smaller of the first loss and the median of the first ``window`` losses. A healthy
      pre-training run falls by far more; a low-LR fine-tune of a trained model may not fall at all.
    - For those two, what shows damage is where the run started, or how hard its weights move:

      - **a run from scratch**: its first loss is at least ``untrained_fraction`` (0.75) of an untrained model's
        loss ``ln V`` (``untrained_loss``; the live monitor records it once from the model's vocabulary, see
        :mod:`stabmon.collect.signals.vocab`). A random model starts at about ``ln V`` (the tiny GPT 2.7 against 2.56);
        a pre-trained one starts a fine-tune far below (the tiny GPT pre-trained for 300 steps: 1.6, 0.63 of
        it; a 7B model's SFT: 1-2 against 10.4). A run from scratch that is worse than untrained, or has not
        fallen 10% by step 100, is wrecked; a fine-tune that does the same is slow or flat;
      - **thrashing updates**: the median relative update ``||dtheta|| / ||theta||`` (``update_ratio``, sampled
        by the live monitor when ``config.updates.every`` is set) over the last window at or above ``thrash``
        (2% of the weights' norm per step). The tiny GPT's healthy runs move 0.3-0.5% per step; at 100x the
        stable LR (``lr-too-high``) 3-6% while the loss sits at the frequency baseline; a LoRA or low-LR
        fine-tune far less than 1%.

      An imported log has neither (unless it carries ``untrained_loss``, or ``--set
      no_progress.untrained_loss=...``): these two are ``info`` there.
    - **stalled** (its own corroboration): before ``by_step``, the loss has stopped falling (its median over the
      last window is less than ``stall``, 1%, below the median of the window before) *and* the gradient norm has
      collapsed (the median of its first values is ``grad_fall``, 7x, or more the median of the last window)
      *and* the loss has not fallen ``max_fall`` (40%) below its first value. A model wrecked in its first
      steps still learns the token frequencies (28% below the untrained loss) and sits there with a dead
      gradient: a Hugging Face ``Trainer`` on a tiny GPT-2 at LR 1e-1 (no warm-up, clip 1.0) is reported at step
      29-44 on each of 20 runs. Its healthy twins (LR 3e-4 to 3e-3) keep a stalled gradient within 3.8x of the
      first one. A QLoRA fine-tune whose loss fell 80% in 70 steps while its gradient norm fell 10x
      (``real-finetunes``, TANGHULU6) learned: ``max_fall`` keeps it quiet.

    **Sampling.** Windows are the longer of ``window`` steps and ``records`` records, and ``by_step`` the longer of
    ``by_step`` steps and ``by_records`` records, at the stream's own logging interval
    (:class:`~stabmon.detect.window.Cadence`): a Trainer log written every 10 steps is judged at step 200 on
    5-record windows, not at step 100 on one record. A stall needs 3 values in each window.

    It judges only a stream that begins at the start of training (its first step below ``window``), and reports
    each time ``by_step`` is passed without progress (again after a rollback to before it). The evidence starts
    at the run's first step, which is where a rollback must go. Only for a likelihood: the first loss must be at
    least ``min_first`` (1 nat) for the ceiling, and the loss must never have been zero or negative.

    >>> d = NoProgress("loss")   # flat from the start, small updates (a low-LR fine-tune): info only
    >>> found = [d.update(s, {"loss": 2.6 - 0.001 * s, "update_ratio": 0.001}) for s in range(120)]
    >>> [(a.step, a.severity.value) for a in found if a]
    [(100, 'info')]
    >>> d = NoProgress("loss")   # blown up at step 2, then a plateau, the weights thrashing: errors (judged at 50)
    >>> found = [d.update(s, {"loss": [2.7, 2.9, 4.3, 3.3, 3.0][s] if s < 5 else 2.35, "update_ratio": 0.05})
    ...          for s in range(120)]
    >>> [(a.step, a.severity.value) for a in found if a]
    [(2, 'error'), (50, 'error')]
    >>> d = NoProgress("loss")   # a run from scratch (ln 13 = 2.56 untrained) that does not learn: an error
    >>> found = [d.update(s, {"loss": 2.6 - 0.001 * s, **({"untrained_loss": 2.565} if s == 0 else {})})
    ...          for s in range(120)]
    >>> [(a.step, a.severity.value) for a in found if a]
    [(100, 'error')]
    >>> d = NoProgress("loss")   # learned (2.7 -> 1.8), then an LR jump at step 60: a spike, not no-progress
    >>> [d.update(s, {"loss": 40.0 if s == 60 else max(1.8, 2.7 - 0.03 * s)}) for s in range(80)].count(None)
    80
    >>> d = NoProgress("loss")   # down 30% to a plateau by step 15, the gradient dead: stalled
    >>> found = [d.update(s, {"loss": max(3.8 - 0.1 * s, 2.7), "grad_norm": 3.0 if s < 15 else 0.1})
    ...          for s in range(120)]
    >>> [(a.step, round(a.score), a.threshold, a.severity.value) for a in found if a]   # fell 30x (7x counts)
    [(26, 30, 7.0, 'error')]
    """

    name = "no_progress"
    kind = "no_progress"
    Config = NoProgressConfig
    config: NoProgressConfig
    grace_exempt = "it judges the warm-up itself"
    shares_evidence = False  # its evidence holds the finite losses it judged, not every raw value
    _state_attrs = ("_first", "_recent", "_judged", "_judged_early", "_start", "_over", "_likelihood", "_last_step",
                    "_learned", "_first_grads", "_history", "_stall_reported", "_cadence", "_updates", "_untrained")

    def _reset(self) -> None:
        self._first: list[tuple[int, float]] = []
        # (step, loss) of the last ``window`` training steps (a sparse log has fewer values in them)
        self._recent: deque[tuple[int, float]] = deque(maxlen=self.config.window)
        self._judged = False
        self._judged_early = 0  # the step of a judgement made before by_step, thrashing (0: none)
        self._start: int | None = None
        self._over = False  # above the ceiling, reported
        self._likelihood = True  # False once the loss has been <= 0 (no likelihood: the ceiling is off)
        self._learned = False  # the run has made progress: its rolling median fell min_drop below the first loss
        self._last_step = -1
        self._verdict = ""  # which judgement the anomaly being reported is (for its message)
        self._first_grads: list[float] = []  # the gradient norms of the first ``window`` training steps
        # (step, loss, gradient norm or None) of the last 2 x ``window`` training steps: the stall judgement
        self._history: deque[tuple[int, float, float | None]] = deque()
        self._stall_reported = False
        self._stall_fall = 0.0  # the loss's fall over the last window when the stall was reported (its message)
        self._cadence = window.Cadence()
        self._updates: deque[tuple[int, float]] = deque()  # (step, relative update) of the last window
        self._corroborated = False  # whether the anomaly being reported is corroborated (its severity)
        self._untrained = 0.0  # the untrained loss the stream recorded (see NoProgressConfig.untrained_loss)

    def update(self, step: int, x: X) -> Anomaly | None:
        v = x.get(self.metric)  # self._value(x), inline (this runs on every record)
        self._see_update(step, x)
        untrained = x.get(Metric.UNTRAINED_LOSS)
        if untrained is not None and math.isfinite(untrained) and untrained > 0 and not self.config.untrained_loss:
            self._untrained = float(untrained)
        if v is None or not math.isfinite(v):
            return None
        v = float(v)
        if self._start is None:
            self._start = step
        if self._start >= self.config.window:
            return None  # a stream cut from the middle of a run: its start is not ours to judge
        if self._judged and step > self._last_step:  # judged, no rollback since: nothing left to watch
            self._last_step = step
            return None
        if step <= self._last_step:  # a rollback: a new timeline
            self._over, self._stall_reported = False, False
            self._history.clear()
            self._learned = self._learned and step >= self.config.window  # back to the start: prove it again
            if step < self._judged_early:  # back before the early judgement: judge again
                self._judged_early = 0
        self._last_step = step
        self._cadence.see(step)
        config = self.config
        w = self._cadence.span(steps=config.window, records=config.records)
        by_step = self._cadence.span(steps=config.by_step, records=config.by_records)
        early = step < self._start + w  # the first window: its losses and gradient norms are the reference
        grad = self._grad(x) if early or step < by_step else None  # past both: not needed
        if early and len(self._first) < max(config.window, config.records):
            self._first.append((step, v))
            if grad is not None:
                self._first_grads.append(grad)
        recent = self._recent
        while recent and recent[0][0] <= step - w:
            recent.popleft()
        recent.append((step, v))
        self._evidence.append((step, v))
        self.n_learned += 1
        if step < by_step:
            ceiling = None if self._learned else self._above_ceiling(step, v)
            score = self._score(v, x)
            self._learned = self._learned or score < self.threshold
            stalled = self._stalled(step, v, grad, w)
            self._judged = False  # back before by_step (a rollback): judge again when it is passed
            return ceiling or stalled or self._early(step, v, score)
        if self._judged:
            return None
        self._judged = True
        if self._judged_early:  # reported already, thrashing, before by_step
            return None
        score = self._score(v, x)
        if score < self.threshold:
            return None
        return self._report_verdict(step, v, score, "not_learning")

    def _early(self, step: int, v: float, score: float) -> Anomaly | None:
        """Not learning by ``early_step`` while the weights thrash: the same judgement as at ``by_step``, made as
        soon as its strongest corroboration is there (``score``: this record's, as at ``by_step``)."""
        early = self._cadence.span(steps=self.config.early_step, records=(self.config.by_records + 1) // 2)
        start = 0 if self._start is None else self._start
        if (not self.config.early_step or self._judged_early or self._learned or step < start + early
                or self._thrashing() is None):
            return None
        self._judged_early = step
        return self._report_verdict(step, v, score, "thrashing", corroborated=True)

    def _see_update(self, step: int, x: X) -> None:
        """Keep the relative update sizes of the last window (sampled: a live monitor measures them every few
        steps; an imported log has none)."""
        u = x.get(self.config.update_metric)
        if u is None or not math.isfinite(u):
            return
        updates = self._updates
        if updates and updates[-1][0] >= step:  # a rollback: a new timeline
            updates.clear()
        updates.append((step, float(u)))
        span = self._cadence.span(steps=self.config.window, records=self.config.records)
        while len(updates) > 3 and updates[0][0] <= step - span:
            updates.popleft()

    def _from_scratch(self) -> bool:
        """Did the run start from an untrained model: its first loss at least ``untrained_fraction`` of the
        untrained loss (ln of the number of classes), when that is known?"""
        untrained = self.config.untrained_loss or self._untrained
        return bool(untrained and self._first and self._first[0][1] >= self.config.untrained_fraction * untrained)

    def _thrashing(self) -> float | None:
        """The median relative update of the last window when it reaches ``thrash`` (the weights move fast), else
        None (they do not, or nothing measured them)."""
        if not self._updates:
            return None
        median = statistics.median(u for _, u in self._updates)
        return median if median >= self.config.thrash else None

    def _above_ceiling(self, step: int, v: float) -> Anomaly | None:
        first = self._first[0][1]
        if v <= 0:
            self._likelihood = False
        if first < self.config.min_first or not self._likelihood:
            return None
        ratio = v / first
        if ratio <= 1.0 + self.config.ceiling:
            self._over = False
            return None
        if self._over:
            return None
        self._over = True
        return self._report_verdict(step, v, ratio, "above_ceiling")

    def _grad(self, x: X) -> float | None:
        g = x.get(self.config.grad_metric)
        return float(g) if g is not None and math.isfinite(g) and g > 0 else None

    def _stalled(self, step: int, v: float, grad: float | None, w: int) -> Anomaly | None:
        """The loss has stopped falling and the gradient has collapsed, long before ``by_step``, without having
        learned much (a run that fell ``max_fall`` below its first loss is on a plateau, not stuck)."""
        history = self._history
        while history and history[0][0] <= step - 2 * w:
            history.popleft()
        history.append((step, v, grad))
        if self._stall_reported or not self._likelihood or not self._first_grads:
            return None
        last = [(loss, g) for s, loss, g in history if s > step - w]
        before = [loss for s, loss, _ in history if s <= step - w]
        grads = [g for _, g in last if g is not None]
        if min(len(before), len(last), len(grads)) < _STALL_MIN_VALUES:
            return None  # too few values in one of the windows to call a stall
        level = statistics.median(loss for loss, _ in last)
        if level < (1.0 - self.config.max_fall) * self._first[0][1]:
            return None  # it learned: a plateau far below where it started
        fall = 1.0 - level / statistics.median(before)
        collapse = statistics.median(self._first_grads) / statistics.median(grads)
        if fall >= self.config.stall or collapse < self.config.grad_fall:
            return None
        self._stall_reported = True
        self._stall_fall = fall
        return self._report_verdict(step, v, collapse, "stalled", threshold=self.config.grad_fall, corroborated=True)

    def _report_verdict(self, step: int, v: float, score: float, verdict: str, threshold: float | None = None,
                corroborated: bool | None = None) -> Anomaly:
        """``corroborated``: whether a second signal shows damage (an error); None: judge the update size."""
        self._verdict = verdict
        if corroborated is None:
            corroborated = self._from_scratch() or self._thrashing() is not None
        self._corroborated = corroborated
        anomaly = self._report(step, v, score)
        return dataclasses.replace(anomaly, evidence=(self._first[0], *anomaly.evidence),
                                   threshold=anomaly.threshold if threshold is None else threshold)

    def _learn(self, v: float, x: X) -> None:
        self._recent.append((self.n_learned, v))

    def _score(self, v: float, x: X) -> float:
        if not self._first:
            return 0.0
        start = min(self._first[0][1], statistics.median(value for _, value in self._first))
        return statistics.median(value for _, value in self._recent) / start if start > 0 else 0.0

    @property
    def threshold(self) -> float:
        return 1.0 - self.config.min_drop

    def _severity(self, score: float) -> Severity:
        return Severity.ERROR if self._corroborated else Severity.INFO

    def _message(self, v: float | None, score: float) -> str:
        return self._verdict_message(score) + self._corroboration_message()

    def _corroboration_message(self) -> str:
        if self._verdict in ("stalled", "thrashing"):
            return ""
        if self._from_scratch():
            untrained = self.config.untrained_loss or self._untrained
            return (f"; the run started untrained (first loss {self._first[0][1]:.4g}, an untrained model's "
                    f"{untrained:.4g}): damage")
        thrash = self._thrashing()
        if thrash is not None:
            return f"; the weights move {thrash:.1%} of their norm per step (thrash {self.config.thrash:.0%}): damage"
        return (f"; not corroborated: not a run from scratch (or its untrained loss unknown) and the weights do not "
                f"move fast ({self.config.update_metric} below {self.config.thrash:.0%} or not measured), as in "
                f"a slow or flat fine-tune: info only")

    def _verdict_message(self, score: float) -> str:
        if self._verdict == "stalled":
            return (f"{self.metric} has stopped falling ({-self._stall_fall:+.1%} over {self.config.window} steps) "
                    f"and {self.config.grad_metric} has collapsed to 1/{score:.0f} of its first values "
                    f"(collapse 1/{self.config.grad_fall:.0f}): the run is stuck, likely wrecked in its first "
                    f"steps (a model that only predicts token frequencies)")
        if self._verdict == "above_ceiling":
            return (f"{self.metric} is {score - 1:.0%} above its first value {self._first[0][1]:.4g} (ceiling "
                    f"{self.config.ceiling:.0%}): the model is worse than untrained")
        if self._verdict == "thrashing":
            return (f"{self.metric} has fallen only {1 - score:.0%} from its first steps by step {self._judged_early} "
                    f"(needs {self.config.min_drop:.0%}) while the weights move {self._thrashing() or 0:.1%} of "
                    f"their norm per step (thrash {self.config.thrash:.0%}): the run is not learning, judged before "
                    f"step {self.config.by_step}: damage")
        return (f"{self.metric} has fallen only {1 - score:.0%} from its first steps by step "
                f"{self.config.by_step} (needs {self.config.min_drop:.0%}): the run is not learning")

    @classmethod
    def example(cls) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
        return Metric.LOSS, [{Metric.LOSS: 2.6 + 0.01 * (i % 3)} for i in range(90)], [{Metric.LOSS: 2.6}] * 20


PROGRESS_DETECTORS: tuple[type[Detector], ...] = (LossRegression, NoProgress)
