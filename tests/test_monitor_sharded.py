"""Norms, clipping, the skip guard and overrides under DDP, FSDP1 and FSDP2 equal an unsharded run.

Each parallelism trains the same tiny model on the same global batches (every rank takes its slice) with the
monitor clipping hard (the clip binds on every step), an lr override, and the skip guard discarding an injected
gradient spike. Real gloo process groups on CPU, 2 and 4 ranks; the reference is one process on the whole
batch. Per step, the global and per-layer gradient norms must match to fp32 tolerance, and so must the
parameters at the end, which they only do when every rank clipped its shards by the *global* norm and skipped
the same step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_support import run_ranks
from torch import nn

from stabmon.collect.cluster.sharding import clean_name
from stabmon.collect.config import EmbeddingConfig, MonitorConfig, UpdateConfig
from stabmon.collect.signals.updates import UpdateNorms
from stabmon.monitor import Monitor

STEPS, BATCH, SPIKE_STEP = 6, 8, 4
KINDS = ("ddp", "fsdp1", "fsdp1-flat", "fsdp2")


class Tiny(nn.Module):
    """Blocks in a ModuleList (per-layer norms) and a head whose 3 rows leave a rank an empty shard on 4
    ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 3)
        self.pos = nn.Embedding(5, 8)  # drift and update ratio need the same sum over shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x) + self.pos(torch.zeros(len(x), dtype=torch.long)))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for step in range(STEPS):
        x, y = torch.randn(BATCH, 5, generator=gen), torch.randn(BATCH, 3, generator=gen)
        if step == SPIKE_STEP:
            y = y * 1e4  # a gradient spike the skip guard (factor 5) must discard on every rank
        out.append((x, y))
    return out


def _train(model: nn.Module, batches: list[Any], *, rank: int, size: int) -> list[dict[str, float]]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    mon = Monitor(model, opt, store=None, detectors=False,
                  config=MonitorConfig(clip=0.05, flush_every=3, hang_timeout=None,
                                       embeddings=EmbeddingConfig(every=1), updates=UpdateConfig(every=1)))
    mon.overrides.lr_scale = 0.5
    mon.overrides.skip_factor = 5.0
    per = BATCH // size
    for _, (x, y) in mon.steps(batches):
        xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        loss = (model(xs) - ys).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
    mon.close()
    return [dict(r.metrics) for r in mon.records]


def _reference() -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Tiny()
    metrics = _train(model, _batches(), rank=0, size=1)
    return metrics, {n: p.detach().clone() for n, p in model.named_parameters()}


def _wrap(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = Tiny()
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if kind.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = ModuleWrapPolicy({nn.Linear, nn.Embedding})
        return FSDP(model, auto_wrap_policy=policy, use_orig_params=kind == "fsdp1", device_id=torch.device("cpu"))
    from torch.distributed.fsdp import fully_shard

    for module in (model.embed, *model.blocks, model.head, model.pos):
        fully_shard(module)
    return fully_shard(model)


def _full_params(kind: str, model: nn.Module) -> dict[str, torch.Tensor]:
    if kind == "fsdp2":
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # type: ignore
    if kind.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model):
            return {clean_name(n): p.detach().clone() for n, p in model.named_parameters()}
    return {clean_name(n): p.detach().clone() for n, p in model.named_parameters()}


def _update_collector(model: nn.Module) -> list[str]:
    """The update-ratio collector the monitor's defaults choose for this model under AdamW."""
    mon = Monitor(model, torch.optim.AdamW(model.parameters()), store=None, detectors=False,
                  config=MonitorConfig(hang_timeout=None))
    mon.close()
    return [type(s).__name__ for _, s in mon.signals.hooks.signals if isinstance(s, UpdateNorms)]


def _every_kind(rank: int, size: int) -> dict[str, Any]:
    out = {}
    for kind in KINDS:
        model = _wrap(kind)
        metrics = _train(model, _batches(), rank=rank, size=size)
        out[kind] = (metrics, _full_params(kind, model), _update_collector(model))
    return out


