"""Rule detectors: non-finite values, a metric that stops arriving, fp16 loss-scale collapse, a value past a bar.

These need no learned baseline to speak of; each is a :class:`~stabmon.detect.scorer.Scorer` whose score is the
rule's verdict (1: it holds), so the one guard gives them the grace period (or their exemption from it), the
protect filter, the streak and the evidence, as every other scorer.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

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
from stabmon.detect.scorer import Scorer
from stabmon.events import Anomaly, Metric, Severity


@dataclass(frozen=True)
class NonFiniteConfig(DetectorConfig):
    """Parameters of :class:`NonFinite` (config key ``nonfinite``).

    >>> NonFiniteConfig().metrics
    ('loss', 'grad_norm')
    """

    metrics: tuple[str, ...] = param((Metric.LOSS, Metric.GRAD_NORM), non_empty, "must stay finite")
    persist: int = param(3, at_least_one, "non-finite values among the metric's last `of` records that make it "
                         "critical (it persists)")
    of: int = param(20, at_least_one, "records of the metric over which persistence is counted")
    evidence: int = param(20, at_least_one, "length of the (step, value) evidence window (at least `of`)")

    def validate(self, path: str) -> None:
        if self.evidence < self.of:
            raise ValueError(f"{path}.evidence must be >= {path}.of ({self.of}), got {self.evidence}")


class NonFinite(Scorer):
    """NaN or Inf in the loss or the gradient norm, no grace period. ``critical`` when it persists: on
    ``persist`` (3) of the metric's last ``of`` (20) records, counted in records so that a log written every 10
    or 500 steps persists as a per-step one does. Before that a non-finite loss is a ``warning``, and so is a
    non-finite gradient norm that the stream's ``overflow`` marks or loss scale do not explain; one beside a
    finite loss in a stream without either is ``info``: an fp16 step that overflowed and was skipped (Hugging
    Face Trainer logs its ``grad_norm`` as NaN and goes on; two healthy ``real-finetunes`` runs have one each)
    is routine, a run whose every step is NaN is not.

    An fp16 step the loss scaler skipped (``overflow == 1``) has an infinite *gradient norm* by design; that
    is healthy dynamic loss scaling (judged by :class:`LossScaleCollapse`), not a non-finite training state. A
    non-finite *loss* is flagged whatever the scaler did.

    >>> d = NonFinite("loss")
    >>> d.update(1, {"loss": 2.0}) is None
    True
    >>> [d.update(s, {"loss": float("nan")}).severity.value for s in (2, 3, 4)]
    ['warning', 'warning', 'critical']
    >>> NonFinite("grad_norm").update(3, {"grad_norm": float("nan"), "loss": 2.0}).severity.value
    'info'
    >>> NonFinite("grad_norm").update(3, {"grad_norm": float("inf"), "overflow": 1.0}) is None
    True
    """

    name = "nonfinite"
    kind = "nonfinite"
    Config = NonFiniteConfig
    config: NonFiniteConfig
    grace_exempt = "a non-finite loss is critical whenever it happens"
    skips_finite = "a finite value scores 0 and there is nothing to learn"
    _state_attrs = ("_flagged",)

    def _value(self, x: X) -> float | None:
        v = x.get(self.metric)
        return None if v is None else float(v)

    def _learn(self, v: float, x: X) -> None:
        pass

    def _score(self, v: float, x: X) -> float:
        if math.isfinite(v):
            return 0.0
        if self.metric != Metric.LOSS and x.get(Metric.OVERFLOW, 0.0) == 1.0:
            return 0.0
        loss = x.get(Metric.LOSS)
        self._loss_finite = loss is not None and math.isfinite(loss)
        # the stream says which steps the loss scaler skipped (an overflow mark, or a loss scale whose backoffs do)
        self._overflow_known = Metric.OVERFLOW in x or Metric.LOSS_SCALE in x
        return 1.0

    def _grace_score(self, v: float, x: X) -> float:  # exempt from grace
        return self._score(v, x)

    @property
    def threshold(self) -> float:
        return 1.0

    def _reset(self) -> None:
        self._flagged: deque[int] = deque(maxlen=self.config.persist)  # steps of the last flagged values
        self._persisting = 0  # flagged values among the last ``of`` records, at the last flag
        self._loss_finite = False  # whether the record being flagged has a finite loss (its severity)
        self._overflow_known = False  # whether it says if the loss scaler skipped the step (its severity)

    def _flag(self, step: int, raw: float | None, score: float) -> Anomaly | None:
        """Count the flagged values among the metric's last ``of`` records, then report (its severity)."""
        window = self._evidence  # the metric's recent (step, value) pairs, this record included
        self._flagged.append(step)
        horizon = window[-self.config.of][0] if len(window) >= self.config.of else -math.inf
        self._persisting = sum(1 for s in self._flagged if s >= horizon)
        return super()._flag(step, raw, score)

    def _severity(self, score: float, streak: int) -> Severity:
        if self._persisting >= self.config.persist:
            return Severity.CRITICAL
        if self.metric != Metric.LOSS and self._loss_finite and not self._overflow_known:
            return Severity.INFO  # beside a finite loss, in a stream that does not mark skipped fp16 steps
        return Severity.WARNING

    def _message(self, v: float | None, score: float) -> str:
        return (f"{self.metric} is {v} ({self._persisting} of its last {self.config.of} records; "
                f"{self.config.persist} persist)")

    @classmethod
    def example(cls) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
        return Metric.LOSS, [{Metric.LOSS: 3.0 - 0.01 * i} for i in range(20)], [{Metric.LOSS: math.nan}]


