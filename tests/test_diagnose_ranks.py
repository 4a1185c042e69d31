"""``diagnose`` across real gloo ranks: every rank re-runs and replays on its own batches, the ranks agree on one
verdict, a rank whose own execution did not reproduce is named, and every rank takes the same next rung.

The tiny GPT trains under DDP on 2 ranks, each on its half of every batch. Faults come by construction: a forward
hook puts an inf in the first block's output the first time step 110 runs on rank 1 only (flaky-gpu), or batches
150-249 are random characters on every rank (bad-shard). Another seed: ``STABMON_TEST_SEED=7``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from dist_support import run_ranks
from torch import nn
from typer.testing import CliRunner

from stabmon.collect.config import MonitorConfig
from stabmon.monitor import Monitor

REPO = Path(__file__).resolve().parent.parent
SEED = int(os.environ.get("STABMON_TEST_SEED", "5"))


@cache
def scenarios() -> ModuleType:
    spec = importlib.util.spec_from_file_location("scenarios_diagnose_ranks", REPO / "examples" / "scenarios.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class RankSlice:
    """This rank's half of every batch of the loader (re-iterable, so a rollback can rewind it)."""

    def __init__(self, batches: Any, rank: int, size: int) -> None:
        self.batches, self.rank, self.size = batches, rank, size

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for x, y in self.batches:
            yield x[self.rank::self.size].contiguous(), y[self.rank::self.size].contiguous()


def _train_gpt(rank: int, size: int, scenario: str, steps: int, fault_rank: int | None, root: str) -> dict[str, Any]:
    sc = scenarios()
    config = sc.scenario(scenario).config(SEED, steps=steps, threads=1)
    model, opt, sched, batches = sc.tiny_gpt.build(config)
    mine = config if fault_rank in (None, rank) else dataclasses.replace(config, fault=None)
    fault = sc.tiny_gpt.Fault(mine, model)
    ddp = nn.parallel.DistributedDataParallel(model)  # the optimizer holds the same parameters
    mon = Monitor(ddp, opt, scheduler=sched, store=f"sqlite:///{root}/runs.db", runbook="diagnose-first",
                  mode="apply", run_name=f"{scenario}-ranks",
                  config=MonitorConfig(clip=config.clip, checkpoint_every=25, checkpoint_keep=40, hang_timeout=None),
                  checkpoint_dir=f"{root}/ckpt-rank{rank}")
    seen = []
    for step, (x, y) in mon.steps(RankSlice(batches, rank, size), max_steps=steps):
        seen.append(step)
        fault.before_step(step)
        loss = ddp(x, y)
        loss.backward()
        mon.observe(loss=loss)
        if not mon.should_stop:
            opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    mon.close()
    last = mon._diagnoser.last
    return {"diagnosis": last.as_after() if last is not None else None, "seen": seen, "exit_code": mon.exit_code,
            "skip": sorted(mon.cursor.skip), "run_id": mon.run_id}


