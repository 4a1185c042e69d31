"""A point scorer in river's shape behind one guard.

A :class:`Scorer` subclass is river's anomaly detector on one value of its metric:

- ``_value(x)``: the value judged (None: nothing usable, nothing scored or learned);
- ``_score(v, x)``: how anomalous it is, higher = more anomalous, never a division by a zero variance;
- ``_learn(v, x)``: update the statistics with it;
- ``threshold``: the score that flags a point;
- optionally ``_grace_score`` (what it reports during grace; 0 unless ``grace_exempt``), ``_severity``,
  ``_message``, ``_on_flag`` and ``_reset`` (the statistics, in ``_state_attrs``).

:meth:`Scorer.update` is the guard, the one update path of every scorer. It owns what they share: the evidence
window, the start-of-training warm-up and the grace period (score 0, learn), the *protect filter* (a point whose
score reaches the threshold is reported and NOT learned, so a spike never becomes the new baseline, as in
river's ``anomaly.ThresholdFilter``), and the streak of consecutive flagged points that drives severity.

The per-record hook is :meth:`Scorer._observe`: score the value, and learn it unless the score flags it. Its
default composes ``_value``, ``_score`` and ``_learn``; a scorer on the replay hot path may override it with a
cheaper equivalent (its statistics read without a call per statistic), and the contract suite checks on random
streams that the override and the default give the same anomalies and the same state. A scorer that must
report less than it flags (once per episode, once at a floor) extends :meth:`Scorer._flag`, which may return
None: the point stays flagged (not learned, the streak goes on) but is not reported.

>>> from stabmon.detect.config import DetectorConfig
>>> class Above(Scorer):   # a made-up scorer: how far above the running mean, in units of the mean
...     name = kind = "above"
...     _state_attrs = ("_mean",)
...     def _reset(self): self._mean = 0.0
...     def _learn(self, v, x): self._mean += (v - self._mean) / (self.n_learned + 1)
...     def _score(self, v, x): return v / self._mean - 1 if self._mean > 0 else 0.0
...     threshold = 1.0
>>> d = Above("loss", DetectorConfig(metrics=("loss",), grace_period=3))
>>> [d.update(s, {"loss": v}) for s, v in enumerate([2.0, 2.0, 2.0, 2.0])]
[None, None, None, None]
>>> a = d.update(4, {"loss": 5.0}); a.kind, a.score, d.n_learned   # flagged, not learned
('above', 1.5, 4)
"""

from __future__ import annotations

import math
import types
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from stabmon.detect.base import Detector, X
from stabmon.events import Anomaly, Severity

_INF = math.inf


