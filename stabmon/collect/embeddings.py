"""Embedding drift and update ratio for every ``nn.Embedding``, on sampled steps.

Keeps ``W0`` (the weights when monitoring began) and one scratch copy per embedding on the device. On a
sampled step :meth:`EmbeddingDrift.before_update` copies ``W`` into the scratch buffer just before
``optimizer.step()`` and :meth:`EmbeddingDrift.after_update` computes ``||W - W0|| / ||W0||`` and ``||W -
W_prev|| / ||W||``, so the update ratio is exactly one step's even though it is sampled every k steps.
Under FSDP1/FSDP2 each rank works on its own shards and the squared norms are summed over ranks
(``counted``: :attr:`~stabmon.collect.sharding.Layout.counted` of the embedding weights), one collective
per sampled step.

>>> import torch
>>> emb = torch.nn.Embedding(10, 4)
>>> drift = EmbeddingDrift(torch.nn.Sequential(emb))
>>> drift.names
['0']
>>> drift.before_update()
>>> with torch.no_grad():
...     _ = emb.weight.mul_(2.0)
>>> names, values = drift.after_update()
>>> names, [round(v, 3) for v in values.tolist()]
(['emb_drift/0', 'emb_update/0'], [1.0, 0.5])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stabmon.collect.sharding import ShardedSquares, clean_name, local
from stabmon.events import Metric


class EmbeddingDrift:
    """Drift from the initial weights and one-step update ratio of each embedding; see the module
    docstring."""

    def __init__(self, model: nn.Module, *, counted: tuple[bool, ...] | None = None) -> None:
        params = {id(p) for p in model.parameters()}
        # an embedding whose weight is not a parameter of the model (FSDP1 flat parameters) has no storage
        # of its own outside the forward pass: it cannot be watched (FSDP1 needs use_orig_params=True)
        self._embs = [
            (n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding) and id(m.weight) in params
        ]
        self.names = [clean_name(n) for n, _ in self._embs]
        self._sum = ShardedSquares(counted) if counted is not None else None
        self._sum3 = ShardedSquares(counted * 3) if counted is not None else None
        self._w0 = [self._weight(m).clone() for _, m in self._embs]
        self._prev = [torch.empty_like(w) for w in self._w0]
        self._w0_norm = self._norms(self._w0)
        self._metric_names = [f"{Metric.EMB_DRIFT_PREFIX}{n}" for n in self.names] + [
            f"{Metric.EMB_UPDATE_PREFIX}{n}" for n in self.names
        ]
        self._ready = False

    def __bool__(self) -> bool:
        return bool(self._embs)

    def before_update(self) -> None:
        with torch.no_grad():
            for (_, m), prev in zip(self._embs, self._prev, strict=True):
                prev.copy_(self._weight(m))
        self._ready = True

    def after_update(self) -> tuple[list[str], torch.Tensor | None]:
        if not self._ready or not self._embs:
            return [], None
        self._ready = False
        with torch.no_grad():
            weights = [self._weight(m) for _, m in self._embs]
            # the scratch buffers hold the differences in turn: no allocation the size of an embedding
            torch._foreach_sub_(self._prev, weights)
            n_dp = _norm_list(self._prev)
            torch._foreach_copy_(self._prev, weights)
            torch._foreach_sub_(self._prev, self._w0)
            sq = torch.cat([n_dp, _norm_list(self._prev), _norm_list(weights)]).square()
            if self._sum3 is not None:
                sq = self._sum3(sq)
            n_dp, n_d0, n_w = sq.sqrt().chunk(3)
            values = torch.cat([n_d0 / self._w0_norm, n_dp / n_w])
        return self._metric_names, values

    @staticmethod
    def _weight(m: nn.Module) -> torch.Tensor:
        return local(m.weight.detach())  # type: ignore[operator]

    def _norms(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros(0)
        if self._sum is None:
            return _norm_list(tensors)
        return self._sum(_norm_list(tensors).square()).sqrt()

    def state_dict(self) -> dict[str, Any]:
        return {"w0": {n: w.cpu() for n, w in zip(self.names, self._w0, strict=True)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, n in enumerate(self.names):
            if n in state.get("w0", {}):
                self._w0[i].copy_(state["w0"][n])
        self._w0_norm = self._norms(self._w0)


def _norm_list(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
