"""Peer rules: the loss-spike checks other training stacks ship, re-implemented for side-by-side evaluation.

Each rule sees the same StepRecords as stabmon and answers, per step, "would this rule have alerted here?".
They follow their reference implementations (semantics summarised in each docstring) with those projects'
defaults; where a rule stops or raises in its home framework, here it only reports, so every later alert is
counted too. Each has ``update(record) -> bool`` and ``state_dict`` / ``load_state_dict``.

>>> from stabmon.events import StepRecord
>>> rule = LightningSpikeDetection()
>>> [rule.update(StepRecord(s, {"loss": v})) for s, v in enumerate([2.0, 2.0, 2.0, 7.0, 2.0])]
[False, False, False, True, False]
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Protocol

from stabmon.events import Metric, StepRecord


class PeerRule(Protocol):
    name: str

    def update(self, record: StepRecord) -> bool: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class _Rolling:
    """A fixed-size window with O(1) mean / population std (sliding Welford, re-summed exactly every ``size``
    updates so rounding cannot drift) and a count of values above ``cap``."""

    def __init__(self, size: int, values: Any = (), cap: float = math.inf) -> None:
        self.size, self.cap = size, cap
        self.values: deque[float] = deque(maxlen=size)
        self.mean = self.m2 = 0.0
        self.above = 0
        self._since = 0
        for v in values:
            self.append(v)

    def __len__(self) -> int:
        return len(self.values)

    def append(self, x: float) -> None:
        if len(self.values) == self.size:
            old = self.values[0]
            self.values.append(x)
            self.above += (x > self.cap) - (old > self.cap)
            old_mean = self.mean
            self.mean += (x - old) / self.size
            self.m2 += (x - old) * (x - self.mean + old - old_mean)
        else:
            self.values.append(x)
            self.above += x > self.cap
            delta = x - self.mean
            self.mean += delta / len(self.values)
            self.m2 += delta * (x - self.mean)
        self._since += 1
        if self._since >= self.size or not math.isfinite(self.mean):
            self._resum()

    def _resum(self) -> None:
        n = len(self.values)
        self.mean = math.fsum(self.values) / n
        self.m2 = math.fsum((v - self.mean) ** 2 for v in self.values)
        self._since = 0

    @property
    def std(self) -> float:
        return math.sqrt(max(self.m2, 0.0) / len(self.values)) if self.values else math.nan


class KillLossSpike:
    """LLM Foundry ``KillLossSpike`` (llmfoundry/callbacks/kill_loss_spike_callback.py).

    Keeps a rolling window of the last ``window_size`` losses (every loss is appended, outliers included);
    checks start once the window is full. A loss ``>= outlier_multiplier x`` the window mean is an outlier;
    more than ``patience`` consecutive outliers is a loss spike (a non-outlier resets the count). Separately,
    once ``step >= 2 x window_size``, half the window above ``loss_cap`` is "persistently high loss".
    Defaults: patience 4, multiplier 2, loss cap 10, window ``max(100, 5% of the run's steps)`` (the
    callback's ``fit_start`` sizing from ``max_duration``). NaN is never an outlier and poisons the mean, as
    in the original.

    >>> rule = KillLossSpike(total_steps=100)
    >>> flags = [rule.update(StepRecord(s, {"loss": 2.0 if s < 100 else 5.0})) for s in range(110)]
    >>> flags.index(True)  # the 5th consecutive outlier
    104
    """

    name = "llm_foundry"

    def __init__(
        self,
        *,
        total_steps: int = 0,
        patience: int = 4,
        outlier_multiplier: float = 2.0,
        loss_cap: float = 10.0,
        min_window: int = 100,
        window_fraction: float = 0.05,
    ) -> None:
        self.window_size = max(min_window, round(total_steps * window_fraction))
        self.patience = patience
        self.outlier_multiplier = outlier_multiplier
        self.loss_cap = loss_cap
        self.outlier_counter = 0
        self.seen = 0
        self.window = _Rolling(self.window_size, cap=loss_cap)

    def update(self, record: StepRecord) -> bool:
        loss = record.get(Metric.LOSS)
        if loss is None:
            return False
        alert = False
        if len(self.window) == self.window_size:
            mean = self.window.mean
            if loss >= mean * self.outlier_multiplier:
                self.outlier_counter += 1
                alert = self.outlier_counter > self.patience
            else:
                self.outlier_counter = 0
            if not alert:  # the callback's ``elif detect_high_losses``
                alert = self.seen >= 2 * self.window_size and self.window.above >= self.window_size / 2
        self.window.append(loss)
        self.seen += 1
        return alert

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": list(self.window.values),
            "outlier_counter": self.outlier_counter,
            "seen": self.seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window = _Rolling(self.window_size, state["window"], cap=self.loss_cap)
        self.outlier_counter = state["outlier_counter"]
        self.seen = state["seen"]


class OlmoStabilityMonitor:
    """OLMo-core ``StabilityMonitorCallback`` (olmo_core/train/callbacks/stability_monitor.py).

    For the training loss and the gradient norm separately: a value above ``mean + threshold_std x std`` of
    the previous ``window_size`` values (population std; no check while std < 1e-10) is a spike; every value
    is then appended. Defaults: window 128, 6 sigma. Checks start once ``min_history`` values are held (64
    here, the active-from point the evaluation protocol specifies; the callback version we read waits for the
    full 128).

    >>> rule = OlmoStabilityMonitor()
    >>> flags = [rule.update(StepRecord(s, {"loss": 2.0 + 0.01 * (s % 3)})) for s in range(80)]
    >>> any(flags), rule.update(StepRecord(80, {"loss": 3.0}))
    (False, True)
    """

    name = "olmo_core"

    def __init__(self, *, window_size: int = 128, threshold_std: float = 6.0, min_history: int = 64) -> None:
        self.window_size = window_size
        self.threshold_std = threshold_std
        self.min_history = min_history
        self.history = {Metric.LOSS: _Rolling(window_size), Metric.GRAD_NORM: _Rolling(window_size)}

    def _is_spike(self, value: float, history: _Rolling) -> bool:
        if len(history) < self.min_history:
            return False
        std = history.std
        return std >= 1e-10 and value > history.mean + self.threshold_std * std

    def update(self, record: StepRecord) -> bool:
        spike = False
        for metric, history in self.history.items():
            value = record.get(metric)
            if value is None:
                continue
            spike = self._is_spike(value, history) or spike
            history.append(value)
        return spike

    def state_dict(self) -> dict[str, Any]:
        return {k: list(v.values) for k, v in self.history.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = {k: _Rolling(self.window_size, v) for k, v in state.items()}


class ZClip:
    """ZClip adaptive gradient clipping (bluorion-com/ZClip ``zclip/zclip.py``), as a grad-norm spike
    detector.

    The first ``warmup_steps`` (25) norms initialise the EMA mean and variance; after that
    ``z = (g - mean) / (std + eps)`` and ``z > z_thresh`` (2.5) is a spike, which ZClip clips to
    ``mean + z_thresh x std / (z / z_thresh)`` (``adaptive_scaling``). The EMA (alpha 0.97) is then updated
    with the clipped value on a spike and the raw norm otherwise (``skip_update_on_spike=False``), the
    variance with the freshly updated mean, exactly as the reference does. Runs without a grad norm give no
    alerts.

    >>> rule = ZClip()
    >>> flags = [rule.update(StepRecord(s, {"grad_norm": 1.0 + 0.05 * (s % 2)})) for s in range(40)]
    >>> any(flags), rule.update(StepRecord(40, {"grad_norm": 5.0}))
    (False, True)
    """

    name = "zclip"

    def __init__(
        self, *, alpha: float = 0.97, z_thresh: float = 2.5, warmup_steps: int = 25, eps: float = 1e-6
    ) -> None:
        self.alpha, self.z_thresh, self.warmup_steps, self.eps = alpha, z_thresh, warmup_steps, eps
        self.buffer: list[float] = []
        self.mean: float | None = None
        self.var: float | None = None
        self.clip_to: float | None = None
        """The norm ZClip clips the last update's gradient to (None: no clipping on that step)."""

    def update(self, record: StepRecord) -> bool:
        self.clip_to = None
        g = record.get(Metric.GRAD_NORM)
        if g is None:
            return False
        if self.mean is None or self.var is None:
            self.buffer.append(g)
            if len(self.buffer) >= self.warmup_steps:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
                self.buffer = []
            return False
        std = self.var**0.5
        z = (g - self.mean) / (std + self.eps)
        spike = z > self.z_thresh
        effective = self.mean + (self.z_thresh * std) / (z / self.z_thresh) if spike else g
        self.clip_to = effective if spike else None
        self.mean = self.alpha * self.mean + (1 - self.alpha) * effective
        self.var = self.alpha * self.var + (1 - self.alpha) * (effective - self.mean) ** 2
        return bool(spike)

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": list(self.buffer), "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer, self.mean, self.var = list(state["buffer"]), state["mean"], state["var"]


class LightningSpikeDetection:
    """Lightning Fabric ``SpikeDetection`` (lightning/fabric/utilities/spike.py), mode ``min``.

    A running mean over the last ``window`` (10) non-spike losses; from batch ``warmup`` (1) on, a loss is a
    spike when it did not improve on the previous accepted loss and ``|loss - mean| >= rtol x |mean|`` (rtol
    2, atol unset), or when it is non-finite (``finite_only=True``). Spikes are not added to the statistics;
    the original raises ``TrainingSpikeException`` here, the replay only records the alert.
    """

    name = "lightning"

    def __init__(
        self, *, window: int = 10, warmup: int = 1, rtol: float | None = 2.0, atol: float | None = None
    ) -> None:
        self.window_size, self.warmup, self.rtol, self.atol = window, warmup, rtol, atol
        self.window = _Rolling(window)
        self.last_val = 0.0
        self.batch_idx = 0

    def update(self, record: StepRecord) -> bool:
        loss = record.get(Metric.LOSS)
        if loss is None:
            return False
        idx, self.batch_idx = self.batch_idx, self.batch_idx + 1
        spike = idx >= self.warmup and self._is_spike(loss)
        if not spike:
            self.window.append(loss)
            self.last_val = loss
        return spike

    def _is_spike(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return True
        if loss - self.last_val <= 0.0:
            return False
        mean = self.window.mean if len(self.window) else math.nan
        atol_ok = self.atol is None or abs(loss - mean) >= abs(self.atol)
        rtol_ok = self.rtol is None or abs(loss - mean) >= abs(self.rtol * mean)
        return atol_ok and rtol_ok

    def state_dict(self) -> dict[str, Any]:
        return {"window": list(self.window.values), "last_val": self.last_val, "batch_idx": self.batch_idx}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window = _Rolling(self.window_size, state["window"])
        self.last_val, self.batch_idx = state["last_val"], state["batch_idx"]


class MegatronSpikyLoss:
    """Megatron-LM's rerun state machine check for an unexpectedly large loss
    (``megatron/core/rerun_state_machine.py``, ``is_unexpectedly_large`` as used by
    ``--check-for-spiky-loss``): the maximum of the first ``initial_values`` (100) losses is the reference; a
    later loss at least ``threshold`` (10) times it is spiky. Megatron's default NaN/inf loss check
    (``--check-for-nan-in-loss-and-grad``) is included: a non-finite loss alerts at any step.

    >>> rule = MegatronSpikyLoss(initial_values=3)
    >>> [rule.update(StepRecord(s, {"loss": v})) for s, v in enumerate([3.0, 2.5, 2.0, 25.0, 31.0])]
    [False, False, False, False, True]
    """

    name = "megatron"

    def __init__(self, *, threshold: float = 10.0, initial_values: int = 100) -> None:
        self.threshold, self.initial_values = threshold, initial_values
        self.initial: list[float] = []
        self.reference = math.inf

    def update(self, record: StepRecord) -> bool:
        loss = record.get(Metric.LOSS)
        if loss is None:
            return False
        if not math.isfinite(loss):
            return True
        if len(self.initial) < self.initial_values:
            self.initial.append(loss)
            if len(self.initial) == self.initial_values:
                self.reference = max(self.initial)
            return False
        return loss >= self.threshold * self.reference

    def state_dict(self) -> dict[str, Any]:
        return {"initial": list(self.initial)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.initial = list(state["initial"])
        full = len(self.initial) >= self.initial_values
        self.reference = max(self.initial) if full else math.inf


PEER_RULES = (KillLossSpike, OlmoStabilityMonitor, ZClip, LightningSpikeDetection, MegatronSpikyLoss)


def peer_rules(*, total_steps: int) -> list[PeerRule]:
    """A fresh instance of every peer rule with its project's defaults, sized for a run of ``total_steps``."""
    return [
        KillLossSpike(total_steps=total_steps),
        OlmoStabilityMonitor(),
        ZClip(),
        LightningSpikeDetection(),
        MegatronSpikyLoss(),
    ]
