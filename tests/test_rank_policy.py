"""One rank policy on every checkpoint path, with two real gloo ranks: FSDP2 with per-rank directories, DDP with
one shared directory.

Periodic saves, an interrupt, the kill switch, a runbook's checkpoint-and-stop and a rollback each leave the
checkpoints the policy promises (every rank's own under FSDP2, rank 0's alone in a shared directory); a rollback
restores one step on every rank, and a rank that cannot finish its part is reported by rank 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_support import Scripted, run_ranks
from torch import nn

from stabmon.checkpoints import STOP_EXIT_CODE, UserCheckpoints
from stabmon.collect.config import MonitorConfig
from stabmon.events import Anomaly, InterventionRecord
from stabmon.monitor import Monitor

pytestmark = pytest.mark.slow
STEPS = 16


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2]):
        fully_shard(layer)
    return fully_shard(model)


def _train(mon: Monitor, model: nn.Module, opt: torch.optim.Optimizer, rank: int, *, kill: Path | None = None,
           interrupt_at: int | None = None) -> None:
    gen = torch.Generator().manual_seed(7 + rank)
    data = [torch.randn(8, 4, generator=gen) for _ in range(STEPS)]
    for step, x in mon.steps(data):
        if kill is not None and rank == 0 and step == 5:
            kill.write_text("maintenance")
        if step == interrupt_at:
            raise KeyboardInterrupt  # a SIGTERM on every rank, as torchrun sends it
        loss = model(x).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()


def _registry(directory: Path) -> list[dict[str, Any]]:
    path = directory / "registry.json"
    return json.loads(path.read_text())["checkpoints"] if path.is_file() else []


def _local(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: getattr(v, "to_local", lambda v=v: v)().detach().clone() for k, v in model.state_dict().items()}


def _kill_switch_fsdp2(rank: int, size: int, root: str) -> dict[str, Any]:
    directory, kill = Path(root) / f"ckpt-rank{rank}", Path(root) / "STOP"
    model = _model("fsdp2")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = Monitor(model, opt, store=None, detectors=False, checkpoint_dir=str(directory),
                  config=MonitorConfig(flush_every=2, checkpoint_every=0, hang_timeout=None, kill_switch=str(kill)))
    _train(mon, model, opt, rank, kill=kill)
    mon.close()
    saved = {e["step"]: e["path"] for e in _registry(directory)}
    held = torch.load(saved[mon.step], weights_only=False)["model"] if mon.step in saved else None
    shard = {k: getattr(v, "to_local", lambda v=v: v)() for k, v in (held or {}).items()}
    return {"step": mon.step, "exit_code": mon.exit_code, "saved": sorted(saved), "own": _local(model),
            "held": shard}


def test_the_kill_switch_under_fsdp2_with_per_rank_directories_saves_every_rank(tmp_path: Path) -> None:
    """Before, rank 0 saved and the other ranks stopped without saving: rank 1's shard of the stop was lost."""
    results = run_ranks(_kill_switch_fsdp2, 2, str(tmp_path), timeout=180)
    assert results[0]["step"] == results[1]["step"] < STEPS
    for rank, got in enumerate(results):
        assert got["exit_code"] == STOP_EXIT_CODE, rank
        assert got["saved"] == [got["step"]], (rank, got["saved"])  # the stop's checkpoint, in its own directory
        assert got["held"].keys() == got["own"].keys()
        for key, value in got["own"].items():  # its own shard, as trained until the stop
            assert torch.equal(got["held"][key], value), (rank, key)
    assert not torch.equal(results[0]["own"]["0.weight"], results[1]["own"]["0.weight"])  # two different shards


def _stop_and_periodic_fsdp2(rank: int, size: int, root: str) -> dict[str, Any]:
    directory = Path(root) / f"ckpt-rank{rank}"
    model = _model("fsdp2")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = Monitor(model, opt, store=None, detectors=False, mode="apply", checkpoint_dir=str(directory),
                  runbook=Scripted("checkpoint_and_stop", {"reason": "scripted"}, at=8),
                  config=MonitorConfig(flush_every=2, checkpoint_every=4, checkpoint_keep=10, hang_timeout=None))
    _train(mon, model, opt, rank)
    mon.close()
    return {"step": mon.step, "exit_code": mon.exit_code, "saved": [e["step"] for e in _registry(directory)],
            "records": [e for e in mon.events if isinstance(e, InterventionRecord)]}


