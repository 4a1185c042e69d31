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
import math
from dataclasses import dataclass, field
from typing import Any

QK_RELEASE_RISE = 8.0
"""A standing QK-clip is given back by raising its bound geometrically to 8x over the release's steps, then
turning it off: the heads are let grow back gradually, and the trouble, if it returns, is seen while they are
still bounded (:meth:`Overrides.qk_bound`)."""


@dataclass
class Overrides:
    lr_scale: float = 1.0
    """Multiplies the scheduler's learning rate for every param group."""
    lr_cap: float | None = None
    """Upper bound on the learning rate after ``lr_scale`` (None: no bound). A schedule that keeps rising past the
    edge of stability (a warm-up set far too long or too high) stays under it. It bounds param group 0's (the LR
    the monitor records and the runbook judges); every other group keeps its ratio to group 0 under it (a head
    at 10x, layer-wise LR decay), so a cap never flattens a recipe's per-group learning rates."""
    max_norm: float | None = None
    """Gradient clipping threshold in force; None keeps the monitor's configured ``clip``."""
    beta2: float | None = None
    """Adam/AdamW second-moment decay; None keeps the optimizer's own."""
    weight_decay: float | None = None
    """Decoupled weight decay; None keeps the optimizer's own."""
    skip_factor: float | None = None
    """skip_step guard: discard the update when grad norm > skip_factor x its running mean. None = off."""
    ramp_from: float | None = None
    """A release in progress (a change that resolved its incident being given back): the learning rate in
    force starts at this fraction of what the other fields give and climbs back to it geometrically over
    ``ramp_steps`` steps. None: no release in progress."""
    ramp_steps: int = 0
    """Length of the release's re-warm-up, in optimizer steps."""
    ramp_done: int = 0
    """Steps of the re-warm-up already taken."""
    cap_until: float | None = None
    """A released learning-rate cap that stays until the schedule comes down: once the LR the other fields give
    is at most this (the LR at which its incident began), the cap is lifted, re-warmed over ``cap_ramp`` steps.
    None: no such release pending."""
    cap_ramp: int = 0
    """Re-warm-up length of that pending lift, in optimizer steps."""
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
    qk_tau: float | None = None
    """qk_clip standing (Kimi K2's QK-clip): after every step, each attention head whose max logit on the sampled
    sub-batch exceeded qk_tau has its query/key rows scaled so that it is back at qk_tau. None = off."""
    qk_release_steps: int = 0
    """A standing QK-clip being given back: its bound rises geometrically from qk_tau to QK_RELEASE_RISE x qk_tau
    over this many steps, then the clip is off (0: not being given back)."""
    qk_release_done: int = 0
    """Steps of that rise already taken."""
    layer_lr: dict[str, dict[str, float]] = field(default_factory=dict)
    """scale_layer_lr: per param group (its index in ``optimizer.param_groups``, as a string), the cut in force:
    ``factor`` multiplies that group's learning rate. A released cut also has ``lift_below``: it is lifted once
    the schedule alone gives the group at most that LR, then re-warmed geometrically over ``ramp`` steps
    (``done`` counts them). See :meth:`settle_layers`."""
    rewarm_steps: int = 0
    """Length of the LR re-warm-up in force (reset_moments); 0: none."""
    rewarm_left: int = 0
    """Steps of the re-warm-up still to go: the LR is multiplied by ``1 - rewarm_left / (rewarm_steps + 1)``,
    and the optimizer hook counts it down once per step."""
    remembered: list[dict[str, Any]] = field(default_factory=list)
    """Faults met before (``rollback`` with ``lr_cap``): each ``{"start", "end", "lr_cap"}`` says that the steps
    ``start`` to ``end - 1`` broke down before and that a learning rate of at most ``lr_cap`` got the run through
    them. Whenever the run is in such a range again (after a later rollback, or a resume from a checkpoint before
    it), that cap is in force from its first step, and lifted when the run leaves it (:meth:`at_step`); outside
    the ranges nothing changes. Kept when a rollback restores an older state, and in the checkpoints."""
    range_cap: float | None = None
    """The cap of the remembered range the current step is in (None: in none); set by :meth:`at_step`."""
    screen_bar: float | None = None
    """A data screen in force (``rollback`` with ``screen``): an update whose loss exceeds this is discarded on the
    device, as the skip guard discards one (the loss must be observed before ``optimizer.step()``). None: off."""
    screen_until: int | None = None
    """The first step the screen no longer covers (:meth:`screening` turns it off there)."""

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
        if (self.screen_bar is None) != (self.screen_until is None) or (
                self.screen_bar is not None and not math.isfinite(self.screen_bar)):
            raise ValueError(f"overrides.screen_bar and screen_until go together (a finite bar and a step), got "
                             f"{self.screen_bar} until {self.screen_until}")
        if self.ramp_from is not None and not (0.0 < self.ramp_from < 1.0 and self.ramp_steps >= 1):
            raise ValueError(f"overrides.ramp_from must be in (0, 1) with ramp_steps >= 1, got {self.ramp_from} "
                             f"over {self.ramp_steps} steps")
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
        if self.qk_tau is not None and not self.qk_tau > 0:
            raise ValueError(f"overrides.qk_tau must be > 0, got {self.qk_tau}")
        if not 0 <= self.qk_release_done <= max(self.qk_release_steps, 0):
            raise ValueError(f"overrides.qk_release_done must be in [0, qk_release_steps={self.qk_release_steps}], "
                             f"got {self.qk_release_done}")
        for group, cut in self.layer_lr.items():
            if not (str(group).isdigit() and 0.0 < cut.get("factor", 0.0) <= 1.0):
                raise ValueError(f"overrides.layer_lr[{group!r}]: expected a param group index with a factor in "
                                 f"(0, 1], got {cut}")
        if not 0 <= self.rewarm_left <= self.rewarm_steps:
            raise ValueError(f"overrides.rewarm_left must be in [0, rewarm_steps={self.rewarm_steps}], got "
                             f"{self.rewarm_left}")
        for i, known in enumerate(self.remembered):
            start, end, cap = known.get("start"), known.get("end"), known.get("lr_cap")
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end
                    and isinstance(cap, (int, float)) and cap > 0):
                raise ValueError(f"overrides.remembered[{i}]: expected start < end (steps >= 0) and lr_cap > 0, "
                                 f"got {known}")

    def remember(self, *, start: int, end: int, lr_cap: float) -> None:
        """Remember that steps ``start`` to ``end - 1`` broke down and that ``lr_cap`` got the run through them
        (see ``remembered``). A range already known is updated, not repeated.

        >>> o = Overrides(); o.remember(start=300, end=320, lr_cap=1e-3)
        >>> o.at_step(299), o.range_cap, o.scaled_lr(0.1)   # before the range: nothing in force
        (None, None, 0.1)
        >>> o.at_step(300), o.scaled_lr(0.1)                # its first step: entered, capped
        ({'start': 300, 'end': 320, 'lr_cap': 0.001}, 0.001)
        >>> o.at_step(319), o.range_cap, o.at_step(320), o.range_cap   # its last step, then out of it
        (None, 0.001, None, None)
        """
        self.forget(start=start, end=end)
        self.remembered.append({"start": int(start), "end": int(end), "lr_cap": float(lr_cap)})

    def forget(self, *, start: int, end: int) -> None:
        """Drop the remembered range ``start``..``end`` (the change that remembered it was undone)."""
        self.remembered = [r for r in self.remembered if (r["start"], r["end"]) != (start, end)]
        if not self.remembered:
            self.range_cap = None

    def at_step(self, step: int) -> dict[str, Any] | None:
        """The next optimizer step is ``step``: put in force the cap of the remembered range it is in (the lowest,
        where ranges overlap), or none (host arithmetic only, once per step). Returns the range when the run has
        just entered it (to say so), else None."""
        if not self.remembered and self.range_cap is None:
            return None
        inside = [r for r in self.remembered if r["start"] <= step < r["end"]]
        entered = self.range_cap is None and bool(inside)
        self.range_cap = min((r["lr_cap"] for r in inside), default=None)
        return min(inside, key=lambda r: r["lr_cap"]) if entered else None

    def screening(self, step: int) -> float | None:
        """The loss bar of the data screen for optimizer step ``step``, or None; the screen turns itself off at
        ``screen_until``.

        >>> o = Overrides(screen_bar=2.5, screen_until=102)
        >>> o.screening(101), o.screening(102), o.screen_bar
        (2.5, None, None)
        """
        if self.screen_until is None:
            return None
        if step >= self.screen_until:
            self.screen_bar = self.screen_until = None
            return None
        return self.screen_bar

    @property
    def cap_in_force(self) -> float | None:
        """The learning-rate cap this step: ``lr_cap`` or a remembered range's, the lower of the two."""
        if self.range_cap is None:
            return self.lr_cap
        return self.range_cap if self.lr_cap is None else min(self.lr_cap, self.range_cap)

    def ramp(self, fraction: float, steps: int) -> None:
        """Start a re-warm-up: the LR in force begins at ``fraction`` of what it would be and climbs back to it
        geometrically over ``steps`` optimizer steps (:meth:`advance` counts them). A fraction of 1 or more, or
        no steps, is no ramp at all.

        >>> o = Overrides(); o.ramp(0.25, 2); o.scaled_lr(1.0)
        0.25
        >>> o.advance(); o.scaled_lr(1.0)
        0.5
        >>> o.advance(); o.scaled_lr(1.0), o.ramp_from
        (1.0, None)
        """
        if not 0.0 < fraction < 1.0 or steps < 1:
            self.ramp_from, self.ramp_steps, self.ramp_done = None, 0, 0
            return
        self.ramp_from, self.ramp_steps, self.ramp_done = float(fraction), int(steps), 0

    def advance(self, steps: int = 1) -> None:
        """``steps`` optimizer steps were taken: move a re-warm-up on (host arithmetic only); it ends at
        ``ramp_steps``."""
        if self.ramp_from is None:
            return
        self.ramp_done += steps
        if self.ramp_done >= self.ramp_steps:
            self.ramp_from, self.ramp_steps, self.ramp_done = None, 0, 0

    def release_cap(self, *, below: float, steps: int) -> None:
        """Lift ``lr_cap`` once the learning rate it bounds is at most ``below`` (the LR at which the trouble
        began; a schedule still above it would only bring the trouble back), re-warmed over ``steps`` steps;
        :meth:`settle` checks, once per optimizer step.

        >>> o = Overrides(lr_cap=0.1); o.release_cap(below=0.2, steps=2)
        >>> o.settle(0.3); o.lr_cap        # the schedule still above where the trouble began: held
        0.1
        >>> o.settle(0.15); o.lr_cap, round(o.scaled_lr(0.15), 4)   # below it: lifted, re-warmed from 0.1
        (None, 0.1)
        """
        self.cap_until, self.cap_ramp = float(below), int(steps)

    def settle(self, lr: float) -> None:
        """Before an optimizer step whose scheduler asks for ``lr`` (a host float): lift a released cap whose
        condition holds (see :meth:`release_cap`)."""
        if self.cap_until is None or self.lr_cap is None:
            return
        wanted = lr * self.lr_scale
        if wanted > self.cap_until:
            return
        fraction = self.lr_cap / wanted if wanted > 0 else 1.0
        self.lr_cap, self.cap_until = None, None
        self.ramp(fraction, self.cap_ramp)

    def settle_layers(self, lrs: list[float | None]) -> None:
        """Once per optimizer step, before it, with the schedule's learning rate of each param group as a host
        float: lift a released layer cut once its group's LR is at most ``lift_below``, and move a lifted cut's
        re-warm-up on (host arithmetic only). A lifted cut climbs from its factor back to 1 geometrically over
        ``ramp`` steps. An LR given as None is not known on the host (a tensor on an accelerator, not read between
        flushes): that group's cut is held, never lifted on a guess; a cut of a group that no longer exists goes.

        >>> o = Overrides(layer_lr={"1": {"factor": 0.1, "lift_below": 0.5, "ramp": 2, "done": 0}})
        >>> o.settle_layers([0.01, 2.0]); o.layer_factor(1)          # the schedule above 0.5: held
        0.1
        >>> o.settle_layers([0.01, 0.4]); round(o.layer_factor(1), 4)  # lifted: half-way up (geometric)
        0.3162
        >>> o.settle_layers([0.01, 0.4]); o.settle_layers([0.01, 0.4]); o.layer_lr
        {}
        >>> o = Overrides(layer_lr={"1": {"factor": 0.1, "lift_below": 0.5, "ramp": 0, "done": 0}})
        >>> o.settle_layers([0.01, None]); o.layer_factor(1)           # not known on the host: held
        0.1
        """
        for group, cut in list(self.layer_lr.items()):
            below = cut.get("lift_below")
            if below is None:
                continue
            i = int(group)
            if not cut.get("done") and i < len(lrs):
                lr = lrs[i]
                if lr is None or lr > below:
                    continue  # not lifted yet: the schedule still gives the group more than the cut allowed
            done = int(cut.get("done", 0)) + 1
            if done > int(cut.get("ramp", 0)):
                del self.layer_lr[group]
            else:
                cut["done"] = done

    def layer_factor(self, group: int) -> float:
        """The layer cut's multiplier of param group ``group``'s learning rate this step (1.0: none)."""
        cut = self.layer_lr.get(str(group))
        if cut is None:
            return 1.0
        factor = cut["factor"]
        done = int(cut.get("done", 0))
        if done:  # lifted, re-warming: factor ** (1 - done / ramp), reaching 1 after ramp steps
            ramp = max(int(cut.get("ramp", 0)), 1)
            return factor ** (1.0 - done / ramp)
        return factor

    @property
    def lr_changed(self) -> bool:
        """Whether the learning rate in force differs from the scheduler's."""
        return (self.lr_scale != 1.0 or self.lr_cap is not None or self.ramp_from is not None or self.rewarm_left > 0
                or bool(self.layer_lr) or self.range_cap is not None)

    def qk_bound(self) -> float | None:
        """The standing QK-clip's bound in force (None: off), and one step of its release counted.

        >>> o = Overrides(qk_tau=50.0, qk_release_steps=2); o.qk_bound(), round(o.qk_bound(), 2), o.qk_bound(), o.qk_tau
        (50.0, 141.42, None, None)
        """
        tau = self.qk_tau
        if tau is None or not self.qk_release_steps:
            return tau
        done, steps = self.qk_release_done, self.qk_release_steps
        if done >= steps:
            self.qk_tau, self.qk_release_steps, self.qk_release_done = None, 0, 0
            return None
        self.qk_release_done = done + 1
        return tau * QK_RELEASE_RISE ** (done / steps)

    def scaled_lr(self, lr: Any, *, group: int = 0, ref: Any = None) -> Any:
        """The learning rate in force for param group ``group`` whose schedule gives ``lr`` (a float or a tensor):
        times ``lr_scale`` and the group's layer cut, at most ``lr_cap``. ``ref`` is group 0's scheduled LR: a
        group whose LR differs from it is capped at ``lr_cap`` times its ratio to it (None: ``lr_cap`` itself).

        >>> Overrides(lr_scale=0.5, lr_cap=0.1).scaled_lr(0.3), Overrides(lr_scale=0.5).scaled_lr(0.1)
        (0.1, 0.05)
        >>> Overrides(rewarm_steps=3, rewarm_left=3).scaled_lr(0.4)  # first step of a 3-step re-warm-up
        0.1
        >>> Overrides(lr_cap=0.1).scaled_lr(2.0, group=1, ref=0.5)   # a head at 4x keeps its 4x under the cap
        0.4

        A tensor ``lr`` gives a tensor on its device, computed there (nothing is read back); its cap keeps the
        ratio to a tensor or float ``ref`` the same way.

        >>> import torch
        >>> Overrides(lr_cap=0.1).scaled_lr(torch.tensor(2.0), group=1, ref=torch.tensor(0.5))
        tensor(0.4000)
        """
        out = lr * (self.lr_scale * self.rewarm_factor)
        if self.layer_lr:
            out = out * self.layer_factor(group)
        cap = self.cap_in_force
        if cap is not None and hasattr(out, "clamp"):
            out = out.clamp(max=self._tensor_cap(lr, ref, cap))
        elif cap is not None:
            out = min(out, self._cap_for(lr, ref, cap))
        if self.ramp_from is not None:
            out = out * self.ramp_from ** (1.0 - self.ramp_done / self.ramp_steps)
        return out

    @staticmethod
    def _cap_for(lr: float, ref: Any, cap: float) -> float:
        """The cap ``cap`` for a group whose schedule gives ``lr`` while group 0's gives ``ref``: times their
        ratio."""
        if isinstance(ref, (int, float)) and ref > 0 and lr != ref:
            return cap * lr / ref
        return cap

    @staticmethod
    def _tensor_cap(lr: Any, ref: Any, cap: float) -> Any:
        """:meth:`_cap_for` of a tensor ``lr`` (``ref`` a tensor or a float): the ratio is a tensor on ``lr``'s
        device (1 where ``ref`` is 0), never read back."""
        if ref is None or ref is lr:
            return cap
        return (lr / ref).nan_to_num(nan=1.0, posinf=1.0, neginf=1.0) * cap

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
        self.layer_lr = {str(k): dict(v) for k, v in self.layer_lr.items()}  # our own copy, keys as saved
        self.validate()
