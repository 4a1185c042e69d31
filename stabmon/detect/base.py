"""The detector contract, in river's shape.

A detector watches one metric (``self.metric``) of the metric mapping ``x`` of each
:class:`~stabmon.events.StepRecord`. It has river's anomaly-detector methods:

- ``learn_one(x)`` updates its statistics (a missing metric is ignored);
- ``score_one(x)`` returns how anomalous ``x`` is, higher = more anomalous, and 0.0 during the grace period
  and when the metric is absent; it never divides by a zero variance.

:meth:`Detector.update` is the public method the suite calls once per record, and the one update path of every
detector. It owns the bookkeeping that every detector shares: the evidence window of recent ``(step, value)``
pairs (one window per metric when a suite shares it among the detectors of that metric, see
``evidence=``), the grace period, the *protect filter* (a point whose score reaches the threshold is reported and NOT
learned, so a spike never becomes the new baseline, as in river's ``anomaly.ThresholdFilter``) and the count of
consecutive flagged points that drives severity. Subclasses implement ``_value``, ``_score``, ``_learn``,
``_severity`` and ``_message``, and list their statistics in ``_state_attrs`` for ``state_dict``.

The detector-specific part of a record is the hook :meth:`Detector._observe`: score the value and learn it
unless it is flagged. Its default composes ``_value``, ``_score`` and ``_learn``; a detector on the replay hot
path overrides it with a cheaper equivalent, and the contract suite checks on random streams that the override
and the default give the same anomalies and the same state.
"""

from __future__ import annotations

import copy
import itertools
import math
import pickle
import types
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any, ClassVar

from stabmon.detect.config import DetectorConfig
from stabmon.events import Anomaly, Severity

X = Mapping[str, float]
_INF = math.inf


def is_flagged(score: float, threshold: float) -> bool:
    """Does a score flag its point? It must be finite and positive and reach the threshold."""
    return score >= threshold and 0.0 < score < _INF