class Scorer(Detector):
    """A detector that scores each point against what it has learned; see the module docstring.

    >>> from stabmon.detect import EWSpike
    >>> d = EWSpike("grad_norm")
    >>> [d.update(s, {"grad_norm": 1.0}) for s in range(11)][-1] is None, d.in_grace
    (True, False)
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Give each scorer class its own copy of the code of the guard (:meth:`update`) and of the
        :meth:`_observe` it inherits. The code is the same, one path for every scorer; only CPython's caches
        differ: it specialises attribute loads and calls per code object, and one copy shared by the detectors
        of a suite (four classes on every record of a replay) makes the suite about 1.3x slower
        (``benchmarks/replay.py --clock cpu``)."""
        super().__init_subclass__(**kwargs)
        for name in ("update", "_observe"):
            if name not in cls.__dict__:
                setattr(cls, name, _own_copy(getattr(cls, name)))

    def __init__(self, metric: str, config: Any = None, *, evidence: deque[tuple[int, float]] | None = None) -> None:
        self._grace_left = 0
        #: the training step from which a detector that starts with the run scores (set by the first
        #: :meth:`update`; None until then); see :meth:`_begin`
        self._warmup_until: int | None = None
        self._warming = False
        self._grace_entered = False
        self._streak = 0
        #: the step from which :meth:`update` takes its common case: set once the detector has passed warm-up
        #: and grace with no flagged streak running; unset (infinite) by a flag, a grace period or a reload
        self._settled_from: float = _INF
        super().__init__(metric, config, evidence=evidence)
        self._grace_left = self.config.grace_period

    # --- the scorer (river's shape, on one value) -----------------------------------------------------------
    def _learn(self, v: float, x: X) -> None:
        raise NotImplementedError

    def _score(self, v: float, x: X) -> float:
        raise NotImplementedError

    def _grace_score(self, v: float, x: X) -> float:
        """The score during grace: 0, except for what a ``grace_exempt`` detector reports whenever it happens."""
        return 0.0

    def _severity(self, score: float, streak: int) -> Severity:
        return Severity.WARNING

    def _on_flag(self) -> None:
        """Called after a point is flagged (and not learned)."""

    def _observe(self, raw: float | None, x: X, scoring: bool) -> float | None:
        """The per-record hook of :meth:`update`: the score of this record's value, which is learned unless the
        score flags it (river's ``ThresholdFilter``). None when the record has no usable value (nothing scored,
        nothing learned). ``raw`` is ``x.get(self.metric)``; ``scoring`` is False in grace and warm-up (see
        :meth:`_grace_score`).

        This default is the definition; an override must give the same reports and the same state (checked by
        the contract suite), only faster. A score below the threshold may be returned inexactly (any value
        below it is the same verdict)."""
        v = self._value(x)
        if v is None:
            return None
        score = self._score(v, x) if scoring else self._grace_score(v, x)
        if not (score >= self._threshold and 0.0 < score < _INF):  # flagged: positive, finite, at the threshold
            self._learn(v, x)
        return score

    # --- river-shaped API -----------------------------------------------------------------------------------
    @property
    def in_grace(self) -> bool:
        return self._grace_left > 0 or self._warming

    def learn_one(self, x: X) -> None:
        v = self._value(x)
        if v is None:
            return
        self._learn(v, x)
        self.n_learned += 1
        if self._grace_left > 0:
            self._grace_left -= 1

    def score_one(self, x: X) -> float:
        v = self._value(x)
        if v is None:
            return 0.0
        score = self._grace_score(v, x) if self.in_grace else self._score(v, x)
        return score if math.isfinite(score) else 0.0

    def enter_grace(self, steps: int | None = None) -> None:
        """Re-enter the grace period: score 0 and learn the next ``steps`` observations (default:
        ``grace_period``). Used after an intervention, a rollback or a resume, and by the river-shaped
        ``learn_one`` / ``score_one`` API, which knows no step numbers."""
        self._grace_left = self.config.grace_period if steps is None else int(steps)
        self._grace_entered = True
        self._streak = 0
        self._settled_from = _INF

    def _rebaseline(self) -> None:
        """Forget the statistics and learn a new baseline, in grace (a shift that has lasted is a new regime)."""
        self._reset()
        self.n_learned = 0
        self.enter_grace()

    # --- the guard ------------------------------------------------------------------------------------------
    def update(self, step: int, x: X) -> Anomaly | None:
        """Score, then learn unless flagged; return the Anomaly when the score reaches the threshold.

        The per-record hot path: the value is read once (by :meth:`_observe`), shared by scoring and learning,
        and the evidence window is only copied into a tuple when a point is flagged. Once a detector in a suite
        (whose evidence the suite fills) has settled - past warm-up and grace, no streak running - a record that
        does not flag costs one hook call and a count."""
        if step >= self._settled_from:  # the common case
            raw = x.get(self.metric)
            score = self._observe(raw, x, True)
            if score is None:
                return None
            if score < self._threshold:  # not flagged (a flag, or a NaN, is judged below)
                self.n_learned += 1
                return None
            return self._judge(step, raw, score)
        raw = x.get(self.metric)
        if raw is not None and self._fills_evidence:
            self._evidence.append((step, raw))
        warmup = self._warmup_until
        if warmup is None:
            warmup = self._begin(step)
        warming = self._warming = step < warmup
        if warming:  # the step counter went back before warm-up ended: not settled until it is past it again
            self._settled_from = _INF
        found = self._judge(step, raw, self._observe(raw, x, not warming and self._grace_left <= 0))
        if not (self._streak or warming or self._fills_evidence) and self._grace_left <= 0 and self.n_learned:
            self._settled_from = warmup  # settled: later records of steps from warmup on take the common case
        return found

    def _begin(self, step: int) -> int:
        """The first record this detector sees through :meth:`update`: fix its start-of-training grace, and
        return the step from which it scores.

        Grace protects the volatile *start of training* (LR warm-up, the initial loss-scale search), so at the
        start it is counted in training steps: a detector scores once ``step >= grace_period`` and it has
        learned at least one observation (its baseline). A stream that begins mid-run (a monitor attached to
        a resumed job, a log fragment cut from step 7000) is past that start: the volatile phase is long
        over, so it scores from its second observation on. A grace the caller asked for explicitly
        (:meth:`enter_grace` before the first record, e.g. on a resume without restored detector state) is
        kept, counted in observations."""
        if self._grace_entered or self.n_learned:
            self._warmup_until = step  # grace, if any, is counted in observations
        else:
            self._warmup_until = self.config.grace_period
            self._grace_left = 0
        return self._warmup_until

    def _judge(self, step: int, raw: float | None, score: float | None) -> Anomaly | None:
        """Report the point if its score flags it, else count it as learned (None: nothing was observed)."""
        if score is None:
            self._streak = 0
            return None
        if score >= self._threshold and 0.0 < score < _INF:  # flagged (see _observe)
            self._streak += 1
            self._settled_from = _INF
            return self._flag(step, raw, score)
        self._streak = 0
        self.n_learned += 1
        if self._grace_left > 0:
            self._grace_left -= 1
        return None

    def _flag(self, step: int, raw: float | None, score: float) -> Anomaly | None:
        """Report a flagged point (not learned: the protect filter; ``_streak`` already counts it). An override
        may add to the report, or withhold it (None: flagged, but not reported)."""
        anomaly = self._anomaly(step, raw, score, self._severity(score, self._streak))
        self._on_flag()
        return anomaly

    # --- state ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "grace_left": self._grace_left,
            "warmup_until": self._warmup_until,
            "warming": self._warming,
            "grace_entered": self._grace_entered,
            "streak": self._streak,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self._grace_left = int(state["grace_left"])
        warmup = state.get("warmup_until")
        self._warmup_until = None if warmup is None else int(warmup)
        self._grace_entered = bool(state.get("grace_entered", False))
        self._warming = bool(state.get("warming", False))
        self._streak = int(state["streak"])
        self._settled_from = _INF

    def keep_evidence(self, pairs: Iterable[tuple[int, float]]) -> None:
        super().keep_evidence(pairs)
        self._settled_from = _INF  # it fills its own window now: the general path

def _own_copy(f: Callable[..., Any]) -> Any:
    """A function equal to ``f`` with a code object of its own (code objects do not share CPython's caches)."""
    g = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    g.__qualname__, g.__doc__, g.__module__ = f.__qualname__, f.__doc__, f.__module__
    g.__kwdefaults__, g.__annotations__ = f.__kwdefaults__, f.__annotations__
    return g