def _stored(root: Path, run_id: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The diagnose interventions in the store, and the text trace."""
    from stabmon.cli import app

    url = f"sqlite:///{root}/runs.db"
    out = CliRunner().invoke(app, ["trace", run_id, "--db", url, "--json"])
    assert out.exit_code == 0, out.output
    steps = [s for i in json.loads(out.output)["incidents"] for s in i["steps"]]
    diagnoses = [s["intervention"] for s in steps if s["decision"]["action"] == "diagnose"]
    text = CliRunner().invoke(app, ["trace", run_id, "--db", url]).output
    return diagnoses, text.splitlines()


def _agree(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank holds the same diagnosis and trained the same steps; returns rank 0's diagnosis."""
    first = results[0]
    assert first["diagnosis"] is not None
    for other in results[1:]:
        assert {**other["diagnosis"], "seconds": 0} == {**first["diagnosis"], "seconds": 0}
        assert other["seen"] == first["seen"] and other["exit_code"] == first["exit_code"]
        assert other["skip"] == first["skip"]
    return first["diagnosis"]


def test_a_fault_in_one_execution_on_rank_1_is_hardware_suspect_naming_rank_1(tmp_path: Path) -> None:
    results = run_ranks(_train_gpt, 2, "flaky-gpu", 125, 1, str(tmp_path), timeout=300)
    ev = _agree(results)
    assert ev["verdict"] == "hardware_suspect", ev["summary"]
    rerun = ev["rerun"]
    assert rerun["mismatch"]["step"] == 110 and rerun["mismatch"]["rank"] == 1 and rerun["suspect_ranks"] == [1]
    assert ev["rank"] == 1 and ev["host"] and "rank 1" in ev["summary"]
    # every step before 110 reproduced on both ranks, but no rank keeps its re-run's state: the restart lands on a
    # checkpoint (each rank re-ran every step, the landing is one process's)
    assert ev["cleared_step"] == 110 and "landing" not in ev
    by_rank = {r["rank"]: r for r in rerun["ranks"]}
    assert by_rank[1]["recorded"]["loss"] == "nan" and isinstance(by_rank[1]["rerun"]["loss"], float)
    assert by_rank[0]["recorded"]["loss"] == pytest.approx(by_rank[0]["rerun"]["loss"], rel=1e-4)  # rank 0 reproduced
    assert all(r["exit_code"] == 88 for r in results)  # every rank stopped for a move
    (stored,), lines = _stored(tmp_path, results[0]["run_id"])  # stored once, by rank 0
    assert stored["after"]["verdict"] == "hardware_suspect"
    assert any(line.strip().startswith("rank 1 on") for line in lines)
    print("\n".join(line for line in lines if "diagnosis" in line or line.strip().startswith("rank ")))


def test_a_corrupted_shard_on_every_rank_is_data_and_every_rank_skips_it(tmp_path: Path) -> None:
    results = run_ranks(_train_gpt, 2, "bad-shard", 175, None, str(tmp_path), timeout=300)
    ev = _agree(results)
    assert ev["verdict"] == "data", ev["summary"]
    assert ev["rerun"]["reproduced"] is True and len(ev["rerun"]["ranks"]) == 2
    assert all(150 <= b["batch_index"] < 250 for b in ev["batches"] if b["role"] == "incident")
    # every rank replays every batch (one process may stop after half; ranks average their values first)
    assert ev["replay"]["replayed"] == len(ev["incident_steps"]) + len(ev["reference_steps"])
    assert "settled" not in ev["replay"]
    assert results[0]["skip"] and min(results[0]["skip"]) <= 150 and max(results[0]["skip"]) >= 249
    (stored,), lines = _stored(tmp_path, results[0]["run_id"])
    assert stored["after"]["verdict"] == "data"
    print("\n".join(line for line in lines if "diagnosis" in line or line.strip().startswith("rank ")))


# -- a small model, the diagnosis called by every rank at once ---------------------------------------------------
class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def _small(rank: int, size: int, kind: str, fault_rank: int | None, root: str, lose_batches: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Small()
    hit = {"armed": False}

    def flaky(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if not hit["armed"]:
            return None
        hit["armed"] = False
        out = out.clone()
        out.view(-1)[0] = float("inf")
        return out

    if fault_rank == rank:
        model.blocks[0].register_forward_hook(flaky)
    if kind == "ddp":
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        wrapped = fully_shard(model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)
    data = [(torch.randn(8, 6, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(30)]

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        return (m(batch[0]) - batch[1]).pow(2).mean()

    mon = Monitor(wrapped, opt, store=None, detectors=False, loss_fn=loss_fn, sample_ids=lambda b: list(range(8)),
                  config=MonitorConfig(clip=1.0, checkpoint_every=10, flush_every=5, hang_timeout=None),
                  checkpoint_dir=f"{root}/ckpt-{kind}-rank{rank}")
    for step, batch in mon.steps(data):
        hit["armed"] = step == 25
        loss = loss_fn(wrapped, batch)
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
    if lose_batches and rank == 1:
        mon.batches.entries.clear()  # type: ignore[union-attr]
    ev = mon.diagnose(onset_step=25, step=29, metric="loss", max_batches=3, rtol=1e-4, recur=0.5).as_after()
    mon.close()
    return ev


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_every_rank_reproduces_without_a_fault_and_the_ranks_agree(tmp_path: Path, kind: str) -> None:
    results = run_ranks(_small, 2, kind, None, str(tmp_path), False, timeout=180)
    assert results[0]["rerun"]["reproduced"] is True, results[0]["summary"]
    assert [r["rank"] for r in results[0]["rerun"]["ranks"]] == [0, 1]
    assert {**results[1], "seconds": 0} == {**results[0], "seconds": 0}
    assert results[0]["verdict"] in ("data", "state")


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_a_fault_on_rank_1_is_pinned_on_rank_1_under_ddp_and_fsdp2(tmp_path: Path, kind: str) -> None:
    results = run_ranks(_small, 2, kind, 1, str(tmp_path), False, timeout=180)
    for ev in results:
        assert ev["verdict"] == "hardware_suspect", ev["summary"]
        assert ev["rerun"]["mismatch"]["step"] == 25 and ev["rank"] == 1


def test_a_rank_without_its_evidence_makes_every_rank_inconclusive_without_hanging(tmp_path: Path) -> None:
    results = run_ranks(_small, 2, "ddp", None, str(tmp_path), True, timeout=180)
    for ev in results:
        assert ev["verdict"] == "inconclusive" and ev["summary"].startswith("rank 1: ")