@pytest.fixture(scope="module")
def reference() -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    return _reference()


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(b), 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 4])
def test_norms_clipping_and_guard_match_an_unsharded_run(size: int, reference: Any) -> None:
    ref_metrics, ref_params = reference
    layers = sorted(k for k in ref_metrics[0] if k.startswith("grad_norm/"))
    assert layers == ["grad_norm/blocks.0", "grad_norm/blocks.1", "grad_norm/embed", "grad_norm/head",
                      "grad_norm/pos"]
    compared = [*layers, "emb_drift/pos", "emb_update/pos", "update_ratio",
                *(k.replace("grad_norm/", "update_ratio/") for k in layers)]
    assert [m["skipped"] for m in ref_metrics] == [1.0 if s == SPIKE_STEP else 0.0 for s in range(STEPS)]
    assert all(m["grad_norm"] > 0.05 for m in ref_metrics)  # the clip binds on every step
    results = run_ranks(_every_kind, size, timeout=240)
    for kind in KINDS:
        per_rank = [r[kind] for r in results]
        for rank, (metrics, params, collector) in enumerate(per_rank):
            where = f"{kind}, {size} ranks, rank {rank}"
            assert len(metrics) == STEPS, where
            # by default from Adam's state, no copy (FSDP2's shards summed over ranks); FSDP1 flat: off
            assert collector == ([] if kind.startswith("fsdp1") else ["AdamUpdateNorms"]), (where, collector)
            for step, (got, want) in enumerate(zip(metrics, ref_metrics, strict=True)):
                assert _close(got["grad_norm"], want["grad_norm"]), (where, step, got["grad_norm"], want)
                assert got["skipped"] == want["skipped"] and got["lr"] == want["lr"], (where, step)
                assert got["nonfinite"] == 0.0
                if kind == "fsdp1-flat":  # an embedding's weight is no parameter there: not watched
                    assert not any(k.startswith("emb_") for k in got), where
                for layer in compared:  # FSDP1 flat parameters: one per wrapped module, so per layer too
                    if kind != "fsdp1-flat" or not layer.startswith("emb_"):
                        # an update ratio from a copy (FSDP1) is the difference of two close weights: 1e-4 off
                        rel = 1e-3 if kind.startswith("fsdp1") and layer.startswith("update_ratio") else 1e-5
                        assert _close(got[layer], want[layer], rel), (where, step, layer, got[layer], want[layer])
            assert params.keys() == ref_params.keys(), where
            for name, value in params.items():
                assert torch.allclose(value, ref_params[name], rtol=1e-5, atol=1e-6), (where, name)


def _host_reads(rank: int, size: int) -> dict[str, tuple[list[str], list[str]]]:
    """Host reads outside flushes in the same FSDP2 / DDP loop without and with the monitor."""
    from sync_support import SyncCounter

    out = {}
    for kind in ("fsdp2", "ddp"):
        for monitored in (False, True):
            model = _wrap(kind)
            opt = torch.optim.AdamW(model.parameters(), lr=0.05)
            counter = SyncCounter()
            mon = None
            if monitored:
                mon = Monitor(model, opt, store=None, detectors=False,
                              config=MonitorConfig(clip=0.05, flush_every=3, hang_timeout=None,
                                                   embeddings=EmbeddingConfig(every=1)))
                real_flush = mon.flush

                def counted_flush(real: Any = real_flush, c: SyncCounter = counter) -> Any:
                    c.in_flush += 1
                    try:
                        return real()
                    finally:
                        c.in_flush -= 1

                mon.flush = counted_flush  # type: ignore[method-assign]
            with counter:
                for x, y in _batches():
                    if mon is not None:
                        mon.begin_step()
                    loss = (model(x[:BATCH // size]) - y[:BATCH // size]).pow(2).mean()
                    loss.backward()
                    if mon is not None:
                        mon.observe(loss=loss)
                    opt.step()
                    opt.zero_grad()
                    if mon is not None:
                        mon.end_step()
                if mon is not None:
                    mon.close()
            out[f"{kind}-{'monitored' if monitored else 'plain'}"] = (counter.outside, counter.inside)
    return out


@pytest.mark.slow
def test_sharded_monitor_adds_no_host_sync_outside_flushes() -> None:
    for rank, got in enumerate(run_ranks(_host_reads, 2, timeout=240)):
        for kind in ("fsdp2", "ddp"):
            plain, monitored = got[f"{kind}-plain"], got[f"{kind}-monitored"]
            assert monitored[0] == plain[0], (rank, kind, monitored[0], plain[0])  # the monitor reads nothing
            assert "tolist" in monitored[1], (rank, kind)  # the host copies happen at flushes
