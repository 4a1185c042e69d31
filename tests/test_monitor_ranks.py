"""Per-rank signals on 4 real gloo ranks under DDP: a slow rank is named, a corrupted replica is flagged, a
healthy fleet raises nothing.

The slow rank's extra time is injected (a sleep inside its forward, where DDP holds no collective), so the
test holds on any machine: 20 % of a 150 ms simulated compute step is far above scheduling jitter.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
from dist_support import run_ranks
from torch import nn

from stabmon.collect.cluster.ranks import RankGather, summarise
from stabmon.collect.config import ActivationConfig, EmbeddingConfig, MonitorConfig
from stabmon.events import Metric
from stabmon.monitor import Monitor

RANKS, FLUSH, WORK = 4, 5, 0.15


class Work(nn.Module):
    """A tiny model whose forward also 'computes' for ``seconds`` (a sleep)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.net(x)


def _run(rank: int, size: int, steps: int, slow_rank: int | None, corrupt_rank: int | None) -> Any:
    torch.manual_seed(0)
    seconds = WORK * (1.2 if rank == slow_rank else 1.0)
    model = nn.parallel.DistributedDataParallel(Work(seconds))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = MonitorConfig(flush_every=FLUSH, hang_timeout=None, activations=ActivationConfig(every=0),
                           embeddings=EmbeddingConfig(every=0))
    mon = Monitor(model, opt, store=None, mode="observe", config=config)
    gen = torch.Generator().manual_seed(rank)
    data = [torch.randn(8, 4, generator=gen) for _ in range(steps)]
    for step, x in mon.steps(data):
        loss = model(x).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
        if step == 6 and rank == corrupt_rank:
            with torch.no_grad():  # silent data corruption: one element of one replica changes
                model.module.net[2].weight[0, 0] += 1e-3
    mon.close()
    anomalies = [(a.kind, a.step, a.message) for a in mon.anomalies]
    return anomalies, [dict(r.metrics) for r in mon.records]


@pytest.mark.slow
def test_healthy_fleet_raises_nothing() -> None:
    anomalies, records = run_ranks(_run, RANKS, 30, None, None, timeout=180)[0]
    assert anomalies == []
    assert all(r[Metric.DIVERGENCE] == 0.0 for r in records)  # replicas bit-identical
    assert all(r[Metric.NONFINITE_RANKS] == 0.0 for r in records)
    assert all(r[Metric.FLEET_STEP_TIME] >= WORK for r in records)


@pytest.mark.slow
def test_a_rank_20_percent_slower_is_named_within_a_few_flushes() -> None:
    anomalies, records = run_ranks(_run, RANKS, 40, 2, None, timeout=180)[0]
    stragglers = [a for a in anomalies if a[0] == "straggler"]
    assert stragglers, anomalies
    kind, step, message = stragglers[0]
    assert message.startswith("rank 2 was the slowest in ") and "x the fleet median (+0.0" in message, message
    ratio = float(message.split(", ")[1].split("x")[0])
    assert 1.1 <= ratio <= 1.35
    assert step < 6 * FLUSH  # named within six flushes (the detector needs 12 slow steps of 16)
    assert [a for a in anomalies if a[0] != "straggler"] == []


@pytest.mark.slow
def test_a_corrupted_replica_is_flagged_and_named() -> None:
    anomalies, records = run_ranks(_run, RANKS, 15, None, 3, timeout=180)[0]
    divergence = [a for a in anomalies if a[0] == "divergence"]
    assert divergence, anomalies
    kind, step, message = divergence[0]
    assert message.startswith("rank 3 disagrees with the other replicas")
    assert 6 < step <= 6 + FLUSH  # the first parameter checksum after the corruption
    before = [r for r in records if r[Metric.STEP_TIME] and r.get(Metric.DIVERGENCE) is not None]
    assert all(r[Metric.DIVERGENCE] == 0.0 for r in before[:5])


def test_one_process_gathers_its_own_values_into_fleet_metrics() -> None:
    flat = torch.tensor([2.0, 0.5, float("nan"), 0.7])
    names = [["loss", Metric.GRAD_NORM_LOCAL], ["loss", Metric.GRAD_NORM_LOCAL]]
    host = [{Metric.STEP_TIME: 0.2, Metric.BUSY_TIME: 0.1}, {Metric.STEP_TIME: 0.3}]
    out = RankGather(replicated=False).gather(flat, names, host)
    assert out[0][Metric.FLEET_STEP_TIME] == pytest.approx(0.2)
    assert out[0][Metric.NONFINITE_RANKS] == 0.0 and out[1][Metric.NONFINITE_RANKS] == 1.0
    assert Metric.STRAGGLER_RANK not in out[0]  # one rank: nobody to be slower than


def test_summary_names_the_outlier_and_ignores_ranks_that_did_not_measure() -> None:
    nan = math.nan
    rows = [[[1.0, 1.0, 2.0, 3.0, 7.0, 0.0]], [[1.0, 1.5, 2.0, 3.0, 7.5, 0.0]], [[1.0, nan, 2.0, 3.0, 7.0, 0.0]]]
    out = summarise(rows, replicated=True)[0]
    assert (out[Metric.STRAGGLER_RANK], out[Metric.STRAGGLER_RATIO]) == (1.0, 1.5 / 1.25)
    assert out[Metric.DIVERGENT_RANK] == 1.0 and out[Metric.DIVERGENCE] == pytest.approx(0.5 / 7.0)
    assert Metric.DIVERGENCE not in summarise(rows, replicated=False)[0]


def test_default_suite_flags_a_fleet_wide_step_time_regression() -> None:
    from stabmon.detect import DetectorSuite
    from stabmon.events import StepRecord

    suite = DetectorSuite.from_config(None)
    found = []
    for step in range(200):  # every rank slows down by 10 % from step 120 on (a slow filesystem, a bad switch)
        fleet = 1.0 if step < 120 else 1.1
        found += suite.update(StepRecord(step, {Metric.FLEET_STEP_TIME: fleet, Metric.STEP_TIME: fleet}))
    hits = [a for a in found if a.metric == Metric.FLEET_STEP_TIME]
    # the recent median (20 steps) is slow from step 130; reported after 20 steps of patience
    assert [a.kind for a in hits] == ["step_time"] and 120 <= hits[0].step < 155