@dataclass(frozen=True)
class MissingConfig(DetectorConfig):
    """Parameters of :class:`MissingMetric` (config key ``missing``).

    >>> MissingConfig().min_streak
    10
    """

    metrics: tuple[str, ...] = param((Metric.LOSS, Metric.GRAD_NORM), non_empty, "expected each step")
    min_streak: int = param(10, at_least_one, "records in a row a metric must have arrived on to be expected")


class MissingMetric(Scorer):
    """A metric that arrived on every one of the last ``min_streak`` records and is absent now (``warning``).

    Judged on records that carry another of the watched metrics (an evaluation-only record says nothing about
    the training loss). Reported once per outage: the count restarts when the metric comes back. Metrics a run
    never reports, or
    reports only now and then (validation loss, a loss scale printed only on overflow), never build a streak.
    Megatron prints no ``lm loss`` on the step that diverged (BigScience tr8-104B exp12 it9027). A step the
    fp16 loss scaler skipped (``overflow == 1``) says nothing about the other metrics: the update never ran,
    so its grad norm may never have been measured (a GradScaler skips the optimizer step and its hooks).

    >>> d = MissingMetric("loss", MissingConfig(min_streak=3))
    >>> [d.update(s, {"loss": 2.0}) for s in range(3)]
    [None, None, None]
    >>> d.update(3, {"grad_norm": 1.0}).kind
    'missing'
    >>> d.update(4, {"grad_norm": 1.0}) is None
    True
    """

    name = "missing"
    kind = "missing"
    Config = MissingConfig
    config: MissingConfig
    _state_attrs = ("_present",)

    def _reset(self) -> None:
        self._present = 0

    def _value(self, x: X) -> float | None:
        if self.metric in x:
            return 1.0
        if self.metric != Metric.LOSS and x.get(Metric.OVERFLOW) == 1.0:
            return None  # a skipped overflow step need not carry it
        # judged only on records that carry another watched metric: an evaluation-only record says nothing
        return 0.0 if any(m in x for m in self.config.metrics if m != self.metric) else None

    def _learn(self, v: float, x: X) -> None:
        self._present = self._present + 1 if v else 0

    def watches(self, names: AbstractSet[str]) -> bool:  # a record with another watched metric judges it
        return self.metric in names or any(m in names for m in self.config.metrics)

    def _observe(self, raw: float | None, x: X, scoring: bool) -> float | None:
        if raw is not None:  # the common case, it arrived: value 1, which scores 0 and is learned
            self._present += 1
            return 0.0
        return super()._observe(raw, x, scoring)

    def _score(self, v: float, x: X) -> float:
        return 1.0 if not v and self._present >= self.config.min_streak else 0.0

    def _on_flag(self) -> None:
        self._present = 0

    @property
    def threshold(self) -> float:
        return 1.0

    def _message(self, v: float | None, score: float) -> str:
        return f"{self.metric} stopped arriving after {self._present} consecutive records"

    @classmethod
    def example(cls) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
        return Metric.LOSS, [{Metric.LOSS: 2.0} for _ in range(20)], [{Metric.GRAD_NORM: 1.0}]


@dataclass(frozen=True)
class LossScaleConfig(DetectorConfig):
    """Parameters of :class:`LossScaleCollapse` (config key ``loss_scale``).

    >>> LossScaleConfig().max_overflow_rate, LossScaleConfig().window
    (0.25, 20)
    """

    metrics: tuple[str, ...] = param((Metric.LOSS_SCALE,), non_empty, "the loss-scale metric")
    min_scale: float = param(1.0, positive, "a scale at or below this has collapsed (DeepSpeed's floor)")
    window: int = param(20, at_least_two, "steps over which the overflow rate is measured")
    max_overflow_rate: float = param(0.25, open_unit, "overflow rate in the window that is a collapse")
    grace_period: int = param(50, non_negative, "steps before the rate rule applies (initial scale search)")


