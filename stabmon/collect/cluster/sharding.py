"""Where each rank's gradients live, and how a norm over all of them is formed: DDP, FSDP1, FSDP2.

Under DDP (or one process) every rank holds the full, already averaged gradients: a rank's own norm *is* the
global norm and nothing is exchanged. Under FSDP1 (``FullyShardedDataParallel``) and FSDP2 (``fully_shard``,
DTensor parameters) a rank holds a shard: the global norm of a tensor is the square root of the **sum** over
ranks of its shards' squared norms. :class:`ShardedSquares` forms that sum for every parameter at once with one
``all_reduce`` of a vector holding one squared norm per parameter, so the global norm, the per-layer norms and
the count of non-finite tensors all come out exactly as an unsharded run computes them, identical on every
rank (the collective's result is the same everywhere), which is what clipping, the skip guard and every
override need.

A value is counted once over the world: a shard on the rank that holds it, a replicated tensor (a DTensor
``Replicate`` dimension, or a plain tensor in a sharded model) on one replica only, through a 0/1 weight
per parameter.

>>> import torch
>>> model = torch.nn.Linear(2, 1)
>>> layout_of(model).kind
'local'
>>> clean_name("module._fsdp_wrapped_module.blocks.0._checkpoint_wrapped_module.weight")
'blocks.0.weight'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stabmon.collect.cluster.distributed import world

_WRAPPERS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def clean_name(name: str) -> str:
    """A parameter or module name without DDP / FSDP / activation-checkpoint / ``torch.compile`` wrapper
    parts, so per-layer metric names are the same whatever the parallelism.

    >>> clean_name("blocks.0._fsdp_wrapped_module"), clean_name("module.head.weight")
    ('blocks.0', 'head.weight')
    """
    parts = [part for part in name.split(".") if part not in _WRAPPERS]
    if len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard (sharing its storage), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "placements") and hasattr(t, "device_mesh")


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (a shard of a larger tensor on this rank)."""
    return _is_dtensor(t)


def _dtensor_counted_here(p: torch.Tensor) -> bool:
    """Whether this rank counts its local part of a DTensor: on a mesh dimension it is replicated along,
    only the replica at coordinate 0 does (shards and partial sums are counted by every rank)."""
    coordinate = p.device_mesh.get_coordinate()  # type: ignore[attr-defined]
    if coordinate is None:
        return False
    return all(
        coordinate[dim] == 0
        for dim, placement in enumerate(p.placements)  # type: ignore[attr-defined]
        if placement.is_replicate()
    )


@dataclass(frozen=True)
class Layout:
    """How a model's gradients are laid out across ranks.

    ``kind`` is ``local`` (one process, or ranks training alone), ``ddp`` (replicas: every rank holds the
    same full gradients after DDP's all-reduce) — in both a rank's own gradients are complete — or ``fsdp1`` /
    ``fsdp2`` (sharded: norms need :class:`ShardedSquares`). ``counted`` holds, for a sharded
    layout, one flag per parameter: whether this rank's part of it enters the sum over ranks.
    """

    kind: str
    counted: tuple[bool, ...] = ()

    @property
    def sharded(self) -> bool:
        return self.kind in ("fsdp1", "fsdp2")


def _fsdp1_modules(model: nn.Module) -> list[Any]:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - a torch without distributed support
        return []
    return [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]


def _fsdp1_sharded(modules: Sequence[Any]) -> bool:
    """FULL_SHARD / SHARD_GRAD_OP shard over the whole world; NO_SHARD replicates; hybrid strategies (shards
    within a node, replicas across nodes) are refused with one line."""
    names: set[str] = {m.sharding_strategy.name for m in modules}
    hybrid = sorted(n for n in names if "HYBRID" in n)
    if hybrid:
        raise ValueError(
            f"model: FSDP1 sharding_strategy {hybrid[0]} is not supported by the monitor's norms "
            "(use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD, or FSDP2 fully_shard with a 2-D mesh)"
        )
    if len(names) > 1:
        raise ValueError(f"model: FSDP1 units mix sharding strategies {sorted(names)}; use one strategy")
    return names != {"NO_SHARD"}


def layout_of(model: nn.Module, params: Sequence[torch.Tensor] | None = None) -> Layout:
    """The :class:`Layout` of ``model`` (``params``: the watched parameters, default every trainable one)."""
    params = list(params) if params is not None else [p for p in model.parameters() if p.requires_grad]
    rank, size = world()
    if any(_is_dtensor(p) for p in params):
        counted = tuple(_dtensor_counted_here(p) if _is_dtensor(p) else rank == 0 for p in params)
        return Layout(kind="fsdp2", counted=counted)
    fsdp1 = _fsdp1_modules(model)
    if fsdp1 and size > 1 and _fsdp1_sharded(fsdp1):
        return Layout(kind="fsdp1", counted=tuple(True for _ in params))
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return Layout(kind="ddp")
    return Layout(kind="local")


class ShardedSquares:
    """Sums per-parameter squared norms over ranks with one ``all_reduce`` (a vector, one value per
    parameter); see the module docstring. A parameter without a gradient on this rank contributes 0.

    >>> squares = ShardedSquares((True, False))
    >>> squares(torch.tensor([4.0, 9.0])).tolist()  # one process: only the uncounted value is dropped
    [4.0, 0.0]
    """

    def __init__(self, counted: Sequence[bool]) -> None:
        self._counted = torch.tensor(list(counted), dtype=torch.bool)
        self._on: dict[torch.device, torch.Tensor] = {}

    def _mask(self, device: torch.device) -> torch.Tensor:
        if device not in self._on:
            self._on[device] = self._counted.to(device)
        return self._on[device]

    def __call__(self, squares: torch.Tensor) -> torch.Tensor:
        """``squares``: this rank's squared norm per parameter; returns the sum over ranks (same on all)."""
        out = torch.where(self._mask(squares.device), squares, torch.zeros_like(squares))
        if world()[1] > 1:
            torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM)
        return out


def embedding_counted(model: nn.Module, layout: Layout) -> tuple[bool, ...] | None:
    """:attr:`Layout.counted` of the model's ``nn.Embedding`` weights under a sharded layout, else None."""
    if not layout.sharded:
        return None
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    return layout_of(model, weights).counted
