"""A detector that judges its metric's history by a rule of its own.

Some judgements are not "score this point against a learned baseline": the loss's rolling median has stayed
above its best for 20 steps (counted in training steps at the stream's own logging interval), the loss has not
fallen by step 100. Such a detector is a :class:`Rule`: it implements :meth:`Rule.update` itself, keeps the
history it needs in its statistics (``_state_attrs``), and reports through :meth:`Rule._report`, which builds the
anomaly as every detector does (the evidence window, the threshold, ``_message``). A rule has no grace period
(it judges the run's own history, which no warm-up can fake) and learns every value, flagged or not (a rolling
window must hold them all); a rollback shows as a step counter that goes back, which starts a new timeline.

Its river-shaped ``learn_one`` / ``score_one`` use ``_learn`` / ``_score`` on one value, one observation per
step.

>>> class Above(Rule):   # a made-up rule: the metric above `limit` three records in a row, reported once
...     name = kind = "above"
...     _state_attrs = ("_run",)
...     threshold = 3.0
...     def _reset(self): self._run = 0
...     def _learn(self, v, x): self._run = self._run + 1 if v > 5.0 else 0
...     def _score(self, v, x): return float(self._run + 1 if v > 5.0 else 0)
...     def update(self, step, x):
...         v = self._value(x)
...         if v is None:
...             return None
...         self._learn(v, x)
...         return self._report(step, v, self._run) if self._run == 3 else None
>>> d = Above("loss")
>>> [a.step for a in (d.update(s, {"loss": v}) for s, v in enumerate([1, 6, 6, 6, 6])) if a]
[3]
"""

from __future__ import annotations

import math

from stabmon.detect.base import Detector, X
from stabmon.events import Anomaly, Severity


class Rule(Detector):
    """A detector that implements its own :meth:`update`; see the module docstring.

    >>> from stabmon.detect import LossRegression
    >>> d = LossRegression("loss")
    >>> d.in_grace, d.update(0, {"loss": 3.0})
    (False, None)
    """

    grace_exempt = "a rule judges the run's own history, which no warm-up can fake"

    def _learn(self, v: float, x: X) -> None:
        raise NotImplementedError

    def _score(self, v: float, x: X) -> float:
        raise NotImplementedError

    def _severity(self, score: float) -> Severity:
        return Severity.ERROR

    @property
    def in_grace(self) -> bool:
        return False

    def enter_grace(self, steps: int | None = None) -> None:
        """A rule has no grace period: it judges the run's own history (see the module docstring)."""

    def learn_one(self, x: X) -> None:
        v = self._value(x)
        if v is not None:
            self._learn(v, x)
            self.n_learned += 1

    def score_one(self, x: X) -> float:
        v = self._value(x)
        if v is None:
            return 0.0
        score = self._score(v, x)
        return score if math.isfinite(score) else 0.0

    def _report(self, step: int, raw: float | None, score: float) -> Anomaly:
        """The anomaly for a point this rule reports, with its severity (:meth:`_severity`) and message."""
        return self._anomaly(step, raw, score, self._severity(score))
