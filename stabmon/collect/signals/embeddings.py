"""Embedding drift and update ratio for every ``nn.Embedding``, on sampled steps, in bounded memory.

For each embedding the monitor tracks a fixed subset of rows: all of them when the vocabulary has at most
``rows`` rows, else ``rows`` evenly spaced ones (a 128k-token vocabulary would otherwise need a reference copy
of 2 GB in fp32). It keeps ``W0`` (those rows when monitoring began) and one scratch buffer of the same size.
On a sampled step :meth:`EmbeddingDrift.before_update` copies the rows into the scratch buffer just before
``optimizer.step()`` and :meth:`EmbeddingDrift.after_update` computes ``||W - W0|| / ||W0||`` and ``||W -
W_prev|| / ||W||`` over them, so the update ratio is exactly one step's even though it is sampled every k steps.

With ``reference="cpu"`` the ``W0`` rows live in host memory (pinned on CUDA) and the scratch buffer exists only
during the sampled step: nothing stays on the device between sampled steps; the rows are copied to the device
(``non_blocking``) when the drift is computed. :meth:`EmbeddingDrift.device_bytes` says what stays on the device.

Under FSDP1/FSDP2 each rank works on its own shards (all their rows are tracked) and the squared norms are summed
over ranks (``counted``: :attr:`~stabmon.collect.cluster.sharding.Layout.counted` of the embedding weights), one
collective per sampled step. An embedding whose weight is not a parameter of the model (FSDP1 flat parameters)
has no storage of its own outside the forward pass and is not watched (FSDP1 needs ``use_orig_params=True``).

>>> import torch
>>> emb = torch.nn.Embedding(10, 4)
>>> drift = EmbeddingDrift(torch.nn.Sequential(emb))
>>> drift.names, drift.device_bytes()
(['0'], 320)
>>> drift.before_update()
>>> with torch.no_grad():
...     _ = emb.weight.mul_(2.0)
>>> names, values = drift.after_update()
>>> names, [round(v, 3) for v in values.tolist()]
(['emb_drift/0', 'emb_update/0'], [1.0, 0.5])
>>> EmbeddingDrift(torch.nn.Sequential(torch.nn.Embedding(50_000, 4)), rows=1000).device_bytes()
40000
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from stabmon.collect.cluster.sharding import ShardedSquares, clean_name, local
from stabmon.events import Metric

log = logging.getLogger(__name__)

REFERENCES = ("device", "cpu")


class _Tracked:
    """One embedding: its weight, the tracked row indices (None: all rows), W0 and the scratch buffer."""

    def __init__(self, name: str, module: nn.Embedding, rows: int | None, reference: str) -> None:
        self.name, self.module = name, module
        weight = self.weight()
        n = weight.shape[0]
        self.index = None
        if rows is not None and rows < n:
            self.index = torch.linspace(0, n - 1, rows, device=weight.device).round().long().unique()
        rows_now = self.rows()
        on_host = reference == "cpu"
        self.w0 = rows_now.to("cpu", copy=True) if on_host else rows_now.clone()
        if on_host and weight.is_cuda:
            self.w0 = self.w0.pin_memory()
        self.prev: torch.Tensor | None = None if on_host else torch.empty_like(rows_now)
        self.on_host = on_host

    def weight(self) -> torch.Tensor:
        return local(self.module.weight.detach())  # type: ignore[operator] # a DTensor's shard, or the weight

    def rows(self) -> torch.Tensor:
        weight = self.weight()
        return weight if self.index is None else weight.index_select(0, self.index)

    def device_bytes(self) -> int:
        kept = [self.prev] if self.on_host else [self.w0, self.prev]
        if self.index is not None:
            kept.append(self.index)
        return sum(t.numel() * t.element_size() for t in kept if t is not None)


class EmbeddingDrift:
    """Drift from the initial weights and one-step update ratio of each embedding; see the module
    docstring."""

    def __init__(
        self,
        model: nn.Module,
        *,
        rows: int | None = None,
        reference: str = "device",
        counted: tuple[bool, ...] | None = None,
    ) -> None:
        if reference not in REFERENCES:
            raise ValueError(
                f"config.embeddings.reference must be one of {', '.join(REFERENCES)}, got {reference!r}"
            )
        params = {id(p) for p in model.parameters()}
        self._tracked = [
            _Tracked(clean_name(n), m, rows if counted is None else None, reference)  # a shard: all its rows
            for n, m in model.named_modules()
            if isinstance(m, nn.Embedding) and id(m.weight) in params
        ]
        self.names = [t.name for t in self._tracked]
        self._sum = ShardedSquares(counted) if counted is not None else None
        self._sum3 = ShardedSquares(counted * 3) if counted is not None else None
        self._w0_norm = self._norms([t.rows() for t in self._tracked])  # on the device, like W0's rows
        self._metric_names = [f"{Metric.EMB_DRIFT_PREFIX}{n}" for n in self.names] + [
            f"{Metric.EMB_UPDATE_PREFIX}{n}" for n in self.names
        ]
        self._ready = False

    def __bool__(self) -> bool:
        return bool(self._tracked)

    def device_bytes(self) -> int:
        """Bytes kept on the device between sampled steps (references, scratch buffers, row indices)."""
        return sum(t.device_bytes() for t in self._tracked)

    def before_update(self) -> None:
        with torch.no_grad():
            for t in self._tracked:
                prev = t.prev
                if t.on_host or prev is None:  # with a host reference it exists only until after_update
                    t.prev = t.rows() if t.index is not None else t.rows().clone()
                elif t.index is None:
                    prev.copy_(t.weight())
                else:
                    torch.index_select(t.weight(), 0, t.index, out=prev)
        self._ready = True

    def after_update(self) -> tuple[list[str], torch.Tensor | None]:
        if not self._ready or not self._tracked:
            return [], None
        self._ready = False
        with torch.no_grad():
            rows = [t.rows() for t in self._tracked]
            prev = [t.prev for t in self._tracked]
            assert all(p is not None for p in prev)
            scratch: list[torch.Tensor] = prev  # type: ignore[assignment]
            # the scratch buffers hold the differences in turn: no allocation the size of the tracked rows
            torch._foreach_sub_(scratch, rows)
            n_dp = torch.stack(torch._foreach_norm(scratch, 2, dtype=torch.float32))
            torch._foreach_copy_(scratch, rows)
            torch._foreach_sub_(scratch, [self._on_device(t, r) for t, r in zip(self._tracked, rows, strict=True)])
            n_d0 = torch.stack(torch._foreach_norm(scratch, 2, dtype=torch.float32))
            n_w = torch.stack(torch._foreach_norm(rows, 2, dtype=torch.float32))
            if self._sum3 is not None:  # sharded: the squares summed over ranks, one collective
                n_dp, n_d0, n_w = self._sum3(torch.cat([n_dp, n_d0, n_w]).square()).sqrt().chunk(3)
            values = torch.cat([n_d0 / self._w0_norm, n_dp / n_w])
        for t in self._tracked:
            if t.on_host:
                t.prev = None
        return self._metric_names, values

    @staticmethod
    def _on_device(t: _Tracked, like: torch.Tensor) -> torch.Tensor:
        return t.w0.to(like.device, non_blocking=True) if t.on_host else t.w0

    def _norms(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros(0)
        norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
        return norms if self._sum is None else self._sum(norms.square()).sqrt()

    def state_dict(self) -> dict[str, Any]:
        return {"w0": {t.name: t.w0.cpu() for t in self._tracked}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for t in self._tracked:
            saved = state.get("w0", {}).get(t.name)
            if saved is None:
                continue
            if saved.shape != t.w0.shape:
                log.warning(
                    "stabmon: embedding %s: saved reference has shape %s, this monitor tracks %s rows; "
                    "keeping the current reference",
                    t.name, tuple(saved.shape), tuple(t.w0.shape),
                )
                continue
            t.w0.copy_(saved)
        if self._tracked:  # on resume, not on the training path: the host-to-device copy may wait
            self._w0_norm = self._norms([t.w0 for t in self._tracked]).to(self._w0_norm.device)
