"""The re-run of ``diagnose``: train recorded steps again from a checkpoint and compare each with the record.

From the checkpoint, every step up to the incident's first step is trained again on its own batch with its
own RNG state and the clip, learning rate, beta2 and weight decay recorded for it (other param groups keep
their ratio to group 0's learning rate); a step the skip guard discarded is discarded again. Each step's
values are compared with what was recorded: a difference beyond ``rtol`` (relative; NaN equals only NaN, an
inf only the same inf) means the first execution computed something the same inputs do not.

With a GradScaler the scaler's state is the checkpoint's too, and the step runs as the loop ran it:
``scale(loss).backward()``, ``unscale_``, then ``scaler.step`` (which skips an overflow) and
``scaler.update``. The overflow flag and the loss scale are compared as well, so an overflow that happens
in both executions reproduces, and one that happens in one execution only does not.

Under torch.distributed every rank runs every step (no early stop, so every rank enters the model's
collectives the same number of times); a rank's own loss is compared with the loss *that rank* recorded
(``own``), the values reduced across ranks (the grad norm, the overflow flag, the scale) with the record.

>>> _close(1.0, 1.0 + 1e-6, 1e-4), _close(float("nan"), float("nan"), 1e-4), _close(1.0, float("inf"), 1e-4)
(True, True, False)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from stabmon.collect.batches import BatchEntry, BatchLog
from stabmon.collect.signals.grads import GradNorms
from stabmon.diagnose import verdict as dx
from stabmon.events import Metric, StepRecord

LossFn = Callable[[nn.Module, Any], torch.Tensor]

REDUCED = (Metric.GRAD_NORM, Metric.OVERFLOW, Metric.LOSS_SCALE)
"""Compared with the record (under torch.distributed: the same on every rank)."""


def seed(entry: BatchEntry) -> None:
    """The RNG state the step started with."""
    torch.set_rng_state(entry.rng)
    if entry.cuda_rng is not None:
        torch.cuda.set_rng_state_all(list(entry.cuda_rng))


def rerun_steps(
    *, model: nn.Module, optimizer: torch.optim.Optimizer, grads: GradNorms, loss_fn: LossFn, batches: BatchLog,
    recorded: Mapping[int, StepRecord], own: Mapping[int, Mapping[str, float]] | None, scaler: Any,
    start: int, stop: int, rtol: float, first_mismatch: bool = False,
) -> dict[str, Any]:
    """Steps ``start..stop`` trained again (the last one not updated) from the state loaded now; each step's
    values compared with the record. ``own``: this rank's own recorded loss per step (None: one process,
    the record's). The batches and records of every step must be there (the caller checked).
    ``first_mismatch``: stop at the first step that does not reproduce (``to_step`` is then that step); only
    where no other rank waits on this one's steps (a backward under DDP is a collective)."""
    ratios = _lr_ratios(optimizer)
    steps: list[dict[str, Any]] = []
    first: dict[str, Any] | None = None
    for s in range(start, stop + 1):
        entry, record = batches.get(s), recorded[s]
        assert entry is not None
        optimizer.zero_grad(set_to_none=True)
        seed(entry)
        loss = loss_fn(model, entry.batch)
        now, result = (_scaled(loss, optimizer, grads, scaler) if scaler is not None
                       else _plain(loss, grads))
        expected = _expected(s, record, own)
        steps.append({"step": s, "recorded": {k: dx.plain(v) for k, v, _ in expected},
                      "rerun": {k: dx.plain(v) for k, v in now.items()}})
        if first is None:
            first = _mismatch(s, expected, now, rtol)
        if first is not None and first_mismatch:
            stop = s
            break
        if s < stop:
            _update(optimizer, scaler, result, record, ratios, overflow=bool(now.get(Metric.OVERFLOW)))
    out: dict[str, Any] = {"from_step": start, "to_step": stop, "rtol": rtol, "reproduced": first is None,
                           "steps": steps}
    if first is not None:
        out["mismatch"] = first
    return out


