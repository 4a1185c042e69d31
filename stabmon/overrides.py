"""Hyper-parameter overrides that interventions set and the monitor enforces around ``optimizer.step()``.

The monitor's optimizer pre-step hook writes the effective values into the param groups and its post-step hook
restores what the scheduler had written, so no LR scheduler can silently undo an intervention and the scheduler's
own trajectory continues underneath. Overrides are part of ``Monitor.state_dict()``.

>>> o = Overrides(lr_scale=0.9, max_norm=1.5)
>>> o2 = Overrides(); o2.load_state_dict(o.state_dict()); o2 == o
True
>>> Overrides(lr_scale=0.0)
Traceback (most recent call last):
...
ValueError: overrides.lr_scale must be > 0, got 0.0
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class Overrides:
    lr_scale: float = 1.0
    """Multiplies the scheduler's learning rate for every param group."""
    lr_cap: float | None = None
    """Upper bound on every param group's learning rate after ``lr_scale`` (None: no bound). A schedule that
    keeps rising past the edge of stability (a warm-up set far too long or too high) stays under it."""
    max_norm: float | None = None
    """Gradient clipping threshold in force; None keeps the monitor's configured ``clip``."""
    beta2: float | None = None
    """Adam/AdamW second-moment decay; None keeps the optimizer's own."""
    weight_decay: float | None = None
    """Decoupled weight decay; None keeps the optimizer's own."""
    skip_factor: float | None = None
    """skip_step guard: discard the update when grad norm > skip_factor x its running mean. None = off."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not self.lr_scale > 0:
            raise ValueError(f"overrides.lr_scale must be > 0, got {self.lr_scale}")
        if self.lr_cap is not None and not self.lr_cap > 0:
            raise ValueError(f"overrides.lr_cap must be > 0, got {self.lr_cap}")
        if self.max_norm is not None and not self.max_norm > 0:
            raise ValueError(f"overrides.max_norm must be > 0, got {self.max_norm}")
        if self.beta2 is not None and not 0.0 < self.beta2 < 1.0:
            raise ValueError(f"overrides.beta2 must be in (0, 1), got {self.beta2}")
        if self.weight_decay is not None and not self.weight_decay >= 0:
            raise ValueError(f"overrides.weight_decay must be >= 0, got {self.weight_decay}")
        if self.skip_factor is not None and not self.skip_factor > 1.0:
            raise ValueError(f"overrides.skip_factor must be > 1, got {self.skip_factor}")

    def scaled_lr(self, lr: Any) -> Any:
        """The learning rate in force for a scheduler's ``lr`` (a float or a tensor): times ``lr_scale``, at most
        ``lr_cap``.

        >>> Overrides(lr_scale=0.5, lr_cap=0.1).scaled_lr(0.3), Overrides(lr_scale=0.5).scaled_lr(0.1)
        (0.1, 0.05)
        """
        out = lr * self.lr_scale
        if self.lr_cap is None:
            return out
        return out.clamp(max=self.lr_cap) if hasattr(out, "clamp") else min(out, self.lr_cap)

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in dataclasses.fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])
        self.validate()