class LossScaleCollapse(Scorer):
    """fp16 dynamic loss scaling that has stopped working.

    Two rules. *Floor*: the scale is at or below ``min_scale`` - gradients no longer fit fp16 even unscaled
    (``critical``; applies during grace too). *Rate*: more than ``max_overflow_rate`` of the last ``window``
    steps overflowed (``error``). Healthy dynamic scaling grows the scale every few hundred clean steps and is
    knocked back by one (with hysteresis, two) overflows - about 1-2 % of steps, far below 25 %; the initial
    scale search (a burst of overflows in the first steps, 65536 -> 2048 in DeepSpeed-Chat's OPT SFT log) is
    covered by the 50-step grace period. A falling scale on its own is therefore never flagged.

    >>> d = LossScaleCollapse("loss_scale", LossScaleConfig(grace_period=0, window=10))
    >>> [d.update(s, {"overflow": 0.0}) for s in range(10)][-1] is None
    True
    >>> found = [d.update(s, {"overflow": 1.0, "loss_scale": 2.0 ** (20 - s)}) for s in range(10, 13)]
    >>> found[-1].kind, found[-1].severity.value
    ('loss_scale_collapse', 'error')
    >>> d.update(13, {"loss_scale": 1.0}).severity.value
    'critical'
    >>> d.update(14, {"loss_scale": 1.0}) is None   # still at the floor: reported once
    True
    """

    name = "loss_scale"
    kind = "loss_scale_collapse"
    Config = LossScaleConfig
    config: LossScaleConfig
    grace_exempt = "a scale at its floor is critical whenever it happens (the rate rule respects grace)"
    _state_attrs = ("_overflows", "_count", "_at_floor")

    def _reset(self) -> None:
        # the last `window` overflow flags (0/1) and their running count: a plain deque, cheaper per step than
        # river's generic `utils.Rolling(stats.Sum)` (which reverts through Python on every step)
        self._overflows: deque[int] = deque(maxlen=self.config.window)
        self._count = 0
        self._at_floor = False  # the scale was at its floor on the last record that carried it (reported)
        self._floor = False  # the point being scored is at the floor; not state

    def _value(self, x: X) -> float | None:
        if Metric.OVERFLOW in x or self.metric in x:
            return 1.0
        return None

    def watches(self, names: AbstractSet[str]) -> bool:  # overflow without a printed loss scale still counts
        return Metric.OVERFLOW in names or self.metric in names

    def _learn(self, v: float, x: X) -> None:
        window = self._overflows
        if len(window) == window.maxlen:
            self._count -= window[0]
        flag = 1 if x.get(Metric.OVERFLOW, 0.0) == 1.0 else 0
        window.append(flag)
        self._count += flag
        if self.metric in x:  # a learned point is not at the floor (that flags it), but the river API may teach one
            self._at_floor = self._floor_hit(x)

    def load_state_dict(self, state: Any) -> None:
        super().load_state_dict(state)
        self._count = sum(self._overflows)

    def _floor_hit(self, x: X) -> bool:
        scale = x.get(self.metric)
        return scale is not None and not math.isnan(scale) and scale <= self.config.min_scale

    def _rate(self, x: X) -> float:
        window = self._overflows
        total = self._count
        if len(window) >= self.config.window:
            total -= window[0]
        total += 1 if x.get(Metric.OVERFLOW, 0.0) == 1.0 else 0
        return total / self.config.window

    def _grace_score(self, v: float, x: X) -> float:  # the floor rule is exempt from grace
        self._floor = self._floor_hit(x)
        return 1.0 if self._floor else 0.0

    def _score(self, v: float, x: X) -> float:
        return max(self._grace_score(v, x), self._rate(x) / self.config.max_overflow_rate)

    @property
    def threshold(self) -> float:
        return 1.0

    def _flag(self, step: int, raw: float | None, score: float) -> Anomaly | None:
        """A scale stuck at the floor is reported once, and again after it has recovered."""
        anomaly = super()._flag(step, raw, score)
        if raw is None:  # an overflow mark without a scale: the rate rule
            return anomaly
        repeat, self._at_floor = self._at_floor and self._floor, self._floor
        return None if repeat else anomaly

    def _severity(self, score: float, streak: int) -> Severity:
        return Severity.CRITICAL if self._floor else Severity.ERROR

    def _message(self, v: float | None, score: float) -> str:
        if self._floor:
            return f"loss scale {v} is at its floor ({self.config.min_scale})"
        rate = score * self.config.max_overflow_rate
        return f"{rate:.0%} of the last {self.config.window} steps overflowed (loss scale {v})"

    @classmethod
    def example(cls) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
        stream = [{Metric.OVERFLOW: 0.0, Metric.LOSS_SCALE: 65536.0} for _ in range(60)]
        return Metric.LOSS_SCALE, stream, [{Metric.OVERFLOW: 1.0, Metric.LOSS_SCALE: 0.5}]


