"""The peers' automatic responses to instability, as training-loop arms for ``benchmarks/recovery.py``.

Each is a ``tiny_gpt.Response``: after the (unscaled) gradients are ready it may clip them and answers
``"step"``, ``"skip"`` or ``"stop"``. Detection is delegated to the re-implementations in
:mod:`stabmon.replay.baselines` (read from each project's source, with its defaults), so the replayed and the
live comparison use one definition of each rule; what is added here is the action each project takes:

- ``clip-1.0``: fixed L2 clipping at 1.0 (where OPT-175B ended up).
- ``zclip``: ZClip's adaptive clipping (EMA z-score, clip to ZClip's adaptive threshold on a spike).
- ``olmo-skip-step``: OLMo-core's SkipStepOptimizer: drop the update when the loss or the grad norm exceeds
  mean + 6 sigma of the last 128 steps (active after 64). A non-finite value compares False and is applied,
  as OLMo-core's multiply-by-zero lets NaN through.
- ``kill-loss-spike``: LLM Foundry's KillLossSpike with its action on (it raises): the run stops.
- ``lightning-spike``: Lightning's SpikeDetection, which raises ``TrainingSpikeException``: the run stops.

Peers measure on the host (``.item()`` each step), as they do in their own code.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from stabmon.events import Metric, StepRecord
from stabmon.replay.baselines import KillLossSpike, LightningSpikeDetection, OlmoStabilityMonitor, ZClip


def grad_norm(model: nn.Module) -> torch.Tensor:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def _scale_grads(model: nn.Module, factor: float) -> None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    torch._foreach_mul_(grads, factor)


class FixedClip:
    """Clip the global L2 grad norm to ``max_norm`` (instead of the recipe's own clip)."""

    name = "clip-1.0"
    clips = True

    def __init__(self, max_norm: float = 1.0) -> None:
        self.max_norm = max_norm

    def on_step(self, step: int, loss: torch.Tensor, model: nn.Module) -> str:
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_norm, foreach=True)
        return "step"


class ZClipResponse:
    """ZClip: clip to its adaptive threshold when the grad norm's z-score exceeds 2.5."""

    name = "zclip"
    clips = True

    def __init__(self) -> None:
        self.rule = ZClip()

    def on_step(self, step: int, loss: torch.Tensor, model: nn.Module) -> str:
        norm = float(grad_norm(model))
        self.rule.update(StepRecord(step, {Metric.GRAD_NORM: norm}))
        if self.rule.clip_to is not None and math.isfinite(norm) and norm > 0:
            _scale_grads(model, self.rule.clip_to / norm)
        return "step"


class OlmoSkipStep:
    """OLMo-core's skip-step optimizer: skip the update on a loss or grad-norm spike (6 sigma over 128)."""

    name = "olmo-skip-step"
    clips = False

    def __init__(self) -> None:
        self.rule = OlmoStabilityMonitor()

    def on_step(self, step: int, loss: torch.Tensor, model: nn.Module) -> str:
        record = StepRecord(step, {Metric.LOSS: float(loss), Metric.GRAD_NORM: float(grad_norm(model))})
        return "skip" if self.rule.update(record) else "step"


class _Stopper:
    name = ""
    clips = False
    rule: KillLossSpike | LightningSpikeDetection

    def on_step(self, step: int, loss: torch.Tensor, model: nn.Module) -> str:
        return "stop" if self.rule.update(StepRecord(step, {Metric.LOSS: float(loss)})) else "step"


class KillLossSpikeResponse(_Stopper):
    """LLM Foundry's KillLossSpike, raising: the run stops at the detected spike."""

    name = "kill-loss-spike"

    def __init__(self, total_steps: int) -> None:
        self.rule = KillLossSpike(total_steps=total_steps)


class LightningSpikeResponse(_Stopper):
    """Lightning's SpikeDetection: raises ``TrainingSpikeException``, the run stops."""

    name = "lightning-spike"

    def __init__(self, total_steps: int) -> None:
        self.rule = LightningSpikeDetection()


PEERS: dict[str, Callable[[int], object]] = {
    FixedClip.name: lambda total_steps: FixedClip(),
    ZClipResponse.name: lambda total_steps: ZClipResponse(),
    OlmoSkipStep.name: lambda total_steps: OlmoSkipStep(),
    KillLossSpikeResponse.name: KillLossSpikeResponse,
    LightningSpikeResponse.name: LightningSpikeResponse,
}
"""Peer arm name -> factory ``(total_steps) -> Response``."""
