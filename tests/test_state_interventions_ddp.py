"""reset_moments, adaptive_clip and the standing qk_clip under DDP on two real gloo ranks: rank 0 executes the
decision, the other rank follows it through the same broadcast the monitor uses, and both make the same change (same
tensors reset, same per-tensor clipping and the same per-head QK factors although each rank's batch differs)."""

from __future__ import annotations

from typing import Any

import torch
from dist_support import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stabmon.collect.cluster.distributed import RankFollower, broadcast
from stabmon.events import Decision, DecisionStatus
from stabmon.interventions import Executor
from stabmon.monitor import Monitor, MonitorConfig


def _decide(rank: int, ex: Executor, follower: RankFollower, action: str, params: dict[str, Any]) -> None:
    if rank == 0:
        d = Decision(step=0, action=action, params=params, status=DecisionStatus.APPLY, runbook="rb", rule="r",
                     rung=0, reason="test")
        rec = ex.execute(d)
        assert rec is not None and "error" not in rec.after and "not_applied" not in rec.after, rec.after
        broadcast([(d, rec.id)])
    else:
        follower.follow(ex, broadcast(None))


def _ranks(rank: int, size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    mon = Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(hang_timeout=None))
    ex, follower = Executor(mon.handle), RankFollower()
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own batches

    def step(scale: float = 1.0) -> None:
        mon.begin_step()
        model(torch.randn(4, 6, generator=gen) * scale).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        mon.end_step()

    for _ in range(3):
        step()
    _decide(rank, ex, follower, "reset_moments", {"tensors": ["2"], "second_moment": True})
    inner = model.module
    reset = [not opt.state[p]["exp_avg"].any() and not opt.state[p]["exp_avg_sq"].any() for p in inner.parameters()]
    _decide(rank, ex, follower, "adaptive_clip", {"lambda_rel": 1.05})
    for i in range(4):
        step(scale=100.0 if i == 3 else 1.0)  # a spike on the last step
    out = {"reset": reset, "ema": mon.signals.hooks.adaptive._ema.tolist(), "rewarm_left": mon.overrides.rewarm_left,
           "params": [p.detach().clone() for p in inner.parameters()]}
    mon.close()
    return out


def test_reset_moments_and_adaptive_clip_make_the_same_change_on_every_rank() -> None:
    r0, r1 = run_ranks(_ranks, 2, timeout=180.0)
    assert r0["reset"] == r1["reset"] == [False, False, True, True]  # the second Linear's weight and bias only
    assert r0["ema"] == r1["ema"] and len(r0["ema"]) == 4
    assert r0["rewarm_left"] == r1["rewarm_left"] == 16
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"], strict=True))


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, num_heads=2, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x, need_weights=False)[0])


def _qk_ranks(rank: int, size: int) -> dict[str, Any]:
    from stabmon.collect.signals.attention import AttentionLogits

    torch.manual_seed(0)
    net = Attn()
    with torch.no_grad():
        net.attn.in_proj_weight[:8].mul_(200.0)  # queries far too large: logits in the hundreds
    model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    mon = Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(hang_timeout=None))
    ex, follower = Executor(mon.handle), RankFollower()
    gen = torch.Generator().manual_seed(20 + rank)  # each rank its own batches: its own max logits

    def batch() -> torch.Tensor:
        return torch.randn(2, 6, 8, generator=gen) * (1.0 + rank)

    def measured() -> torch.Tensor:
        logits = AttentionLogits(net)
        logits.arm()
        with torch.no_grad():
            net(batch())
        logits.collect()
        return logits.last[0]

    before = measured()
    _decide(rank, ex, follower, "qk_clip", {"tau": 20.0})
    for _ in range(3):
        mon.begin_step()
        model(batch()).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        mon.end_step()
    out = {"before": before, "after": measured(), "qk_tau": mon.overrides.qk_tau,
           "params": [p.detach().clone() for p in net.parameters()]}
    mon.close()
    return out


def test_a_standing_qk_clip_scales_every_rank_by_the_same_factors() -> None:
    r0, r1 = run_ranks(_qk_ranks, 2, timeout=180.0)
    assert r0["qk_tau"] == r1["qk_tau"] == 20.0
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"], strict=True))  # still replicas
    assert r0["before"].max() > 100 and r1["before"].max() > 100
    # each rank measured its own batch; the factors came from the max over ranks, so no head is left far above tau
    assert r0["after"].max() < 0.5 * r0["before"].max() and r1["after"].max() < 0.5 * r1["before"].max()
