"""Per-rank signals, gathered (not averaged) at each flush, summarised into ``fleet/*`` metrics.

A mean across ranks hides the one rank that differs: BLOOM's fail-slow GPU cost every step 5 % and silent data
corruption makes one replica drift away from the others. At each flush :class:`RankGather` takes a few values
per step from every rank with one ``all_gather`` of a small block (steps x fields) and turns them into plain
metrics of the StepRecord, so the detectors (:mod:`stabmon.detect.fleet`), the store and replay see them like
any other metric:

=========================  ============================================================================
``fleet/step_time``         median over ranks of the step's wall time (the fleet-wide step time)
``fleet/straggler_ratio``   slowest rank's time / median time, on the rank's *busy* time (data + forward,
                            which holds no collective under DDP) or, where larger, its step time
``fleet/straggler_rank``    that rank
``fleet/divergence``        largest relative distance of a rank's value from the median, over the values
                            that must agree across replicas (DDP: parameter checksum, gradient norm)
``fleet/divergent_rank``    that rank
``fleet/nonfinite_ranks``   ranks whose loss or local gradient norm is NaN/inf
=========================  ============================================================================

The gathered block also gives this rank's own loss and local gradient norm of each step, which
:class:`RankGather` keeps for the last ``keep`` steps (``own``): a ``diagnose`` re-run compares each rank with
what that rank computed, not with the mean over ranks.

>>> per_rank = [[[1.0, 0.5, 2.0, 3.0, 7.0, 0.0]], [[1.2, 0.6, 2.0, 3.0, 7.0, 0.0]]]  # 2 ranks, 1 step
>>> out = summarise(per_rank, replicated=True)[0]
>>> out["fleet/straggler_rank"], round(out["fleet/straggler_ratio"], 3), out["fleet/divergence"]
(1.0, 1.091, 0.0)
"""

from __future__ import annotations

import math
import statistics
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from stabmon.collect.cluster.distributed import collective, world
from stabmon.collect.signals.buffer import StepBuffer
from stabmon.events import Metric

FIELDS = (Metric.STEP_TIME, Metric.BUSY_TIME, Metric.LOSS, Metric.GRAD_NORM_LOCAL, Metric.PARAM_CHECKSUM)
"""What each rank contributes per step (NaN where it did not measure it)."""
_AGREE = (Metric.GRAD_NORM_LOCAL, Metric.PARAM_CHECKSUM)  # equal on every replica under DDP
_TIMES = (Metric.BUSY_TIME, Metric.STEP_TIME)
_CHECKED = [FIELDS.index(Metric.LOSS), FIELDS.index(Metric.GRAD_NORM_LOCAL)]  # must be finite where measured


class RankGather:
    """Collects :data:`FIELDS` from every rank at a flush (a collective every rank calls).

    ``replicated``: ranks hold the same parameters and gradients (DDP), so :data:`_AGREE` values must match.
    ``keep``: how many recent steps' own values (:attr:`own`) to keep.
    """

    def __init__(self, *, replicated: bool, keep: int = 256) -> None:
        self.replicated = replicated
        self.keep = keep
        self.own: OrderedDict[int, dict[str, float]] = OrderedDict()
        """This rank's own ``loss`` and ``grad_norm_local`` per step (host floats; NaN where not measured),
        for the last ``keep`` steps; a step trained again after a rollback holds its newest values."""

    def gather(
        self, flat: torch.Tensor, names: Sequence[Sequence[str]], host: Sequence[Mapping[str, float]],
        steps: Sequence[int] = (),
    ) -> list[dict[str, float]]:
        """``flat``: this rank's device values of the flushed steps, named by ``names`` (one list per step);
        ``host``: each step's host values; ``steps``: their step numbers (to keep :attr:`own`). Returns the
        ``fleet/*`` metrics of each step."""
        block = _block(flat, names, host)
        rank, size = world()
        if size > 1:
            parts = [torch.empty_like(block) for _ in range(size)]
            collective("the flush's gather of every rank's values", lambda: torch.distributed.all_gather(parts, block))
            block = torch.stack(parts)
        else:
            block = block.unsqueeze(0)
        per_rank = block.tolist()
        self._keep_own(steps, per_rank[rank])
        return summarise(per_rank, replicated=self.replicated)

    def _keep_own(self, steps: Sequence[int], rows: Sequence[Sequence[float]]) -> None:
        for step, row in zip(steps, rows, strict=False):
            self.own.pop(step, None)
            self.own[step] = {f: row[FIELDS.index(f)] for f in (Metric.LOSS, Metric.GRAD_NORM_LOCAL)}
        while len(self.own) > self.keep:
            self.own.popitem(last=False)


