"""A rolling window kept twice, in arrival order (a bounded deque) and sorted (a list), so that its median
costs a binary search per value instead of a sort per record.

>>> from collections import deque
>>> recent, ordered = deque(maxlen=3), []
>>> for v in (3.0, 1.0, 2.0, 5.0):
...     push(recent, ordered, v)
>>> list(recent), ordered, median(ordered)
([1.0, 2.0, 5.0], [1.0, 2.0, 5.0], 2.0)
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import deque


def push(recent: deque[float], ordered: list[float], v: float) -> None:
    """Append ``v`` to ``recent`` (dropping its oldest value when full) and keep ``ordered`` its sorted copy."""
    if len(recent) == recent.maxlen:
        del ordered[bisect.bisect_left(ordered, recent[0])]
    recent.append(v)
    bisect.insort(ordered, v)


def median(ordered: list[float]) -> float:
    """The median of a sorted, non-empty list, as :func:`statistics.median` computes it."""
    n = len(ordered)
    i = n // 2
    return ordered[i] if n % 2 else (ordered[i - 1] + ordered[i]) / 2


class Cadence:
    """How often a metric arrives, in training steps: the median gap between the steps of its last ``n``
    records (1 until two have arrived). A log written every ``logging_steps`` (Hugging Face Trainer: 10 by
    default, 500 in old examples) has records that far apart; a live monitor, one per step.

    Detectors count their windows and their patience in steps *and* records, whichever is longer
    (:meth:`span`): 20 steps are 20 records of a per-step log but only 2 of a log written every 10 steps, too
    few to judge; 12 records of that log are 120 steps.

    >>> c = Cadence()
    >>> for s in (0, 10, 20, 30, 45):
    ...     c.see(s)
    >>> c.interval, c.span(steps=20, records=12)
    (10, 120)
    >>> c.see(5); c.interval      # the step counter went back (a rollback): not a gap
    10
    """

    def __init__(self, n: int = 15) -> None:
        self._gaps: deque[float] = deque(maxlen=n)
        self._sorted: list[float] = []
        #: the step of the last record seen (-1: none yet)
        self.last = -1
        self.interval = 1
        #: the window is full of gaps equal to ``interval``: a record ``interval`` steps after ``last`` changes
        #: nothing but ``last`` (a caller on a hot path may then just set ``last``)
        self.steady = False

    def see(self, step: int) -> None:
        last, self.last = self.last, step
        if last < 0 or step <= last:
            return
        gap = float(step - last)
        gaps = self._gaps
        if self.steady and gap == self.interval:
            return
        push(gaps, self._sorted, gap)
        self.interval = max(1, int(median(self._sorted)))
        ordered = self._sorted
        self.steady = len(gaps) == gaps.maxlen and ordered[0] == ordered[-1] == self.interval

    def span(self, *, steps: int, records: int) -> int:
        """The longer of ``steps`` training steps and ``records`` records at this cadence, in steps."""
        return max(steps, records * self.interval)


class Noise:
    """A run's own record-to-record variation of a positive metric, in log units, robustly: the median absolute
    difference between consecutive log-values over the last ``n`` records, scaled to a standard deviation
    (x 1.0484: for Gaussian noise the difference of two values has sigma*sqrt(2) and its median absolute value is
    0.6745 of that). A log that rounds its values (the Trainer writes 4 decimals: 0.0001 and 0.0002 are
    neighbours) has at least half a rounding step of noise: the smallest change between those values.

    Seeing a value costs one append; the statistics are computed only when asked for (:meth:`sigma`), which a
    detector does only for a point its cheap test could not settle.

    >>> n = Noise()
    >>> for v in (2.0, 2.1, 2.0, 2.1, 2.0, 2.1):
    ...     n.see(v)
    >>> round(n.sigma(2.0), 4), n.count
    (0.0512, 5)
    """

    SCALE = 1.0484

    def __init__(self, n: int = 128) -> None:
        #: the last ``n + 1`` values; a caller on a hot path may append to it directly (what :meth:`see` does)
        self.values: deque[float] = deque(maxlen=n + 1)

    def see(self, v: float) -> None:
        self.values.append(v)

    def restart(self) -> None:
        """The next value follows no previous one (a rollback or a new timeline): the window starts again."""
        self.values.clear()

    @property
    def count(self) -> int:
        """How many differences the estimate rests on."""
        return max(0, len(self.values) - 1)

    def sigma(self, level: float) -> float:
        """The standard deviation of one record's log-value, at least half a rounding step at ``level``."""
        values = self.values
        if len(values) < 2:
            return 0.0
        pairs = list(itertools.pairwise(values))
        spread = self.SCALE * statistics.median(abs(math.log(b / a)) for a, b in pairs)
        steps = [abs(b - a) for a, b in pairs if b != a]
        floor = 0.5 * math.log1p(min(steps) / level) if steps and level > 0 else 0.0
        return max(spread, floor)
