"""The host-memory snapshot tier (``MonitorConfig.snapshots``): a rollback lands on the newest snapshot before the
onset instead of an older disk checkpoint, restores it whole (weights, optimizer, step, data position), leaves it
intact for another rollback, writes the rolled-back state to disk for a resume, and falls back to the disk when no
snapshot validates."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from stabmon.checkpoints import CheckpointInfo, CheckpointManager
from stabmon.collect.checkpoint.snapshots import PREFIX, HostSnapshots, TieredCheckpoints
from stabmon.collect.config import MonitorConfig, SnapshotConfig
from stabmon.monitor import Monitor

SEED = int(os.environ.get("STABMON_TEST_SEED", "0"))
"""The weights' and data's seed (``STABMON_TEST_SEED``); torch's threads: ``STABMON_TEST_THREADS``."""
THREADS = int(os.environ.get("STABMON_TEST_THREADS", "0"))


def train(tmp_path: Path, steps: int, *, snapshots: SnapshotConfig | None, seed: int = SEED
          ) -> tuple[Monitor, dict[int, list[torch.Tensor]], dict[int, int]]:
    """A small AdamW loop drawing its data through ``monitor.steps``; the weights and data position after
    each step."""
    if THREADS:
        torch.set_num_threads(THREADS)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = MonitorConfig(checkpoint_every=100, flush_every=5, hang_timeout=None,
                           snapshots=snapshots or SnapshotConfig())
    mon = Monitor(model, opt, store=None, detectors=False, checkpoint_dir=str(tmp_path / "ckpt"), config=config)
    g = torch.Generator().manual_seed(seed)
    data = [torch.randn(16, 8, generator=g) for _ in range(steps)]
    weights: dict[int, list[torch.Tensor]] = {}
    position: dict[int, int] = {}
    for _step, x in mon.steps(data):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if (mon.step + 1) % 10 == 0:  # the end of step k: the state after k + 1 steps, as its snapshot holds it
            weights[mon.step + 1] = [p.detach().clone() for p in model.parameters()]
            position[mon.step + 1] = mon.cursor.position
    return mon, weights, position


def params(mon: Monitor) -> list[torch.Tensor]:
    return [p.detach().clone() for p in mon.model.parameters()]


def test_a_rollback_lands_on_the_newest_snapshot_not_the_older_disk_checkpoint(tmp_path: Path) -> None:
    mon, weights, position = train(tmp_path, 160, snapshots=SnapshotConfig(every=10, keep=3))
    try:
        assert [i.step for i in mon.checkpoints.checkpoints] == [0, 100]  # the disk: every 100 steps
        assert [i.step for i in mon.snapshots.candidates()] == [160, 150, 140]
        facts = mon.rollback(onset_step=155, lookback=0, skip_batches=0)
        assert facts["checkpoint_path"] == f"{PREFIX}150" and facts["checkpoint_step"] == 150  # not 100
        assert mon.step == 150 and facts["restored_step"] == 150
        assert all(torch.equal(a, b) for a, b in zip(params(mon), weights[150], strict=True))
        assert mon.cursor.position == position[150]
        assert [i.step for i in mon.snapshots.candidates()] == [150, 140]  # 160 was undone
        # the rolled-back state on disk on the new timeline: a resume continues from here, not from step 100
        saved = torch.load(facts["rolled_back_state"], weights_only=True)
        assert all(torch.equal(saved["model"][k], v) for k, v in mon.model.state_dict().items())
        # the snapshot itself is intact: train on (changing the weights), then roll back to it again
        x = torch.randn(16, 8)
        mon.model(x).pow(2).mean().backward()
        mon.optimizer.step()
        again = mon.rollback(onset_step=150, lookback=0, skip_batches=0)
        assert again["checkpoint_path"] == f"{PREFIX}150"
        assert all(torch.equal(a, b) for a, b in zip(params(mon), weights[150], strict=True))
    finally:
        mon.close()


def test_a_snapshot_that_does_not_validate_falls_back_to_the_disk(tmp_path: Path) -> None:
    disk = CheckpointManager(tmp_path)
    disk.save({"model": {"w": torch.zeros(2)}}, step=100)
    snaps = HostSnapshots(every=10, keep=2)
    snaps.take(140, lambda: {"model": {"w": torch.tensor([1.0, float("nan")])}})
    tiered = TieredCheckpoints(disk, snaps)
    info, state = tiered.last_known_good(150)
    assert info.step == 100 and state["model"]["w"].tolist() == [0.0, 0.0]
    refused = tiered.validate(tiered.candidates(150)[0])
    assert refused == (None, "non-finite values in model.w")


