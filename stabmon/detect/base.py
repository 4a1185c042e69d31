"""What every detector is, and the two ways to write one.

A detector watches one metric (``self.metric``) of the metric mapping ``x`` of each
:class:`~stabmon.events.StepRecord`; the suite calls its :meth:`Detector.update` once per record that it
:meth:`~Detector.watches`, and gets an :class:`~stabmon.events.Anomaly` or None. Every detector also has river's
anomaly-detector methods (``learn_one(x)``, ``score_one(x)``: higher = more anomalous, never NaN), a
``state_dict``, and an evidence window of the metric's recent ``(step, raw value)`` pairs (one window per
metric when a suite shares it among the detectors of that metric, see ``evidence=``).

There are two kinds, each with one small set of hooks:

- :class:`~stabmon.detect.scorer.Scorer` - a point scorer in river's shape: ``_score`` / ``_learn`` on one value,
  higher = more anomalous. One guard (:meth:`Scorer.update <stabmon.detect.scorer.Scorer.update>`) owns what
  every scorer shares: the grace period, the protect filter (a flagged point is reported and not learned), the
  streak of flagged points that drives severity, and the evidence. Spikes, drift, NaN and loss-scale rules,
  step time, the fleet detectors.
- :class:`~stabmon.detect.rule.Rule` - a detector that judges the metric's history by a rule of its own (rolling
  windows in training steps, once per excursion, new timelines after a rollback) and implements ``update``
  itself. The progress detectors.

Both build their anomaly the same way (:meth:`Detector._anomaly`) and share the state format.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections import deque
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any, ClassVar

from stabmon.detect import plain
from stabmon.detect.config import DetectorConfig
from stabmon.events import Anomaly, Severity

X = Mapping[str, float]


STATS_FORMAT = "plain-1"
"""How ``state_dict()["stats"]`` is written: plain values (:mod:`stabmon.detect.plain`). A state without it was
written with pickled statistics, which are refused."""


class Detector:
    """The common base of :class:`~stabmon.detect.scorer.Scorer` and :class:`~stabmon.detect.rule.Rule`; see the
    module docstring. ``name`` is the config key, ``kind`` the Anomaly kind it emits. What a detector *is* is
    declared on its class (``grace_exempt``, ``skips_finite``, ``shares_evidence``) and read by the suite.

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
    #: the attributes holding its statistics, written as plain values into ``state_dict()["stats"]``
    _state_attrs: ClassVar[tuple[str, ...]] = ()
    #: why (if at all) this detector keeps firing during grace; safety rules (NaN, a loss scale at its floor)
    #: must not be silenced by a grace period that an intervention or a resume started.
    grace_exempt: ClassVar[str] = ""
    #: why (if at all) this detector may skip the records whose value of its metric is finite: one such value
    #: can neither flag it nor teach it anything that changes a later report, so a suite calls its
    #: :meth:`update` only for a record whose value is not finite (the contract suite checks the claim)
    skips_finite: ClassVar[str] = ""
    #: whether this detector's evidence is the metric's recent ``(step, raw value)`` pairs, which a suite keeps
    #: once per metric for all its detectors (``evidence=``); False for one that keeps other pairs
    shares_evidence: ClassVar[bool] = True

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
        self.n_learned = 0
        self._reset()
        self._threshold = float(self.threshold)  # config is frozen: the threshold never changes

    # --- what a subclass provides ---------------------------------------------------------------------------
    def update(self, step: int, x: X) -> Anomaly | None:
        """Judge one record of training step ``step``: the Anomaly, or None."""
        raise NotImplementedError

    def learn_one(self, x: X) -> None:
        raise NotImplementedError

    def score_one(self, x: X) -> float:
        raise NotImplementedError

    def enter_grace(self, steps: int | None = None) -> None:
        """Re-enter the grace period (after an intervention, a rollback or a resume)."""
        raise NotImplementedError

    @property
    def in_grace(self) -> bool:
        raise NotImplementedError

    def _reset(self) -> None:
        """(Re)create the statistics."""

    def _value(self, x: X) -> float | None:
        """The value this detector judges in ``x`` (None: none usable). By default the metric, if finite."""
        v = x.get(self.metric)
        return float(v) if v is not None and math.isfinite(v) else None

    @property
    def threshold(self) -> float:
        raise NotImplementedError

    def _message(self, v: float | None, score: float) -> str:
        return f"{self.metric} {self.kind}: score {score:.3g} >= {self.threshold:.3g}"

    def watches(self, names: AbstractSet[str]) -> bool:
        """Must :meth:`update` see a record with these metric names? By default only one that has this
        detector's metric: the suite skips the others, so an absent metric neither scores nor breaks a streak.
        A detector for which absence, or another metric, is the signal widens it."""
        return self.metric in names

    # --- reporting ------------------------------------------------------------------------------------------
    def _anomaly(self, step: int, raw: float | None, score: float, severity: Severity) -> Anomaly:
        """The report of a flagged point, with the recent evidence (copied only now) and the message."""
        return Anomaly(
            kind=self.kind,
            metric=self.metric,
            step=step,
            score=float(score),
            severity=severity,
            detector=self.name,
            evidence=tuple((s, float(v)) for s, v in self._recent_evidence()),
            threshold=self._threshold,
            message=self._message(None if raw is None else float(raw), score),
        )

    def _recent_evidence(self) -> Iterable[tuple[int, float]]:
        """The last ``config.evidence`` pairs of the evidence window (a shared one may be longer)."""
        window = self._evidence
        return itertools.islice(window, max(0, len(window) - self.config.evidence), None)

    # --- state ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain values only (the statistics too: :mod:`stabmon.detect.plain`): it loads with
        ``torch.load(weights_only=True)``, and loading it runs no code."""
        return {
            "class": type(self).__name__,
            "metric": self.metric,
            "n_learned": self.n_learned,
            "evidence": [list(e) for e in self._recent_evidence()],
            "stats_format": STATS_FORMAT,
            "stats": {a: plain.dump(getattr(self, a)) for a in self._state_attrs},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("class") != type(self).__name__:
            raise ValueError(f"state is for {state.get('class')!r}, not {type(self).__name__}")
        if state.get("stats_format") != STATS_FORMAT:
            raise ValueError(f"{type(self).__name__}: detector state written by stabmon 0.1.0 or earlier (pickled "
                             "statistics): refused, never unpickled; resume from a checkpoint this version wrote")
        stats = {a: plain.load(value) for a, value in state["stats"].items() if a in self._state_attrs}
        self.metric = state["metric"]
        self.n_learned = int(state["n_learned"])
        evidence = [(int(s), float(v)) for s, v in state["evidence"]]
        if self._fills_evidence:
            self._evidence = deque(evidence, maxlen=self._evidence.maxlen)
        elif len(evidence) > len(self._evidence):  # shared: every detector of the metric saved a part of it
            self._evidence.clear()
            self._evidence.extend(evidence)
        for a, value in stats.items():
            setattr(self, a, value)

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

    # --- contract examples (used by the contract test suite and the docs) -----------------------------------
    @classmethod
    def example(cls) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
        """``(metric, healthy stream, a bad stream this detector must flag somewhere after the healthy
        one)``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(metric={self.metric!r}, config={self.config!r})"