def test_periodic_saves_and_a_runbook_stop_under_fsdp2_save_every_rank(tmp_path: Path) -> None:
    results = run_ranks(_stop_and_periodic_fsdp2, 2, str(tmp_path), timeout=180)
    stop = results[0]["step"]
    assert stop == results[1]["step"] == 10  # decided at the flush after step 9 (records 8, 9)
    for rank, got in enumerate(results):
        assert got["exit_code"] == STOP_EXIT_CODE
        assert got["saved"] == [0, 4, 8, stop], (rank, got["saved"])
    (record,) = results[0]["records"]
    assert record.after["step"] == stop and "rank_disagreements" not in record.after


def _interrupt(rank: int, size: int, root: str, kind: str) -> dict[str, Any]:
    shared = kind == "ddp"
    directory = Path(root) / ("ckpt" if shared else f"ckpt-rank{rank}")
    model = _model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    writes: list[int] = []

    def save(step: int) -> str:  # the loop's own save: which rank writes, and when
        writes.append(step)
        path = directory / f"state-{step}.pt"
        torch.save(mon.training_state(), path)
        return str(path)

    mon = Monitor(model, opt, store=None, detectors=False, checkpoints=UserCheckpoints(directory, save=save),
                  config=MonitorConfig(flush_every=2, checkpoint_every=5, hang_timeout=None))
    try:
        with mon:
            _train(mon, model, opt, rank, interrupt_at=7)
    except KeyboardInterrupt:
        pass
    return {"writes": writes, "layout": mon.policy.layout.value}


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_periodic_and_interrupt_saves_follow_the_layout(tmp_path: Path, kind: str) -> None:
    """One shared directory under DDP: rank 0 writes for both; per-rank directories under FSDP2: every rank."""
    results = run_ranks(_interrupt, 2, str(tmp_path), kind, timeout=180)
    assert [r["layout"] for r in results] == (["shared"] * 2 if kind == "ddp" else ["per_rank"] * 2)
    assert results[0]["writes"] == [0, 5, 7]
    assert results[1]["writes"] == ([] if kind == "ddp" else [0, 5, 7])
    directories = ["ckpt"] if kind == "ddp" else ["ckpt-rank0", "ckpt-rank1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == directories
    for name in directories:  # the one rank 0 keeps, or each rank's own
        assert [e["step"] for e in _registry(tmp_path / name)] == [0, 5, 7], name


def _rollback(rank: int, size: int, root: str, corrupt: bool, full_disk: bool, kind: str = "fsdp2") -> dict[str, Any]:
    directory = Path(root) / ("ckpt" if kind == "ddp" else f"ckpt-rank{rank}")  # DDP: one shared directory
    model = _model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    writes: list[int] = []

    def save(step: int) -> str:  # the loop's own save; on rank 1 with ``full_disk``, only the first per step fits
        if full_disk and rank == 1 and step in writes:
            raise OSError(28, "No space left on device")
        writes.append(step)
        path = directory / f"state-{step}-{len(writes)}.pt"
        torch.save(mon.training_state(), path)
        return str(path)

    ckpts = UserCheckpoints(directory, save=save, load=lambda p: torch.load(p, weights_only=False), keep=10)
    mon = Monitor(model, opt, store=None, detectors=False, mode="apply", checkpoints=ckpts,
                  runbook=Scripted("rollback", {"lookback": 0, "onset_step": 11}, at=12),
                  config=MonitorConfig(flush_every=2, checkpoint_every=5, hang_timeout=None))
    states: dict[int, dict[str, torch.Tensor]] = {}
    restored: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(7 + rank)
    last = -1
    for step, x in mon.steps([torch.randn(8, 4, generator=gen) for _ in range(STEPS)]):
        if step < last:  # the rollback at the flush after step 13 sent the loop back
            restored = {"step": step, "params": _local(model)}
            break
        last = step
        states[step] = _local(model)
        if corrupt and rank == 1 and step == 11:
            Path(ckpts.latest().path).write_bytes(b"torn")  # rank 1's checkpoint of step 10 is damaged
        loss = model(x).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
    mon.close()
    records = [e for e in mon.events if isinstance(e, InterventionRecord)]
    return {"states": states, "registry": _registry(directory), "records": records, "restored": restored,
            "anomalies": [a for a in mon.events if isinstance(a, Anomaly)]}


def _restored_step(results: list[dict[str, Any]]) -> int:
    (record,) = results[0]["records"]
    return int(record.after["checkpoint_step"])


@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
def test_a_rollback_restores_one_step_on_every_rank_and_records_it(tmp_path: Path, kind: str) -> None:
    """FSDP2: every rank records the rollback in its own directory (before, only rank 0 did); DDP: rank 0 in the
    shared one, which rank 1 reads."""
    results = run_ranks(_rollback, 2, str(tmp_path), False, False, kind, timeout=180)
    assert _restored_step(results) == 10
    for rank, got in enumerate(results):
        assert got["restored"]["step"] == 10, rank
        for key, value in got["states"][10].items():  # its own shard as it was at step 10
            assert torch.equal(got["restored"]["params"][key], value), (rank, key)
        new = [e for e in got["registry"] if e["timeline"] == 1]
        assert [e["step"] for e in new] == [10], (rank, got["registry"])  # the rolled-back state, on every rank
    assert "rank_disagreements" not in results[0]["records"][0].after and not results[0]["anomalies"]


def test_a_rank_whose_newest_checkpoint_is_damaged_makes_every_rank_restore_an_older_one(tmp_path: Path) -> None:
    """Before, each rank chose on its own: rank 0 restored step 10 and rank 1 step 5."""
    results = run_ranks(_rollback, 2, str(tmp_path), True, False, timeout=180)
    assert _restored_step(results) == 5
    for rank, got in enumerate(results):
        assert got["restored"]["step"] == 5, rank
        for key, value in got["states"][5].items():
            assert torch.equal(got["restored"]["params"][key], value), (rank, key)
        assert [e["step"] for e in got["registry"] if e["timeline"] == 1] == [5], rank


def test_a_rank_that_cannot_save_the_rolled_back_state_is_reported_by_rank_0(tmp_path: Path) -> None:
    results = run_ranks(_rollback, 2, str(tmp_path), False, True, timeout=180)
    (record,) = results[0]["records"]
    assert record.after["rank_disagreements"] == ["rank 1: the checkpoint save failed (see the log)"]
    (anomaly,) = results[0]["anomalies"]
    assert anomaly.kind == "rank_disagreement" and anomaly.metric == "ranks/rollback"
    assert "rank 1" in anomaly.message and anomaly.step == 10
    assert [e["step"] for e in results[1]["registry"] if e["timeline"] == 1] == []


def _shared_fsdp2(rank: int, size: int, root: str) -> str:
    model = _model("fsdp2")
    try:
        Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=None, checkpoint_dir=f"{root}/ckpt",
                config=MonitorConfig(hang_timeout=None))
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_one_directory_for_every_rank_of_a_sharded_model_is_refused_on_every_rank(tmp_path: Path) -> None:
    for message in run_ranks(_shared_fsdp2, 2, str(tmp_path), timeout=120):
        assert message.startswith("checkpoint_dir: every rank has the same directory, but the model is sharded")


def _mixed(rank: int, size: int, root: str) -> str:
    model = nn.Linear(2, 1)
    try:
        Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=None,
                checkpoint_dir=f"{root}/ckpt" if rank == 0 else None, config=MonitorConfig(hang_timeout=None))
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_a_checkpoint_directory_on_some_ranks_only_is_refused_on_every_rank(tmp_path: Path) -> None:
    for message in run_ranks(_mixed, 2, str(tmp_path), timeout=120):
        assert message.startswith("checkpoint_dir: ranks [1] have no checkpoint directory"), message
