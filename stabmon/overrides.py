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
    skip_theta: float | None = None
    """skip_step at element level (SPAM): zero each gradient element whose g^2 exceeds skip_theta x its Adam
    second moment (``exp_avg_sq``, where non-zero) before the step. None = off."""
    adaptive_clip: float | None = None
    """adaptive_clip (AdaGC): clip each gradient tensor to adaptive_clip x the running mean of its own clipped
    norm. None = off."""
    adaptive_clip_beta: float = 0.98
    """Decay of adaptive_clip's per-tensor running mean."""
    update_rms_cap: float | None = None
    """clip_update: cap the RMS of each tensor's Adam update direction m^/(sqrt(v^)+eps) at this value (the
    step then moves that tensor by lr x update x cap / RMS). None = off."""
    rewarm_steps: int = 0
    """Length of the LR re-warm-up in force (reset_moments); 0: none."""
    rewarm_left: int = 0
    """Steps of the re-warm-up still to go: the LR is multiplied by ``1 - rewarm_left / (rewarm_steps + 1)``,
    and the optimizer hook counts it down once per step."""

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
        self._validate_state_level()

    def _validate_state_level(self) -> None:
        if self.skip_theta is not None and not self.skip_theta > 1.0:
            raise ValueError(f"overrides.skip_theta must be > 1, got {self.skip_theta}")
        if self.adaptive_clip is not None and not self.adaptive_clip > 1.0:
            raise ValueError(f"overrides.adaptive_clip must be > 1, got {self.adaptive_clip}")
        if not 0.0 < self.adaptive_clip_beta < 1.0:
            raise ValueError(f"overrides.adaptive_clip_beta must be in (0, 1), got {self.adaptive_clip_beta}")
        if self.update_rms_cap is not None and not self.update_rms_cap > 0:
            raise ValueError(f"overrides.update_rms_cap must be > 0, got {self.update_rms_cap}")
        if not 0 <= self.rewarm_left <= self.rewarm_steps:
            raise ValueError(f"overrides.rewarm_left must be in [0, rewarm_steps={self.rewarm_steps}], got "
                             f"{self.rewarm_left}")

    def scaled_lr(self, lr: Any) -> Any:
        """The learning rate in force for a scheduler's ``lr`` (a float or a tensor): times ``lr_scale``, at most
        ``lr_cap``.

        >>> Overrides(lr_scale=0.5, lr_cap=0.1).scaled_lr(0.3), Overrides(lr_scale=0.5).scaled_lr(0.1)
        (0.1, 0.05)
        >>> Overrides(rewarm_steps=3, rewarm_left=3).scaled_lr(0.4)  # first step of a 3-step re-warm-up
        0.1
        """
        out = lr * (self.lr_scale * self.rewarm_factor)
        if self.lr_cap is None:
            return out
        return out.clamp(max=self.lr_cap) if hasattr(out, "clamp") else min(out, self.lr_cap)

    @property
    def rewarm_factor(self) -> float:
        """The re-warm-up's LR multiplier for the next step (1.0 when none is in force)."""
        return 1.0 - self.rewarm_left / (self.rewarm_steps + 1)

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in dataclasses.fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])
        self.validate()