class Detector:
    """Base class; see the module docstring. ``name`` is the config key, ``kind`` the Anomaly kind it emits.

    >>> from stabmon.detect import EWSpike
    >>> d = EWSpike("loss")
    >>> d.in_grace, d.score_one({"loss": 100.0})
    (True, 0.0)
    >>> d.learn_one({"loss": 2.0}); d.n_learned
    1
    """

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""
    Config: ClassVar[type[DetectorConfig]] = DetectorConfig
    _state_attrs: ClassVar[tuple[str, ...]] = ()
    #: why (if at all) this detector keeps firing during grace; safety rules (NaN, a loss scale at its floor)
    #: must not be silenced by a grace period that an intervention or a resume started.
    grace_exempt: ClassVar[str] = ""
    #: why (if at all) this detector learns the points it flags: a rolling window that must hold every value
    #: (the progress detectors compare the loss with its own history) cannot protect its baseline.
    learns_flagged: ClassVar[str] = ""
    #: why (if at all) this detector may skip the records whose value of its metric is finite: one such value
    #: can neither flag it nor teach it anything that changes a later report, so a suite calls its
    #: :meth:`update` only for a record whose value is not finite (the contract suite checks the claim)
    skips_finite: ClassVar[str] = ""
    #: why (if at all) this class has an ``update`` of its own that takes the common case of a settled detector in
    #: a suite inline (no call per statistic) and hands every other record to :meth:`_update_path`; it must
    #: report, learn and keep exactly what the general path does (the contract suite checks the claim). A
    #: detector that fills its own evidence window (not in a suite) always takes the general path.
    fast_update: ClassVar[str] = ""
    #: whether this detector's evidence is the metric's recent ``(step, raw value)`` pairs, which a suite keeps
    #: once per metric for all its detectors (``evidence=``); False for one that keeps other pairs
    shares_evidence: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Give each detector class its own copy of the code of :meth:`update` and of the ``_observe`` it
        inherits: CPython (3.11+) specialises attribute loads and calls per code object for one class at a
        time, so one copy shared by the dozen detectors of a suite runs about a fifth slower than a copy per
        class (``benchmarks/replay.py --clock cpu``). The code is the same; only its caches are per class. A
        subclass that wraps ``update``, or takes a shortcut in it, calls the general path as
        ``self._update_path``."""
        super().__init_subclass__(**kwargs)
        # named for itself: a detector that keeps it as its ``update`` (see _bind_update) pickles it by name
        cls._update_path = _own_copy(Detector.update, "_update_path")  # type: ignore[method-assign]
        if "update" not in cls.__dict__:  # the general path, or a base class's fast path (``fast_update``)
            cls.update = _own_copy(cls.update)  # type: ignore[method-assign]
        if "_observe" not in cls.__dict__:
            cls._observe = _own_copy(cls._observe)  # type: ignore[method-assign]

    def __init__(self, metric: str, config: Any = None, *, evidence: deque[tuple[int, float]] | None = None) -> None:
        """``evidence``: the metric's ``(step, raw value)`` window, shared with the other detectors of the metric
        and filled by the caller once per record that has the metric (a :class:`~stabmon.detect.DetectorSuite`
        does), at least ``config.evidence`` long; None: the detector keeps and fills its own."""
        self.metric = metric
        self.config = config if config is not None else self.Config()
        self._fills_evidence = evidence is None
        self._evidence: deque[tuple[int, float]] = (
            deque(maxlen=self.config.evidence) if evidence is None else evidence
        )
        self._bind_update()
        self._grace_left = self.config.grace_period
        #: the training step from which a detector that starts with the run scores (set by the first
        #: :meth:`update`; None until then); see :meth:`_begin`
        self._warmup_until: int | None = None
        self._warming = False
        self._grace_entered = False
        self._streak = 0
        #: the step from which :meth:`update` takes its common case: set once the detector has passed warm-up
        #: and grace with no flagged streak running; unset (infinite) by a flag, a grace period or a reload
        self._settled_from: float = _INF
        self.n_learned = 0
        self._reset()
        self._threshold = float(self.threshold)  # config is frozen: the threshold never changes

    # --- subclass hooks -------------------------------------------------------------------------------------
    def _reset(self) -> None:
        """(Re)create the statistics."""

    def _value(self, x: X) -> float | None:
        v = x.get(self.metric)
        return float(v) if v is not None and math.isfinite(v) else None

    def _learn(self, v: float, x: X) -> None:
        raise NotImplementedError

    def _score(self, v: float, x: X) -> float:
        raise NotImplementedError

    def _grace_score(self, v: float, x: X) -> float:
        """The score during grace: 0, except for what a ``grace_exempt`` detector reports whenever it happens."""
        return 0.0

    @property
    def threshold(self) -> float:
        raise NotImplementedError

    def _severity(self, score: float, streak: int) -> Severity:
        return Severity.WARNING

    def _message(self, v: float | None, score: float) -> str:
        return f"{self.metric} {self.kind}: score {score:.3g} >= {self.threshold:.3g}"

    def _on_flag(self) -> None:
        """Called after a point is flagged (and not learned)."""

    def _observe(self, raw: float | None, x: X, scoring: bool) -> float | None:
        """The detector-specific part of :meth:`update`: the score of this record's value, which is learned
        unless the score flags it. None when the record has no usable value (nothing scored, nothing learned).
        ``raw`` is ``x.get(self.metric)``; ``scoring`` is False in grace and warm-up (see
        :meth:`_grace_score`).

        This default is the general path; an override must give the same scores and the same state (checked
        by the contract suite), only faster."""
        v = self._value(x)
        if v is None:
            return None
        score = self._score(v, x) if scoring else self._grace_score(v, x)
        if not is_flagged(score, self._threshold):
            self._learn(v, x)
        return score

    def watches(self, names: AbstractSet[str]) -> bool:
        """Must :meth:`update` see a record with these metric names? By default only one that has this
        detector's metric: the suite skips the others, so an absent metric neither scores nor breaks a streak.
        A detector for which absence, or another metric, is the signal widens it."""
        return self.metric in names

    # --- river-shaped API -----------------------------------------------------------------------------------
    @property
    def in_grace(self) -> bool:
        return self._grace_left > 0 or self._warming

    def learn_one(self, x: X) -> None:
        self._learn_value(self._value(x), x)

    def score_one(self, x: X) -> float:
        return self._score_value(self._value(x), x)

    def _learn_value(self, v: float | None, x: X) -> None:
        if v is None:
            return
        self._learn(v, x)
        self.n_learned += 1
        if self._grace_left > 0:
            self._grace_left -= 1

    def _score_value(self, v: float | None, x: X) -> float:
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

    def update(self, step: int, x: X) -> Anomaly | None:
        """Score, then learn unless flagged; return the Anomaly when the score reaches the threshold.

        The per-record hot path: the value is computed once (by :meth:`_observe`), shared by scoring and
        learning, and the evidence window is only copied into a tuple when a point is flagged."""
        raw = x.get(self.metric)
        if raw is not None and self._fills_evidence:
            self._evidence.append((step, raw))
        if step >= self._settled_from:  # the common case: past warm-up and grace, no flagged streak running
            score = self._observe(raw, x, True)
            if score is None:
                return None
            if score < self._threshold:  # not flagged (a flag, or a NaN, takes the general path below)
                self.n_learned += 1
                return None
            return self._judge(step, raw, score)
        warmup = self._warmup_until
        if warmup is None:
            warmup = self._begin(step)
        warming = self._warming = step < warmup
        found = self._judge(step, raw, self._observe(raw, x, not warming and self._grace_left <= 0))
        if found is None and not warming and self._grace_left <= 0 and self.n_learned:
            self._settled_from = warmup  # settled: later records of steps from warmup on take the common case
        return found

    def _judge(self, step: int, raw: float | None, score: float | None) -> Anomaly | None:
        """Report the point if its score flags it, else count it as learned (None: nothing was observed)."""
        if score is None:
            self._streak = 0
            return None
        if score >= self._threshold and 0.0 < score < _INF:  # is_flagged, inline: this runs on every record
            return self._flag(step, raw, score)
        self._streak = 0
        self.n_learned += 1
        if self._grace_left > 0:
            self._grace_left -= 1
        return None

    def _flag(self, step: int, raw: float | None, score: float) -> Anomaly:
        """Report a flagged point (not learned: the protect filter)."""
        self._streak += 1
        self._settled_from = _INF
        anomaly = Anomaly(
            kind=self.kind,
            metric=self.metric,
            step=step,
            score=float(score),
            severity=self._severity(score, self._streak),
            detector=self.name,
            evidence=tuple((s, float(v)) for s, v in self._recent_evidence()),
            threshold=self._threshold,
            message=self._message(None if raw is None else float(raw), score),
        )
        self._on_flag()
        return anomaly

    def _recent_evidence(self) -> Iterable[tuple[int, float]]:
        """The last ``config.evidence`` pairs of the evidence window (a shared one may be longer)."""
        window = self._evidence
        return itertools.islice(window, max(0, len(window) - self.config.evidence), None)

    # --- state ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain values plus pickled river statistics (bytes), safe for ``torch.save`` / ``weights_only``."""
        return {
            "class": type(self).__name__,
            "metric": self.metric,
            "grace_left": self._grace_left,
            "warmup_until": self._warmup_until,
            "warming": self._warming,
            "grace_entered": self._grace_entered,
            "streak": self._streak,
            "n_learned": self.n_learned,
            "evidence": [list(e) for e in self._recent_evidence()],
            "stats": {a: pickle.dumps(getattr(self, a)) for a in self._state_attrs},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("class") != type(self).__name__:
            raise ValueError(f"state is for {state.get('class')!r}, not {type(self).__name__}")
        self.metric = state["metric"]
        self._grace_left = int(state["grace_left"])
        warmup = state.get("warmup_until")
        self._warmup_until = None if warmup is None else int(warmup)
        self._grace_entered = bool(state.get("grace_entered", False))
        self._warming = bool(state.get("warming", False))
        self._streak = int(state["streak"])
        self._settled_from = _INF
        self.n_learned = int(state["n_learned"])
        evidence = [(int(s), float(v)) for s, v in state["evidence"]]
        if self._fills_evidence:
            self._evidence = deque(evidence, maxlen=self._evidence.maxlen)
        elif len(evidence) > len(self._evidence):  # shared: every detector of the metric saved a part of it
            self._evidence.clear()
            self._evidence.extend(evidence)
        for a, blob in state["stats"].items():
            setattr(self, a, pickle.loads(blob))

    def _update_path(self, step: int, x: X) -> Anomaly | None:
        """This class's own copy of :meth:`Detector.update` (see :meth:`__init_subclass__`)."""
        return Detector.update(self, step, x)

    def clone(self) -> Detector:
        """An independent copy; one of a suite's detectors gets its own evidence window, which it fills."""
        twin = copy.deepcopy(self)
        if not self._fills_evidence:
            twin.keep_evidence(self._recent_evidence())
        return twin

    def keep_evidence(self, pairs: Iterable[tuple[int, float]]) -> None:
        """Keep (and fill) an evidence window of its own, starting with ``pairs``: for a detector taken out of
        the suite that shared its metric's window."""
        self._fills_evidence = True
        self._evidence = deque(pairs, maxlen=self.config.evidence)
        self._bind_update()

    def _bind_update(self) -> None:
        """A class's fast ``update`` (``fast_update``) is for a detector in a suite, whose caller fills the
        evidence window; one that fills its own takes the general path."""
        if self.fast_update and self._fills_evidence:
            self.update = self._update_path  # type: ignore[method-assign]

    # --- contract examples (used by the contract test suite and the docs) -----------------------------------
    @classmethod
    def example(cls) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
        """``(metric, healthy stream, a bad stream this detector must flag somewhere after the healthy
        one)``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(metric={self.metric!r}, config={self.config!r})"


def _own_copy(f: Callable[..., Any], name: str | None = None) -> Any:
    """A new function with a new code object equal to ``f``'s (new code objects do not share caches), named
    ``name`` (default: ``f``'s name)."""
    g = types.FunctionType(f.__code__.replace(), f.__globals__, name or f.__name__, f.__defaults__, f.__closure__)
    g.__qualname__ = f.__qualname__ if name is None else f"{f.__qualname__.rpartition('.')[0]}.{name}"
    g.__doc__, g.__module__ = f.__doc__, f.__module__
    g.__kwdefaults__, g.__annotations__ = f.__kwdefaults__, f.__annotations__
    return g
