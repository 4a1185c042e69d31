"""When the loss alarm rings (:mod:`stabmon.collect.signals.alarm`), judged on host numbers: a loss that is NaN or
inf, or a finite one that jumped above ``rise`` times the running mean of the losses before it and above that mean
by ``z`` times their running absolute deviation. Plain Python, so that ``stabmon replay`` judges the recorded
losses of a stored run exactly as its live alarm did, where torch cannot be imported too.

>>> jump = LossJump(rise=1.5, warmup=3)
>>> [jump.judge(v) for v in (2.0, 2.0, 2.0, 2.1, 3.5, 2.0, float("nan"))]
[False, False, False, False, True, False, True]
>>> LossJump(rise=None).judge(1e9), LossJump(rise=None).judge(float("inf"))
(False, True)
"""

from __future__ import annotations

import math


class LossJump:
    """``judge`` each step's loss in order (the running means learn every finite one, the jump's too)."""

    def __init__(self, rise: float | None, *, z: float = 6.0, warmup: int = 20, decay: float = 0.95) -> None:
        if rise is not None and not rise > 1.0:
            raise ValueError(f"the alarm's rise must be > 1 or None, got {rise}")
        self.rise, self.z, self.warmup, self.decay = rise, z, warmup, decay
        self._means: tuple[float, float] | None = None  # the running mean of the finite losses, and their deviation
        self._seen = 0  # finite losses judged

    def judge(self, loss: float) -> bool:
        """Whether this loss rings (non-finite, or after the warm-up a jump over the means), then learn it."""
        if not math.isfinite(loss):
            return True
        if self.rise is None:
            return False
        self._seen += 1
        if self._means is None or not self._means[0] > 0:  # (a loss that is not positive: no jump to judge)
            self._means = (loss, 0.0)
            return False
        mean, dev = self._means
        d = min(self.decay, 1 - 1 / self._seen)  # a plain average until it holds 1 / (1 - decay) losses
        self._means = (d * mean + (1 - d) * loss, d * dev + (1 - d) * abs(loss - mean))
        return self._seen > self.warmup and loss > self.rise * mean and loss > mean + self.z * dev


__all__ = ["LossJump"]