@dataclass(frozen=True)
class LevelConfig(DetectorConfig):
    """Parameters of :class:`Level` (config key ``level``).

    >>> LevelConfig().metrics, LevelConfig().bar, LevelConfig().persist
    (('attn_logit/*',), 100.0, 3)
    """

    metrics: tuple[str, ...] = param((Metric.ATTN_LOGIT_PREFIX + "*",), non_empty, "metrics held under the bar")
    bar: float = param(100.0, positive, "a value above this is out of range (Kimi K2's QK-clip tau for attention "
                       "logits)")
    persist: int = param(3, at_least_one, "records in a row above the bar that make it an error")


class Level(Scorer):
    """A value past an absolute bar: ``warning`` on the first record above ``bar``, ``error`` once ``persist``
    records in a row are above it. No learned baseline: the bar is the judgement, so it needs no grace period
    and a slow climb is caught as surely as a jump.

    Shipped on the per-layer and per-head max attention logits (``attn_logit/*``, recorded only where
    ``MonitorConfig.attention`` samples them) with the bar at 100, Kimi K2's QK-clip tau: a healthy model keeps
    its attention logits in the tens (the tiny GPT of the scenarios: under 10), while attention-logit growth
    (Wortsman et al. 2023) takes them into the hundreds tens of steps before the loss turns up
    (``benchmarks/lead_time.py --signals``). A non-finite value is left to :class:`NonFinite`.

    >>> d = Level("attn_logit/blocks.0.attn/1")
    >>> [d.update(s, {"attn_logit/blocks.0.attn/1": v}) for s, v in enumerate([5.0, 40.0, 90.0])]
    [None, None, None]
    >>> [d.update(s, {"attn_logit/blocks.0.attn/1": 150.0}).severity.value for s in (3, 4, 5)]
    ['warning', 'warning', 'error']
    """

    name = "level"
    kind = "level"
    Config = LevelConfig
    config: LevelConfig
    grace_exempt = "an absolute bar needs no baseline"

    def _learn(self, v: float, x: X) -> None:
        pass

    def _score(self, v: float, x: X) -> float:
        return v / self.config.bar if math.isfinite(v) else 0.0

    def _grace_score(self, v: float, x: X) -> float:
        return self._score(v, x)

    @property
    def threshold(self) -> float:
        return 1.0 + 1e-12  # strictly above the bar

    def _severity(self, score: float, streak: int) -> Severity:
        return Severity.ERROR if streak >= self.config.persist else Severity.WARNING

    def _message(self, v: float | None, score: float) -> str:
        return f"{self.metric} is {v:.4g}, above its bar {self.config.bar:g} ({self._streak} record(s) in a row)"

    def _recent_evidence(self) -> Iterable[tuple[int, float]]:
        """The records above the bar in a row and the one before them: the trouble began after that record (a
        runbook's onset, where a rollback restores to and a diagnosis looks from), not at the start of a window
        that spans ``evidence`` samples, hundreds of steps of a metric sampled every 10."""
        window = self._evidence
        keep = min(self.config.evidence, self._streak + 1)
        return itertools.islice(window, max(0, len(window) - keep), None)

    @classmethod
    def example(cls) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
        m = Metric.ATTN_LOGIT_PREFIX + "blocks.0.attn"
        return m, [{m: 5.0 + 0.01 * i} for i in range(30)], [{m: 500.0}]


@dataclass(frozen=True)
class OutOfLineConfig(DetectorConfig):
    """Parameters of :class:`OutOfLine` (config key ``out_of_line``).

    >>> OutOfLineConfig().metrics, OutOfLineConfig().factor, OutOfLineConfig().min_layers
    (('update_ratio/*',), 20.0, 3)
    """

    metrics: tuple[str, ...] = param((Metric.UPDATE_RATIO_PREFIX + "*",), non_empty,
                                     "per-layer metrics (one family, ``<family>/<layer>``) held in line with "
                                     "each other")
    factor: float = param(20.0, above_one, "a layer whose value is this many times the median of its family's "
                          "values on the same record is out of line (the scenarios' healthy runs: at most 2.4x; "
                          "100x the stable LR on every layer: at most 6x)")
    min_layers: int = param(3, at_least_two, "fewest layers of the family on a record for a median to judge by")