def _block(
    flat: torch.Tensor, names: Sequence[Sequence[str]], host: Sequence[Mapping[str, float]]
) -> torch.Tensor:
    """(steps, fields) on ``flat``'s device: device values picked from ``flat``, host values filled in."""
    picks, fill = [], []
    offset = len(flat)  # index of the NaN appended below
    start = 0
    for step_names, step_host in zip(names, host, strict=True):
        where = {name: start + i for i, name in enumerate(step_names)}
        for f in FIELDS:
            picks.append(where.get(f, offset))
            fill.append(step_host.get(f, math.nan))
        start += len(step_names)
    padded = torch.cat([flat.to(torch.float32), flat.new_full((1,), math.nan, dtype=torch.float32)])
    index = torch.tensor(picks, device=flat.device, dtype=torch.long)
    picked = padded.index_select(0, index)
    hosted = torch.tensor(fill, dtype=torch.float32).to(flat.device)
    values = torch.where(torch.isnan(hosted), picked, hosted).reshape(len(names), len(FIELDS))
    measured = (index < offset).reshape(len(names), len(FIELDS))[:, _CHECKED]
    bad = (measured & ~torch.isfinite(values[:, _CHECKED])).any(dim=1, keepdim=True)
    return torch.cat([values, bad.to(torch.float32)], dim=1)


def summarise(per_rank: Sequence[Sequence[Sequence[float]]], *, replicated: bool) -> list[dict[str, float]]:
    """``per_rank[rank][step][field]`` (:data:`FIELDS`, then 1.0 where the rank's loss or local gradient norm
    was non-finite) -> the ``fleet/*`` metrics of each step (see the module docstring)."""
    n_steps = len(per_rank[0]) if per_rank else 0
    return [_step_summary([r[s] for r in per_rank], replicated) for s in range(n_steps)]


def _step_summary(rows: Sequence[Sequence[float]], replicated: bool) -> dict[str, float]:
    col = {f: [row[i] for row in rows] for i, f in enumerate(FIELDS)}
    out: dict[str, float] = {}
    times = _finite(col[Metric.STEP_TIME])
    if times:
        out[Metric.FLEET_STEP_TIME] = statistics.median(times)
    worst = max((_outlier(col[f], slow=True) for f in _TIMES), default=None, key=lambda o: o[1] if o else 0)
    if worst is not None:
        out[Metric.STRAGGLER_RANK], out[Metric.STRAGGLER_RATIO] = float(worst[0]), worst[1]
    if replicated and len(rows) > 1:
        spread = max((_outlier(col[f], slow=False) for f in _AGREE), default=None,
                     key=lambda o: o[1] if o else -1.0)
        if spread is not None:
            out[Metric.DIVERGENT_RANK], out[Metric.DIVERGENCE] = float(spread[0]), spread[1]
    out[Metric.NONFINITE_RANKS] = float(sum(row[len(FIELDS)] > 0 for row in rows))
    return out


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _outlier(values: Sequence[float], *, slow: bool) -> tuple[int, float] | None:
    """(rank, score) of the rank farthest from the median: ``value / median`` for times (``slow``), else
    ``|value - median| / max(|median|, tiny)``. None without two finite values."""
    finite = [(r, v) for r, v in enumerate(values) if math.isfinite(v)]
    if len(finite) < 2:
        return None
    median = statistics.median(v for _, v in finite)
    if slow:
        if median <= 0:
            return None
        rank, value = max(finite, key=lambda rv: rv[1])
        return rank, value / median
    rank, value = max(finite, key=lambda rv: abs(rv[1] - median))
    return rank, abs(value - median) / max(abs(median), 1e-30)


def param_checksum(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """One device scalar that changes when any element of any parameter changes (position-weighted sums and
    norms, fp32); equal on replicas that hold equal parameters. No host sync."""
    tensors = [p.detach() for p in params]
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    sums = torch.stack([t.sum(dtype=torch.float32) for t in tensors])
    weights = torch.arange(1, len(tensors) + 1, device=norms.device, dtype=torch.float32)
    return (weights * (norms + sums)).sum()


class RankProbe:
    """This rank's contributions to :class:`RankGather`, queued with the step's other values: busy time (a
    forward hook on the model stamps the end of the step's last forward), the local gradient norm, and, on
    the step before each flush under DDP, a parameter checksum (one pass over the parameters per flush).
    Nothing is read back to the host.
    """

    def __init__(self, model: nn.Module, params: Sequence[torch.Tensor], *, replicated: bool) -> None:
        self.params = list(params)
        self.replicated = replicated
        self._forward_end: float | None = None
        self._handle = model.register_forward_hook(self._forward_done)

    def _forward_done(self, module: nn.Module, args: Any, output: Any) -> None:
        self._forward_end = time.perf_counter()

    def record(self, buffer: StepBuffer, *, started: float | None, local_norm: torch.Tensor | None,
               before_flush: bool) -> None:
        """Queue this step's values (called as the step ends)."""
        end, self._forward_end = self._forward_end, None
        if end is not None and started is not None and end >= started:
            buffer.add_host(Metric.BUSY_TIME, end - started)
        if local_norm is not None:
            buffer.add([Metric.GRAD_NORM_LOCAL], local_norm.reshape(1))
        if before_flush and self.replicated and self.params:
            buffer.add([Metric.PARAM_CHECKSUM], param_checksum(self.params))

    def remove(self) -> None:
        self._handle.remove()
