"""The two experiments of ``diagnose`` on the live model: replay the incident's batches at a checkpoint, and
re-run the steps from that checkpoint to the incident (the verdict logic is :mod:`stabmon.diagnose`).

Everything happens inside one flush, on the model and optimizer themselves, with the monitor's hooks paused:
their state is copied first (one copy of parameters and optimizer state, on their device) and restored after,
exactly, with the RNG state, whatever happens; a failure becomes an ``inconclusive`` verdict with its reason.
Work: ``2 x max_batches`` forward+backward passes (no update) for the replay, and at most the checkpoint
interval of training steps for the re-run. Nothing runs unless a runbook rung asks for ``diagnose``.

The loss of a batch is computed by ``loss_fn(model, batch)``; the default, :func:`call_model`, calls
``model(*batch)`` (a tuple or list), ``model(**batch)`` (a mapping) or ``model(batch)`` and takes the
result, or its ``loss`` (a HF ``ModelOutput``).

>>> import torch
>>> model = torch.nn.Linear(2, 1)
>>> float(call_model(lambda x: (x ** 2).sum(), torch.ones(3)))
3.0
"""

from __future__ import annotations

import contextlib
import copy
import math
import socket
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stabmon import diagnose as dx
from stabmon.collect.batches import BatchEntry, BatchLog
from stabmon.collect.grads import GradNorms
from stabmon.events import Metric, StepRecord

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def call_model(model: Any, batch: Any) -> torch.Tensor:
    """The default ``loss_fn``: the model's output for the batch is its loss (see the module docstring)."""
    if isinstance(batch, (tuple, list)):
        out = model(*batch)
    elif isinstance(batch, Mapping):
        out = model(**batch)
    else:
        out = model(batch)
    loss = out["loss"] if isinstance(out, Mapping) else getattr(out, "loss", out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError("diagnose: the model's output is not a scalar loss; pass Monitor(loss_fn=...)")
    return loss


@dataclass
class Bench:
    """What the experiments work with: the monitor's collaborators, passed in (nothing calls back into it)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    grads: GradNorms
    loss_fn: LossFn
    batches: BatchLog
    records: Iterable[StepRecord]
    checkpoints: Any
    check: Callable[[dict[str, Any]], str | None]
    paused: Callable[[], contextlib.AbstractContextManager[Any]]
    scaled: bool = False
    world_size: int = 1
    rank: int = 0


def run(bench: Bench, *, onset_step: int, step: int, metric: str, max_batches: int, rtol: float,
        recur: float) -> dict[str, Any]:
    """Both experiments and the verdict, as plain values (the ``after`` of the intervention's record)."""
    t0 = time.perf_counter()
    out: dict[str, Any] = {"rank": bench.rank, "host": socket.gethostname(), "onset_step": onset_step,
                           "step": step, "metric": metric}
    try:
        out.update(_experiments(bench, onset_step, step, metric, max_batches, rtol, recur))
    except _Missing as exc:
        out.update(verdict=dx.INCONCLUSIVE, summary=str(exc))
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


class _Missing(RuntimeError):
    """The evidence an experiment needs is not there (the verdict is then inconclusive)."""


def _experiments(bench: Bench, onset: int, step: int, metric: str, k: int, rtol: float,
                 recur: float) -> dict[str, Any]:
    if bench.world_size > 1:
        raise _Missing("diagnose runs in one process only (under torch.distributed the ranks would have to "
                       "re-run together)")
    recorded = {r.step: r for r in bench.records}  # a step trained again after a rollback: the newest wins
    signal = metric if metric in (Metric.LOSS, Metric.GRAD_NORM) else Metric.LOSS
    incident, reference, baseline = _choose(bench, recorded, signal, onset, step, k)
    entries = {s: _entry(bench.batches, s) for s in incident + reference}
    if bench.checkpoints is None:
        raise _Missing("diagnose needs checkpoints: create the Monitor with checkpoint_dir=...")
    try:
        info, state = bench.checkpoints.last_known_good(before_step=min(incident), check=bench.check)
    except Exception as exc:  # noqa: BLE001 - no usable checkpoint: say so
        raise _Missing(f"no valid checkpoint at or before step {min(incident)}: {exc}") from None
    with bench.paused(), _restored(bench):
        _load(bench, state)
        pick = 0 if signal == Metric.LOSS else 1
        measured = {s: _measure(bench, entries[s])[pick] for s in incident + reference}
        rerun = _rerun(bench, info.step, min(incident), recorded, rtol)
    recorded_excess = _median([_value(recorded.get(s), signal) for s in incident]) - _median(baseline)
    replay = dx.replay_recurs(incident=[measured[s] for s in incident], reference=[measured[s] for s in reference],
                              recorded_excess=recorded_excess, recur=recur)
    replay["checkpoint_step"] = info.step
    verdict, summary = dx.verdict_of(rerun, replay)
    batches = [{**entries[s].describe(), "role": "incident" if s in incident else "reference",
                "recorded": dx.plain(_value(recorded.get(s), signal)), "at_checkpoint": dx.plain(measured[s])}
               for s in sorted(entries)]
    return {"verdict": verdict, "summary": summary, "signal": signal, "checkpoint_step": info.step,
            "checkpoint_path": str(info.path), "incident_steps": incident, "reference_steps": reference,
            "replay": replay, "rerun": rerun, "batches": batches}


def _choose(bench: Bench, recorded: dict[int, StepRecord], signal: str, onset: int, step: int,
            k: int) -> tuple[list[int], list[int], list[float]]:
    """(incident steps, reference steps, the recorded baseline before the onset)."""
    window = [(s, v) for s in range(onset, step + 1) if (v := _value(recorded.get(s), signal)) is not None]
    baseline = [v for s in range(onset - 4 * k, onset) if (v := _value(recorded.get(s), signal)) is not None]
    incident = dx.incident_steps(window, baseline=baseline, limit=k)
    reference = dx.reference_steps(list(bench.batches.entries), incident, k)
    if not incident or not reference:
        raise _Missing(f"no {signal} recorded for the incident (steps {onset}-{step}) or no batches around it")
    return incident, reference, baseline


def _value(record: StepRecord | None, name: str) -> float | None:
    return None if record is None else record.get(name)


def _median(values: Sequence[float | None]) -> float:
    finite = sorted(v for v in values if v is not None and math.isfinite(v))
    return statistics.median(finite) if finite else math.nan


def _entry(batches: BatchLog, step: int) -> BatchEntry:
    entry = batches.get(step)
    if entry is None:
        raise _Missing(f"the batch of step {step} is no longer in the batch log (capacity {batches.capacity})")
    return entry


@contextlib.contextmanager
def _restored(bench: Bench) -> Iterator[None]:
    """Model, optimizer, gradients and RNG exactly as they were, afterwards."""
    model_state = copy.deepcopy(bench.model.state_dict())
    opt_state = copy.deepcopy(bench.optimizer.state_dict())
    grads = [None if p.grad is None else p.grad.detach().clone() for p in bench.grads.params]
    rng = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        bench.model.load_state_dict(model_state)
        bench.optimizer.load_state_dict(opt_state)
        for p, g in zip(bench.grads.params, grads, strict=True):
            p.grad = g
        torch.set_rng_state(rng)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _load(bench: Bench, state: dict[str, Any]) -> None:
    bench.model.load_state_dict(state["model"])
    bench.optimizer.load_state_dict(state["optimizer"])


def _seed(entry: BatchEntry) -> None:
    torch.set_rng_state(entry.rng)
    if entry.cuda_rng is not None:
        torch.cuda.set_rng_state_all(list(entry.cuda_rng))


def _forward_backward(bench: Bench, entry: BatchEntry) -> tuple[torch.Tensor, Any]:
    bench.optimizer.zero_grad(set_to_none=True)
    _seed(entry)
    loss = bench.loss_fn(bench.model, entry.batch)
    loss.backward()
    return loss.detach(), bench.grads.compute()


def _measure(bench: Bench, entry: BatchEntry) -> tuple[float, float]:
    """(loss, grad norm) of one batch at the state loaded, without an update."""
    loss, result = _forward_backward(bench, entry)
    norm = float(result.total) if result is not None else math.nan
    bench.optimizer.zero_grad(set_to_none=True)
    return float(loss), norm


def _rerun(bench: Bench, start: int, stop: int, recorded: dict[int, StepRecord], rtol: float) -> dict[str, Any]:
    """Train steps ``start..stop`` again from the loaded checkpoint and compare each with the record."""
    out: dict[str, Any] = {"from_step": start, "to_step": stop, "rtol": rtol, "reproduced": None}
    if bench.scaled:
        out["skipped"] = "a GradScaler run is not re-run (its skipped steps and scale are not replayed)"
        return out
    ratios = _lr_ratios(bench.optimizer)
    for s in range(start, stop + 1):
        entry, record = bench.batches.get(s), recorded.get(s)
        if entry is None or record is None:
            out["skipped"] = f"step {s} is no longer in the batch log or the records"
            return out
        loss, result = _forward_backward(bench, entry)
        now = {Metric.LOSS: float(loss), Metric.GRAD_NORM: float(result.total) if result is not None else None}
        for name, value in now.items():
            was = record.get(name)
            if was is not None and value is not None and not _close(was, value, rtol):
                out.update(reproduced=False, mismatch={"step": s, "metric": name, "recorded": dx.plain(was),
                                                       "rerun": dx.plain(value)})
                return out
        if s < stop and result is not None:
            _update(bench, result, record, ratios)
    out["reproduced"] = True
    return out


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


def _update(bench: Bench, result: Any, record: StepRecord, ratios: list[float]) -> None:
    """The recorded step's update: its clip, learning rate (group 0's; other groups keep their ratio to it),
    beta2 and weight decay; nothing when the step was skipped."""
    if record.get(Metric.SKIPPED):
        return
    clip = record.get(Metric.CLIP)
    if clip is not None and math.isfinite(clip):
        GradNorms.clip_(result, clip)
    lr = record.get(Metric.LR)
    for group, ratio in zip(bench.optimizer.param_groups, ratios, strict=True):
        if lr is not None and "lr" in group:
            group["lr"] = lr * ratio if ratio != 1.0 else lr
        if record.get(Metric.BETA2) is not None and "betas" in group:
            group["betas"] = (group["betas"][0], record.get(Metric.BETA2))
        if record.get(Metric.WEIGHT_DECAY) is not None and "weight_decay" in group:
            group["weight_decay"] = record.get(Metric.WEIGHT_DECAY)
    bench.optimizer.step()


def diagnose(monitor: Any, grads: GradNorms, hooks: Any, *, loss_fn: LossFn | None, **params: Any) -> dict[str, Any]:
    """``Monitor.diagnose``: the experiments on the monitor's model, optimizer, batch log, records and
    checkpoints, with its optimizer ``hooks`` removed meanwhile."""
    if monitor.batches is None:
        return {"verdict": dx.INCONCLUSIVE, "summary": "no batch log: the runbook has no diagnose rung"}

    @contextlib.contextmanager
    def paused() -> Iterator[None]:
        hooks.remove()
        try:
            yield
        finally:
            hooks.install()

    scaler = monitor.scaler
    bench = Bench(model=monitor.model, optimizer=monitor.optimizer, grads=grads, loss_fn=loss_fn or call_model,
                  batches=monitor.batches, records=monitor.records, checkpoints=monitor.checkpoints,
                  check=monitor.target.state.mismatch, paused=paused,
                  scaled=scaler is not None and scaler.is_enabled(), world_size=monitor.world_size,
                  rank=monitor.rank)
    return run(bench, **params)