def test_a_disk_checkpoint_newer_than_every_snapshot_wins(tmp_path: Path) -> None:
    disk = CheckpointManager(tmp_path)
    disk.save({"model": {"w": torch.zeros(2)}}, step=150)
    snaps = HostSnapshots(every=10, keep=2)
    snaps.take(140, lambda: {"model": {"w": torch.ones(2)}})
    tiered = TieredCheckpoints(disk, snaps)
    assert [(i.step, i.path.startswith(PREFIX)) for i in tiered.candidates(160)] == [(150, False), (140, True)]
    assert tiered.last_known_good(160)[0].step == 150


def test_the_memory_budget_is_kept_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    snaps = HostSnapshots(every=1, keep=5, max_bytes=100)  # one snapshot of 64 floats is 256 bytes
    with caplog.at_level("WARNING"):
        for step in (1, 2, 3):
            assert snaps.take(step, lambda: {"w": torch.zeros(64)}) is None
    assert snaps.candidates() == [] and snaps.skipped == 3
    assert sum("more than snapshots.max_bytes" in r.message for r in caplog.records) == 1
    fits = HostSnapshots(every=1, keep=5, max_bytes=600)  # two of them fit
    for step in (1, 2, 3):
        fits.take(step, lambda: {"w": torch.zeros(64)})
    assert [i.step for i in fits.candidates()] == [3, 2] and fits.nbytes == 512


def test_snapshots_are_off_by_default_and_cost_nothing_then(tmp_path: Path) -> None:
    mon, _, _ = train(tmp_path, 20, snapshots=None)
    try:
        assert mon.snapshots is None and isinstance(mon.checkpoints, CheckpointManager)
    finally:
        mon.close()


@pytest.mark.parametrize(("config", "message"), [
    (SnapshotConfig(every=-1), "config.snapshots.every must be >= 0"),
    (SnapshotConfig(every=5, keep=0), "config.snapshots.keep must be >= 1"),
    (SnapshotConfig(every=5, max_bytes=0), "config.snapshots.max_bytes must be >= 1 or None"),
])
def test_bad_snapshot_settings_name_the_field(config: SnapshotConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MonitorConfig(snapshots=config)


def test_without_checkpoints_there_are_no_snapshots_and_one_line_says_so(caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Linear(2, 1)
    with caplog.at_level("WARNING"):
        mon = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=None, detectors=False,
                      config=MonitorConfig(hang_timeout=None, snapshots=SnapshotConfig(every=5)))
    try:
        assert mon.snapshots is None
        assert any("config.snapshots needs checkpoints" in r.message for r in caplog.records)
    finally:
        mon.close()


def _info(step: int) -> CheckpointInfo:
    return CheckpointInfo(step=step, path=f"{PREFIX}{step}", nbytes=0)


def test_a_snapshot_no_longer_held_is_refused() -> None:
    snaps = HostSnapshots(every=1, keep=1)
    snaps.take(1, lambda: {"w": torch.ones(1)})
    snaps.take(2, lambda: {"w": torch.ones(1)})
    assert snaps.validate(_info(1)) == (None, "the snapshot is no longer held")


STEPS = 30


def _ddp_train(rank: int, size: int, root: str) -> dict[str, Any]:
    """Two real gloo ranks under DDP, disk checkpoints every 15 steps, snapshots every 5: a scripted rollback at
    the flush after step 22 (onset 21) goes back together: to the snapshot of step 20, not the disk's 15."""
    from dist_support import Scripted

    from stabmon.events import InterventionRecord

    torch.manual_seed(SEED)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                                                          torch.nn.Linear(8, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = Monitor(model, opt, store=None, detectors=False, mode="apply", checkpoint_dir=f"{root}/ckpt-rank{rank}",
                  runbook=Scripted("rollback", {"lookback": 0, "onset_step": 21}, at=22),
                  config=MonitorConfig(flush_every=2, checkpoint_every=15, hang_timeout=None,
                                       snapshots=SnapshotConfig(every=5, keep=3)))
    gen = torch.Generator().manual_seed(SEED + 3 + rank)
    seen, after = [], {}
    for step, x in mon.steps([torch.randn(8, 4, generator=gen) for _ in range(STEPS)]):
        seen.append(step)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        after.setdefault(step + 1, [p.detach().clone() for p in model.parameters()])
    mon.close()
    records = [e for e in mon.events if isinstance(e, InterventionRecord)]
    return {"seen": seen, "records": records, "after": after, "final": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.slow
def test_ddp_ranks_roll_back_together_to_the_same_snapshot(tmp_path: Path) -> None:
    from dist_support import run_ranks

    results = run_ranks(_ddp_train, 2, str(tmp_path), timeout=240)
    for rank, got in enumerate(results):
        assert got["seen"] == [*range(23), *range(20, STEPS)], (rank, got["seen"])  # applied at the flush after 22
        assert all(torch.equal(a, b) for a, b in zip(got["final"], results[0]["final"], strict=True)), rank
    (record,) = results[0]["records"]
    assert record.ok and record.after["checkpoint_path"] == f"{PREFIX}20" and record.after["restored_step"] == 20
