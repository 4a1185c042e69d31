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
