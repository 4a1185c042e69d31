"""The state-level fixes under FSDP2 (two real gloo ranks) equal an unsharded run: adaptive clipping and the
update-RMS cap use per-tensor quantities summed over the shards, element skip is local, reset_moments and
qk_clip change each rank's shard of the same tensors."""

from __future__ import annotations

import pytest
import torch
from dist_support import run_ranks
from torch import nn

from stabmon.collect.config import MonitorConfig
from stabmon.events import Decision, DecisionStatus
from stabmon.interventions import Executor
from stabmon.monitor import Monitor

STEPS, BATCH = 8, 8


class Tiny(nn.Module):
    n_head = 2

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 8)
        self.qkv = nn.Linear(8, 24)  # nanoGPT's packed projection: qk_clip scales rows of a sharded weight
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        q, k, v = self.qkv(h).split(8, dim=-1)
        return self.head(h + torch.tanh(q * k) * v)


def _train(model: nn.Module, *, rank: int, size: int, fixes: bool = True) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    mon = Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(flush_every=4, hang_timeout=None))
    ex = Executor(mon.handle)
    gen = torch.Generator().manual_seed(11)
    per = BATCH // size
    for step in range(STEPS):
        if step == 3 and fixes:
            for action, params in (("reset_moments", {"tensors": ["qkv"], "second_moment": True}),
                                   ("adaptive_clip", {}), ("clip_update", {"max_rms": 0.3}),
                                   ("skip_step", {"theta": 50.0}),
                                   ("qk_clip", {"layer": "", "heads": [1], "max_logit": 400.0, "standing": False})):
                rec = ex.execute(Decision(step=step, action=action, params=params, status=DecisionStatus.APPLY,
                                          runbook="rb", rule="r", rung=0, reason="t"))
                assert rec is not None and "error" not in rec.after and "not_applied" not in rec.after, rec.after
        x, y = torch.randn(BATCH, 5, generator=gen), torch.randn(BATCH, 3, generator=gen)
        y = y * (30.0 if step == 6 else 1.0)
        mon.begin_step()
        (model(x[rank * per:(rank + 1) * per]) - y[rank * per:(rank + 1) * per]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        mon.end_step()
    mon.close()


def _fsdp2(rank: int, size: int) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Tiny()
    for module in (model.embed, model.qkv, model.head):
        fully_shard(module)
    fully_shard(model)
    _train(model, rank=rank, size=size)
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # type: ignore[attr-defined]


@pytest.mark.slow
def test_state_level_fixes_under_fsdp2_equal_an_unsharded_run() -> None:
    torch.manual_seed(0)
    reference = Tiny()
    _train(reference, rank=0, size=1)
    torch.manual_seed(0)
    untouched = Tiny()
    _train(untouched, rank=0, size=1, fixes=False)
    for name, p in reference.named_parameters():  # every tensor was changed by the fixes
        assert not torch.allclose(p, untouched.get_parameter(name), rtol=1e-3), name
    for rank_params in run_ranks(_fsdp2, 2, timeout=240.0):
        for name, p in reference.named_parameters():
            assert torch.allclose(rank_params[name], p.detach(), rtol=1e-4, atol=1e-6), name
