"""A rollback under torch.distributed lands on one step on every rank, checked against what each rank loaded.

Two real gloo ranks, FSDP2, each rank with its own checkpoint directory. The ranks agree on the newest step every
rank holds and validates; then each loads its own file of that step. A rank whose file of the agreed step holds
another step, or whose state cannot be applied, used to leave the ranks at two steps (rank 0 at step 10, rank 1
at step 5) and the next collectives out of line: a deadlock. Now the landing is checked on every rank: a step
some rank did not land on is refused on every rank and the ranks go back together to the newest step they all
land on, and when there is none every rank puts its state back and the rollback fails on every rank alike.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_support import Scripted, run_ranks
from torch import nn

from stabmon.checkpoints import UserCheckpoints
from stabmon.collect.config import MonitorConfig
from stabmon.events import Anomaly, InterventionRecord
from stabmon.monitor import Monitor

pytestmark = pytest.mark.slow
STEPS = 16
DECIDED_AT = 12
"""The scripted rollback's record: applied at the flush after step 13 (records 12 and 13), onset step 11."""


def _model() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    return fully_shard(model)


def _local(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter."""
    return {k: v.to_local().detach().clone() for k, v in model.state_dict().items()}


def _train(rank: int, size: int, root: str, fault: str) -> dict[str, Any]:
    """Train :data:`STEPS` batches through one scripted rollback. ``fault``: ``older`` (rank 1's file of step
    10 is replaced by its file of step 5 after it was registered, and registered again: its registry points at
    older training) or ``unloadable`` (every checkpoint rank 1 writes validates but cannot be applied: its data
    position is torn)."""
    directory = Path(root) / f"ckpt-rank{rank}"
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def save(step: int) -> str:  # the loop's own save, one file per save
        path = directory / f"state-{step}-{len(list(directory.glob('state-*')))}.pt"
        state = mon.training_state()
        if fault == "unloadable" and rank == 1:
            state["monitor"]["data"]["position"] = "torn"
        torch.save(state, path)
        return str(path)

    ckpts = UserCheckpoints(directory, save=save, load=lambda p: torch.load(p, weights_only=False), keep=10)
    mon = Monitor(model, opt, store=f"sqlite:///{root}/stabmon.db", detectors=False, mode="apply", checkpoints=ckpts,
                  runbook=Scripted("rollback", {"lookback": 0, "onset_step": 11}, at=DECIDED_AT),
                  config=MonitorConfig(flush_every=2, checkpoint_every=5, hang_timeout=None))
    before: dict[int, dict[str, torch.Tensor]] = {}  # each step's parameters as the step begins
    after: dict[int, dict[str, torch.Tensor]] = {}  # ... and once it has been taken
    seen: list[int] = []
    gen = torch.Generator().manual_seed(7 + rank)
    for step, x in mon.steps([torch.randn(8, 4, generator=gen) for _ in range(STEPS)]):
        if seen and step <= seen[-1]:
            before[-1] = _local(model)  # the first step after the rollback
        else:
            before[step] = _local(model)
        seen.append(step)
        if fault == "older" and rank == 1 and step == 11:
            paths = {e.step: e.path for e in ckpts.checkpoints}
            shutil.copyfile(paths[5], paths[10])
            ckpts.register(paths[10], step=10)
        loss = model(x).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
        after[step] = _local(model)
    mon.close()
    registry = json.loads((directory / "registry.json").read_text())["checkpoints"]
    return {"seen": seen, "step": mon.step, "before": before, "after": after,
            "records": [e for e in mon.events if isinstance(e, InterventionRecord)],
            "anomalies": [a for a in mon.events if isinstance(a, Anomaly)], "registry": registry}


def test_a_rank_whose_file_of_the_agreed_step_holds_an_older_step_takes_every_rank_back_to_one_step(
    tmp_path: Path,
) -> None:
    """Before: rank 0 restored step 10, rank 1 step 5, and the ranks' collectives no longer lined up."""
    results = run_ranks(_train, 2, str(tmp_path), "older", timeout=240)
    back = [*range(14), *range(5, STEPS)]  # the rollback at the flush after step 13 went back to step 5
    for rank, got in enumerate(results):
        assert got["seen"] == back, (rank, got["seen"])
        assert got["step"] == STEPS, rank
        for key, value in got["before"][5].items():  # its own shard as it was when step 5 began
            assert torch.equal(got["before"][-1][key], value), (rank, key)
        assert [e["step"] for e in got["registry"] if e["timeline"] == 1] == [5, 10, 15], rank
    (record,) = results[0]["records"]
    assert record.ok and record.after["checkpoint_step"] == 5 and record.after["restored_step"] == 5
    (line,) = record.after["rank_disagreements"]
    assert line.startswith("rank 1: its checkpoint of step 10 restored step 5"), line
    (anomaly,) = results[0]["anomalies"]
    assert anomaly.kind == "rank_disagreement" and anomaly.metric == "ranks/rollback"
    assert "rank 1: its checkpoint of step 10 restored step 5" in anomaly.message
    stored = _stored(tmp_path)  # what `stabmon trace` reads
    assert stored["anomalies"] == [("rank_disagreement", anomaly.message)]
    (after,) = stored["rollbacks"]
    assert after["checkpoint_step"] == 5 and after["rank_disagreements"] == [line]


def test_a_rank_that_cannot_apply_any_checkpoint_fails_the_rollback_on_every_rank_and_keeps_their_state(
    tmp_path: Path,
) -> None:
    """Before: rank 0 restored step 10 while rank 1 stayed at step 14, and the ranks' collectives no longer lined
    up."""
    results = run_ranks(_train, 2, str(tmp_path), "unloadable", timeout=240)
    for rank, got in enumerate(results):
        assert got["seen"] == list(range(STEPS)) and got["step"] == STEPS, (rank, got["seen"])
        for key, value in got["after"][13].items():  # the state it had before the rollback, trained on
            assert torch.equal(got["before"][14][key], value), (rank, key)
        assert [e for e in got["registry"] if e["timeline"]] == [], rank  # no rollback recorded
    (record,) = results[0]["records"]
    assert not record.ok and "RankDisagreementError" in str(record.error), record
    (anomaly,) = results[0]["anomalies"]
    assert anomaly.kind == "rank_disagreement" and anomaly.metric == "ranks/rollback"
    assert "rank 1: its checkpoint of step 10 could not be restored" in anomaly.message, anomaly.message
    assert _stored(tmp_path)["anomalies"] == [("rank_disagreement", anomaly.message)]


def _stored(root: Path) -> dict[str, Any]:
    """The run's anomalies and rollback records in rank 0's store."""
    with sqlite3.connect(root / "stabmon.db") as conn:
        anomalies = conn.execute("select kind, message from anomalies order by seq").fetchall()
        rollbacks = [json.loads(a) for (a,) in conn.execute("select after from interventions where action = ?",
                                                             ("rollback",))]
    return {"anomalies": anomalies, "rollbacks": rollbacks}
