"""Under DDP on real gloo ranks, a value that is each rank's maximum over its own batch (the max attention logit,
the output logits' max and log Z) is recorded as the maximum over ranks, not their mean; the loss stays a mean.

Rank 1's inputs are 10x rank 0's, so its attention logits are ~100x larger: a mean over two ranks would record
about half of rank 1's peak, and would hide a runaway head that only one rank's data drives.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from dist_support import run_ranks
from torch import nn

from stabmon.collect.config import AttentionConfig, LogitConfig, MonitorConfig
from stabmon.events import Metric
from stabmon.monitor import Monitor

WIDTH, HEADS, VOCAB, BATCH, SEQ = 8, 2, 11, 2, 5


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.attn(x, x, x, need_weights=False)
        return self.head(y)


def own_peaks(model: Tiny, x: torch.Tensor) -> tuple[float, float]:
    """(max attention logit, max |output logit|) of this rank's batch, computed by hand."""
    with torch.no_grad():
        a = model.attn
        q, k, _ = nn.functional.linear(x, a.in_proj_weight, a.in_proj_bias).chunk(3, dim=-1)
        d = WIDTH // HEADS
        q = q.reshape(BATCH, SEQ, HEADS, d).transpose(1, 2)
        k = k.reshape(BATCH, SEQ, HEADS, d).transpose(1, 2)
        attn = float((q @ k.transpose(-1, -2) / math.sqrt(d)).max())
        return attn, float(model(x).abs().max())


def _run(rank: int, size: int, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = Tiny()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.0)  # nothing moves: the peaks before each step stay the same
    config = MonitorConfig(flush_every=2, hang_timeout=None,
                           attention=AttentionConfig(every=1, sub_batch=BATCH),
                           logits=LogitConfig(every=1, sub_batch=BATCH, module="head"))
    mon = Monitor(ddp, opt, store=None, mode="observe", config=config)
    x = torch.randn(BATCH, SEQ, WIDTH, generator=torch.Generator().manual_seed(seed)) * (10.0 if rank else 1.0)
    own = own_peaks(model, x)
    for _, batch in mon.steps([x] * 4):
        loss = ddp(batch).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
    mon.close()
    return {"own": own, "loss": float(ddp(x).pow(2).mean()),
            "records": [dict(r.metrics) for r in mon.records]}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 7])
def test_attention_and_output_logit_peaks_are_the_maximum_over_ranks(seed: int) -> None:
    r0, r1 = run_ranks(_run, 2, seed, timeout=180.0)
    peak_attn = max(r0["own"][0], r1["own"][0])
    peak_logit = max(r0["own"][1], r1["own"][1])
    assert r1["own"][0] > 10 * r0["own"][0]  # the ranks' peaks are far apart, by construction
    for rank in (r0, r1):  # every rank records the same
        assert len(rank["records"]) == 4
        for rec in rank["records"]:
            assert rec[Metric.ATTN_LOGIT] == pytest.approx(peak_attn, rel=1e-4)
            assert rec[Metric.LOGIT_MAX] == pytest.approx(peak_logit, rel=1e-4)
            assert rec[Metric.LOSS] == pytest.approx((r0["loss"] + r1["loss"]) / 2, rel=1e-4)  # still a mean
    reduced = [k for k in r0["records"][0] if k.startswith(("attn_logit", "logit_", "loss"))]
    assert len(reduced) >= 6  # the model's, its layer's, each head's, the output logits', the loss
    assert [[r[k] for k in reduced] for r in r0["records"]] == [[r[k] for k in reduced] for r in r1["records"]]


def _reduce(rank: int, size: int) -> list[float]:
    from stabmon.collect.cluster.distributed import reduce_across_ranks

    mine = {0: [1.0, 5.0, 2.0, 7.0, 3.0], 1: [3.0, 1.0, math.nan, math.inf, 3.0]}[rank]
    maxed = [False, True, True, True, True]  # a mean, then four maxima: plain, NaN on rank 1, inf on rank 1, equal
    return reduce_across_ranks(torch.tensor(mine), maxed).tolist()


def test_the_reduction_takes_the_maximum_where_flagged_and_keeps_a_non_finite_value() -> None:
    r0, r1 = run_ranks(_reduce, 2, timeout=60.0)
    assert r0[:2] == [2.0, 5.0] and math.isnan(r0[2]) and r0[3] == math.inf and r0[4] == 3.0
    assert r1[:2] == r0[:2] and math.isnan(r1[2]) and r1[3:] == r0[3:]
