"""Rank consistency with two real processes (gloo on CPU): metrics reduced, rank 0 decides, every rank
applies."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_monitor import SpikeDetectors
from torch import nn

from stabmon.collect.config import MonitorConfig
from stabmon.events import Decision, DecisionStatus, StepRecord
from stabmon.monitor import Monitor


class ClipThenRevert:
    """Test double of the engine: set_clip on the first anomaly, revert it three flushes later."""

    def __init__(self) -> None:
        self.record_id: str | None = None
        self.flushes_since = -1

    def process(self, record: StepRecord, anomalies: Any) -> list[Any]:
        out = []
        if anomalies and self.record_id is None:
            out.append(
                Decision(
                    step=record.step,
                    action="set_clip",
                    params={"max_norm": 0.25},
                    status=DecisionStatus.APPLY,
                    runbook="t",
                    rule="r",
                    rung=0,
                    reason="spike",
                )
            )
        if self.record_id is not None:
            self.flushes_since += 1
            if self.flushes_since == 6:
                out.append(
                    Decision(
                        step=record.step,
                        action="revert",
                        params={"intervention_id": self.record_id},
                        status=DecisionStatus.APPLY,
                        runbook="t",
                        rule="r",
                        rung=0,
                        reason="done",
                    )
                )
        return out

    def answer(self, decision_id: str, approved: bool, step: int) -> list[Any]:
        return []

    def applied(self, decision: Any, record: Any) -> None:
        if decision.action == "set_clip":
            self.record_id, self.flushes_since = record.id, 0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _worker(rank: int, port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        mon = Monitor(
            model,
            opt,
            store=None,
            detectors=SpikeDetectors(),
            runbook=ClipThenRevert(),
            mode="apply",
            config=MonitorConfig(flush_every=2, hang_timeout=None),
        )
        gen = torch.Generator().manual_seed(100 + rank)  # each rank sees different data
        data = [torch.randn(8, 4, generator=gen) for _ in range(20)]
        for step, x in mon.steps(data):
            loss = model(x).pow(2).mean()
            if step == 5 and rank == 1:
                loss = loss * 1e6  # only rank 1 spikes: the mean across ranks still shows it
            loss.backward()
            mon.observe(loss=loss)
            opt.step()
            opt.zero_grad()
        mon.close()
        out.put((rank, [dict(r.metrics) for r in mon.records], mon.overrides.max_norm, mon.run_id))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_ranks_reduce_metrics_and_apply_the_same_decisions() -> None:
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {r: (m, mn, rid) for r, m, mn, rid in (out.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (m0, clip0, run0), (m1, clip1, run1) = results[0], results[1]
    assert run0 == run1
    for a, b in zip(m0, m1, strict=True):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]  # reduced: identical on both ranks
    assert [m["clip"] for m in m0] == [m["clip"] for m in m1]
    clips = [m["clip"] for m in m0]
    assert 0.25 in clips and clips[-1] == float(
        "inf"
    )  # applied, then reverted, on both ranks at the same step
    assert clip0 is None and clip1 is None
