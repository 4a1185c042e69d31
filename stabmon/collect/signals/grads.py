"""Gradient norms from one fused foreach pass, reused for clipping.

:meth:`GradNorms.compute` runs ``torch._foreach_norm`` over every gradient once and stacks the per-tensor
norms. From that one vector it derives the global norm, the per-layer norms (a scatter-add of squared norms)
and the count of non-finite gradient tensors; :meth:`GradNorms.clip_` then scales the gradients by the clamped
coefficient with ``torch._foreach_mul_``. Nothing is read back to the host.

Under FSDP1/FSDP2 (a :class:`~stabmon.collect.cluster.sharding.ShardedSquares` is given) each rank's local shards'
squared norms are summed over ranks with one ``all_reduce`` before anything is derived, so every rank gets the
global, per-layer and non-finite values of the unsharded model, and clips its shards by the global norm.
Parameter names are taken without wrapper prefixes (:func:`~stabmon.collect.cluster.sharding.clean_name`), so layer
names do not depend on the parallelism.

A sparse gradient (``nn.Embedding(sparse=True)``) enters the fused pass as its values (:func:`dense_view`): it is
coalesced first, in place of the parameter's ``.grad`` (duplicate rows summed: the optimizer sees the same
gradient, and SparseAdam's own coalesce is then free), so the norm of its values is its true norm, and clipping
scales those values in place, i.e. the sparse gradient itself. Coalescing a sparse tensor on an accelerator reads
its number of rows back (the one sync a sparse gradient costs; torch's own clipping and SparseAdam pay it too).

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
>>> norms = GradNorms(model)
>>> norms.layer_names
['0', '1']
>>> model(torch.ones(1, 2)).sum().backward()
>>> out = norms.compute()
>>> bool(torch.isclose(out.total, torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
True
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from stabmon.collect.cluster.sharding import ShardedSquares, clean_name, local


def default_blocks(model: nn.Module) -> list[str]:
    """Names of the children of the first ModuleList in ``model`` (the transformer blocks), or ``[]``;
    without wrapper prefixes (:func:`~stabmon.collect.cluster.sharding.clean_name`)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return [clean_name(f"{name}.{child}" if name else child) for child, _ in module.named_children()]
    return []


def _names(model: nn.Module) -> list[str]:
    """Parameter names without wrapper prefixes, e.g. ``blocks.0.weight`` under DDP, FSDP1 and FSDP2 alike
    (an FSDP1 flat parameter is named after its unit: ``blocks.0._flat_param``)."""
    return [clean_name(n) for n, _ in model.named_parameters()]


def default_layer_of(model: nn.Module) -> dict[str, str]:
    """Map each parameter name to its layer: its block when it lives in one, else its owning module."""
    blocks = default_blocks(model)
    out = {}
    for pname in _names(model):
        block = next((b for b in blocks if pname.startswith(b + ".")), None)
        out[pname] = block if block is not None else (pname.rsplit(".", 1)[0] if "." in pname else pname)
    return out


def pattern_layer_of(model: nn.Module, patterns: Sequence[str], *, path: str) -> dict[str, str]:
    """Map parameter names to the prefix matched by the first matching pattern; unknown patterns raise."""
    names = _names(model)
    compiled = []
    for pat in patterns:
        try:
            compiled.append(re.compile(pat))
        except re.error as exc:
            raise ValueError(f"{path}: invalid pattern {pat!r}: {exc}") from None
    out: dict[str, str] = {}
    for rx in compiled:
        hits = {n: m.group(0) for n in names if (m := rx.match(n))}
        if not hits:
            raise ValueError(f"{path}: pattern {rx.pattern!r} matches no parameter of the model")
        for n, layer in hits.items():
            out.setdefault(n, layer)
    return out


@dataclass
class GradResult:
    """Device tensors of one step: global norm, per-layer norms and the non-finite tensor count."""

    total: torch.Tensor
    layers: torch.Tensor | None
    nonfinite: torch.Tensor
    grads: list[torch.Tensor]
    single_device: bool = True
    local_total: torch.Tensor | None = None
    """Norm of this rank's own shards before the sum over ranks (sharded layouts only)."""
    tensor_sq: torch.Tensor | None = None
    """Squared global norm of each tensor of :attr:`grads`, in their order (summed over ranks when sharded)."""