class OutOfLine(Scorer):
    """One layer far out of line with the others on the same record: ``warning`` when its value is ``factor``
    (20) times the median of its family (the values of every ``<family>/<layer>`` metric of the record), the
    layer itself included. Never an error: a layer that moves faster than the rest is a cause to look at, not
    damage; the loss detectors say when there is damage, and a runbook rung that acts on one layer
    (``scale_layer_lr``) takes the layer from this detector's latest report.

    Shipped on the per-layer update ratios ``update_ratio/<layer>`` (``||dtheta|| / ||theta||`` of one step,
    recorded where ``MonitorConfig.updates`` samples them): a param group whose learning rate is wrong for it (an
    output layer at 3000x the LR, Wortsman et al. 2023's output-logit divergence) moves its weights 60-1,700x
    faster than the median layer from its first step, while a healthy run's layers stay within 2.4x of each
    other and a learning rate 100x too high on every layer within 6x. Needs no baseline, so no grace period.

    A layer that starts from zero weights (LoRA's ``B``, a zero-initialised output head; its first step reads
    ``inf``, see :mod:`stabmon.collect.signals.updates`) moves at ratio ~1/k to 1/sqrt(k) on its k-th step whatever its
    learning rate: out of line by construction, and nothing to learn from. It is judged from the first record on
    which it is in line, and never before.

    >>> layers = {"update_ratio/h.0": 0.003, "update_ratio/h.1": 0.004, "update_ratio/ln_f": 0.005}
    >>> d = OutOfLine("update_ratio/lm_head")
    >>> d.update(0, {**layers, "update_ratio/lm_head": 0.006}) is None
    True
    >>> a = d.update(5, {**layers, "update_ratio/lm_head": 0.2})
    >>> a.severity.value, round(a.score, 2)
    ('warning', 2.22)
    """

    name = "out_of_line"
    kind = "out_of_line"
    Config = OutOfLineConfig
    config: OutOfLineConfig
    grace_exempt = "a comparison across layers on the same record needs no baseline"
    _state_attrs = ("_growing_in",)

    def __init__(self, metric: str, config: Any = None, **kwargs: Any) -> None:
        super().__init__(metric, config, **kwargs)
        self._family = metric.rpartition("/")[0] + "/"
        self._median = 0.0

    def _reset(self) -> None:
        self._growing_in = False  # the layer moved from zero weights and has not been in line since

    def _value(self, x: X) -> float | None:
        v = x.get(self.metric)
        if v == math.inf:  # moved from zero weights: see the class docstring
            self._growing_in = True
            return None
        return float(v) if v is not None and math.isfinite(v) else None

    def _learn(self, v: float, x: X) -> None:
        pass

    def _score(self, v: float, x: X) -> float:
        if not v > 0:
            return 0.0
        family = self._family
        values = sorted(u for k, u in x.items() if k.startswith(family) and math.isfinite(u) and u > 0)
        n = len(values)
        if n < self.config.min_layers:
            return 0.0
        mid = n // 2
        self._median = values[mid] if n % 2 else 0.5 * (values[mid - 1] + values[mid])
        score = v / (self.config.factor * self._median)
        if self._growing_in:
            if score >= 1.0:
                return 0.0
            self._growing_in = False
        return score

    def _grace_score(self, v: float, x: X) -> float:
        return self._score(v, x)

    @property
    def threshold(self) -> float:
        return 1.0

    def _message(self, v: float | None, score: float) -> str:
        times = score * self.config.factor
        return (f"{self.metric} is {v:.4g}, {times:.0f}x the median of its family ({self._median:.4g}); out of "
                f"line from {self.config.factor:g}x")

    @classmethod
    def example(cls) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
        others = {Metric.UPDATE_RATIO_PREFIX + f"h.{i}": 0.003 + 0.0001 * i for i in range(4)}
        m = Metric.UPDATE_RATIO_PREFIX + "lm_head"
        return m, [{**others, m: 0.004 + 0.0001 * (i % 3)} for i in range(30)], [{**others, m: 0.5}]


RULE_DETECTORS: tuple[type[Detector], ...] = (NonFinite, MissingMetric, LossScaleCollapse, Level, OutOfLine)