def _plain(loss: torch.Tensor, grads: GradNorms) -> tuple[dict[str, float], Any]:
    loss.backward()
    result = grads.compute()
    now = {Metric.LOSS: float(loss.detach())}
    if result is not None:
        now[Metric.GRAD_NORM] = float(result.total)
    return now, result


def _scaled(loss: torch.Tensor, optimizer: torch.optim.Optimizer, grads: GradNorms,
            scaler: Any) -> tuple[dict[str, float], Any]:
    """The loop's GradScaler step up to the update: scaled backward, unscale, overflow check, norms."""
    now = {Metric.LOSS: float(loss.detach()), Metric.LOSS_SCALE: float(scaler.get_scale())}
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    found = _found_inf(scaler, optimizer)
    now[Metric.OVERFLOW] = 1.0 if found else 0.0
    result = None
    if not found:
        result = grads.compute()
        if result is not None:
            now[Metric.GRAD_NORM] = float(result.total)
    return now, result


def _found_inf(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Did ``unscale_`` find an inf/NaN gradient (on any device)?"""
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
    return any(float(v) > 0 for v in state.get("found_inf_per_device", {}).values())


def _expected(step: int, record: StepRecord, own: Mapping[int, Mapping[str, float]] | None
              ) -> list[tuple[str, float | None, bool]]:
    """(metric, recorded value, whether the value is this rank's own) in the order compared: own first."""
    loss = record.get(Metric.LOSS)
    if own is not None and loss is not None:
        loss = own[step][Metric.LOSS]
    return [(Metric.LOSS, loss, True), *((m, record.get(m), own is None) for m in REDUCED)]


def _mismatch(step: int, expected: list[tuple[str, float | None, bool]], now: Mapping[str, float],
              rtol: float) -> dict[str, Any] | None:
    for name, was, own in expected:
        value = now.get(name)
        if was is not None and value is not None and not _close(was, value, rtol):
            return {"step": step, "metric": name, "recorded": dx.plain(was), "rerun": dx.plain(value), "own": own}
    return None


def _close(a: float, b: float, rtol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)


def _lr_ratios(optimizer: torch.optim.Optimizer) -> list[float]:
    """Each param group's learning rate relative to group 0's (the one recorded), as the checkpoint has them."""
    lrs = [float(g.get("lr", 0.0)) for g in optimizer.param_groups]
    return [lr / lrs[0] if lrs[0] else 1.0 for lr in lrs]


def _update(optimizer: torch.optim.Optimizer, scaler: Any, result: Any, record: StepRecord, ratios: list[float],
            *, overflow: bool) -> None:
    """The recorded step's update: its clip, learning rate (group 0's; other groups keep their ratio to it),
    beta2 and weight decay; nothing when the skip guard discarded the step or the scaler found an overflow
    (the scaler still updates its scale, as in the loop)."""
    if result is not None and not overflow and not record.get(Metric.SKIPPED):
        _hparams(optimizer, result, record, ratios)
        if scaler is not None:
            scaler.step(optimizer)
        else:
            optimizer.step()
    if scaler is not None:
        scaler.update()


def _hparams(optimizer: torch.optim.Optimizer, result: Any, record: StepRecord, ratios: list[float]) -> None:
    clip = record.get(Metric.CLIP)
    if clip is not None and math.isfinite(clip):
        GradNorms.clip_(result, clip)
    lr = record.get(Metric.LR)
    for group, ratio in zip(optimizer.param_groups, ratios, strict=True):
        if lr is not None and "lr" in group:
            group["lr"] = lr * ratio if ratio != 1.0 else lr
        if record.get(Metric.BETA2) is not None and "betas" in group:
            group["betas"] = (group["betas"][0], record.get(Metric.BETA2))
        if record.get(Metric.WEIGHT_DECAY) is not None and "weight_decay" in group:
            group["weight_decay"] = record.get(Metric.WEIGHT_DECAY)