class GradNorms:
    """Per-tensor gradient norms, fused, with global and per-layer reductions; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[str] | None = None,
        *,
        path: str = "config.grads.layers",
        sharded: ShardedSquares | None = None,
    ):
        self._squares = sharded
        self._named = [(clean_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
        self._params = [p for _, p in self._named]
        if layers is None:
            layer_of = default_layer_of(model)
        elif len(layers) == 0:
            layer_of = {}
        else:
            layer_of = pattern_layer_of(model, layers, path=path)
        self.layer_names: list[str] = list(
            dict.fromkeys(layer_of[n] for n, _ in self._named if n in layer_of)
        )
        index = {name: i for i, name in enumerate(self.layer_names)}
        self._layer_idx = [index.get(layer_of.get(n, ""), -1) for n, _ in self._named]
        self._cache: dict[tuple[bool, ...], _Plan] = {}
        self._where: dict[tuple[bool, ...], torch.Tensor] = {}
        self._full: _Plan | None = None
        self.last_local_total: torch.Tensor | None = None
        """This rank's own gradient norm of the last :meth:`compute` (its shards' under sharding)."""

    @property
    def params(self) -> list[nn.Parameter]:
        return list(self._params)

    @property
    def layer_index(self) -> list[int]:
        """For each of :attr:`params`, the index of its layer in :attr:`layer_names` (-1: in no layer)."""
        return list(self._layer_idx)

    @property
    def sharded(self) -> ShardedSquares | None:
        """The sum over ranks of per-parameter squares (sharded layouts), else None."""
        return self._squares

    def _plan(self, present: tuple[bool, ...], grads: list[torch.Tensor]) -> _Plan:
        """Per grad-presence mask (cached): layer scatter indices, and whether one fused call covers all."""
        if present not in self._cache:
            self._cache[present] = self._plan_for(present, grads)
        return self._cache[present]

    def _plan_for(self, present: tuple[bool, ...], grads: list[torch.Tensor]) -> _Plan:
        pos, ids = [], []
        j = 0
        for has, idx in zip(present, self._layer_idx, strict=True):
            if has:
                if idx >= 0:
                    pos.append(j)
                    ids.append(idx)
                j += 1
        device = grads[0].device
        index = (torch.tensor(pos, device=device), torch.tensor(ids, device=device)) if pos else None
        single = len({g.device for g in grads}) == 1
        fp32 = all(g.dtype == torch.float32 for g in grads)
        return _Plan(device=device, index=index, single_device=single, fp32=fp32)

    def compute(self) -> GradResult | None:
        """Norms of the current gradients, or None when no parameter has one."""
        if self._squares is not None:
            return self._compute_sharded(self._squares)
        every = [dense_view(p) for p in self._params]
        present = tuple(g is not None for g in every)
        grads = [g for g in every if g is not None]
        if not grads:
            return None
        plan = self._plan(present, grads)
        per_tensor = _foreach_norms(grads, plan)
        sq = per_tensor.square()
        total = sq.sum().sqrt()
        self.last_local_total = total
        layers = self._layers(sq, plan)
        nonfinite = (~torch.isfinite(per_tensor)).sum()
        return GradResult(
            total=total, layers=layers, nonfinite=nonfinite, grads=grads, single_device=plan.single_device,
            tensor_sq=sq,
        )

    def _compute_sharded(self, squares: ShardedSquares) -> GradResult:
        """Every rank, every step (a collective): local shards' squared norms summed over ranks, one value per
        parameter (0 where this rank holds no gradient), then the same reductions as one process."""
        every = [None if (g := dense_view(p)) is None else local(g) for p in self._params]
        grads = [g for g in every if g is not None]
        device = grads[0].device if grads else local(self._params[0]).device
        mine = torch.zeros(len(every), device=device, dtype=torch.float32)
        if grads:
            present = tuple(g is not None for g in every)
            plan = self._plan(present, grads)
            where = self._present_index(present, device)
            mine.index_copy_(0, where, _foreach_norms(grads, plan).square())
        local_total = mine.sum().sqrt()
        self.last_local_total = local_total
        sq = squares(mine)
        if self._full is None:
            self._full = self._plan_for(tuple(True for _ in every), [sq])
        layers = self._layers(sq, self._full)
        nonfinite = (~torch.isfinite(sq)).sum()
        single = len({g.device for g in grads}) <= 1
        mine_sq = sq.index_select(0, where) if grads else sq[:0]
        return GradResult(total=sq.sum().sqrt(), layers=layers, nonfinite=nonfinite, grads=grads,
                          single_device=single, local_total=local_total, tensor_sq=mine_sq)

    def _present_index(self, present: tuple[bool, ...], device: torch.device) -> torch.Tensor:
        if present not in self._where:
            self._where[present] = torch.tensor([i for i, has in enumerate(present) if has], device=device)
        return self._where[present]

    def _layers(self, sq: torch.Tensor, plan: _Plan) -> torch.Tensor | None:
        if not self.layer_names:
            return None
        layers = torch.zeros(len(self.layer_names), device=sq.device, dtype=sq.dtype)
        if plan.index is not None:
            layers.index_add_(0, plan.index[1], sq.index_select(0, plan.index[0]))
        return layers.sqrt()

    @staticmethod
    def clip_(result: GradResult, max_norm: float, skip: torch.Tensor | None = None) -> None:
        """Scale gradients by ``min(1, max_norm / (total + 1e-6))`` (as clip_grad_norm_) without a host
        sync."""
        coef = (max_norm / (result.total + 1e-6)).clamp(max=1.0)
        if skip is not None:
            coef = torch.where(skip, torch.zeros_like(coef), coef)
        if result.single_device:
            torch._foreach_mul_(result.grads, coef)
            return
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in result.grads:
            by_device.setdefault(g.device, []).append(g)
        for dev, grads in by_device.items():
            torch._foreach_mul_(grads, coef.to(dev))


def dense_view(p: torch.Tensor) -> torch.Tensor | None:
    """``p``'s gradient as a strided tensor with the same L2 norm whose in-place scaling scales the gradient:
    the gradient itself, or a sparse gradient's values. A sparse COO gradient is coalesced first (duplicate
    entries summed, so its values' norm is its norm) and put back as ``p.grad``.

    >>> emb = torch.nn.Embedding(4, 2, sparse=True)
    >>> emb(torch.tensor([1, 1])).sum().backward()
    >>> dense_view(emb.weight).tolist(), emb.weight.grad.is_coalesced()
    ([[2.0, 2.0]], True)
    """
    g = p.grad
    if g is None or g.layout == torch.strided:
        return g
    if g.layout != torch.sparse_coo:  # compressed layouts (CSR, ...) hold each entry once
        return g.values()
    if not g.is_coalesced():
        with torch.no_grad():
            g = g.coalesce()
        p.grad = g
    return g.values()  # of a coalesced tensor: a view, scaled in place with it


def gradient_entries(p: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``p``'s gradient, ``like``) for a strided gradient; for a sparse one, (its values, the elements of
    ``like``, a tensor shaped as ``p`` such as Adam's ``exp_avg_sq``, at its entries), both shaped as the values:
    element-wise work on the pair then touches only the rows the gradient has, and writes into the gradient."""
    g = dense_view(p)
    assert g is not None, "gradient_entries: the parameter has no gradient"
    grad = p.grad
    if grad is None or grad.layout != torch.sparse_coo:
        return g, like
    return g, like[tuple(grad.indices())]  # coalesced by dense_view


@dataclass
class _Plan:
    device: torch.device
    index: tuple[torch.Tensor, torch.Tensor] | None
    single_device: bool
    fp32: bool


def _foreach_norms(grads: list[torch.Tensor], plan: _Plan) -> torch.Tensor:
    """Stacked fp32 L2 norms of each tensor, one fused kernel (per device)."""
    if plan.single_device:
        if plan.fp32:
            return torch.stack(torch._foreach_norm(grads, 2))
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
    norms = [torch._foreach_norm([g], 2, dtype=torch.float32)[0].to(plan.device) for g in grads]
    return torch.stack(norms)
