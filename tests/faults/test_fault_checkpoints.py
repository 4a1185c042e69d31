"""Faults against rollback and resume: corrupted targets, checkpoints of another model, a crash after a
rollback. Each checks what the model holds afterwards, parameter by parameter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fault_support import Tiny, data

from stabmon.checkpoints import CheckpointManager, NoValidCheckpointError
from stabmon.collect.config import MonitorConfig
from stabmon.monitor import Monitor


def monitor(ckpt: Path, *, keep: int = 10) -> tuple[Monitor, Tiny, torch.optim.Optimizer]:
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = Monitor(model, opt, store=None, detectors=False, checkpoint_dir=str(ckpt),
                  config=MonitorConfig(flush_every=5, checkpoint_every=5, checkpoint_keep=keep, hang_timeout=None))
    return mon, model, opt


def train(mon: Monitor, model: Tiny, opt: torch.optim.Optimizer, n: int) -> list[int]:
    seen = []
    for _, x in mon.steps(data(64), max_steps=mon.step + n):
        seen.append(mon.cursor.position - 1)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return seen


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_corrupted_rollback_targets_fall_back_to_an_older_good_one(tmp_path: Path) -> None:
    mon, model, opt = monitor(tmp_path)
    train(mon, model, opt, 30)
    by_step = {c.step: c for c in mon.checkpoints.checkpoints}
    good = torch.load(by_step[15].path, weights_only=True)["model"]
    Path(by_step[25].path).write_bytes(Path(by_step[25].path).read_bytes()[:100])  # torn
    nan = torch.load(by_step[20].path, weights_only=True)
    nan["model"]["a.weight"].fill_(float("nan"))
    torch.save(nan, by_step[20].path)  # a NaN state (refused by the byte count or the finiteness check)
    info = mon.rollback(onset_step=29, lookback=0, skip_batches=2)
    assert info["checkpoint_step"] == 15 and mon.step == 15
    assert same(weights(model), good)
    mon.close()


def test_a_checkpoint_of_another_model_is_never_restored_halfway(tmp_path: Path) -> None:
    mon, model, opt = monitor(tmp_path)
    train(mon, model, opt, 10)
    foreign = {**mon.training_state(), "model": {"a.weight": torch.zeros(8, 4), "a.bias": torch.zeros(8),
                                                   "b.weight": torch.zeros(1, 16), "b.bias": torch.zeros(1)}}
    path = tmp_path / "foreign.pt"
    torch.save(foreign, path)
    mon.checkpoints.register(path, step=10)  # newest candidate: first key fits, the rest does not
    info = mon.rollback(onset_step=12, lookback=0, skip_batches=0)
    assert info["checkpoint_step"] == 10 and info["checkpoint_path"] != str(path)  # refused, older one used
    for c in list(mon.checkpoints.checkpoints):
        if c.path != str(path):
            Path(c.path).unlink()
    now = weights(model)
    with pytest.raises(NoValidCheckpointError, match="does not match the model: b.weight is"):
        mon.rollback(onset_step=12, lookback=0, skip_batches=0)
    assert same(weights(model), now)  # a failed restore changed nothing
    with pytest.raises(ValueError, match="^checkpoint does not match the model"):
        mon.load_training_state(foreign)
    assert same(weights(model), now)
    mon.close()


def test_a_resume_after_a_rollback_continues_the_rolled_back_timeline(tmp_path: Path) -> None:
    mon, model, opt = monitor(tmp_path)
    train(mon, model, opt, 30)
    info = mon.rollback(onset_step=27, lookback=5, skip_batches=3)  # back to step 20; batches 20..22 skipped
    assert info["checkpoint_step"] == 20 and info["skipped"] == [20, 23]
    train(mon, model, opt, 2)  # then the process dies (no checkpoint since the rollback's own)
    mon.close()
    manager = CheckpointManager(tmp_path)  # a fresh process reads the registry
    resumed_from, state = manager.last_known_good()
    assert resumed_from.step == 20 and resumed_from.timeline == 1
    assert {c.step for c in manager.checkpoints if c.abandoned} == {25, 30}
    mon2, model2, opt2 = monitor(tmp_path)
    mon2.load_training_state(state)
    seen = train(mon2, model2, opt2, 10)
    assert not {20, 21, 22} & set(seen) and seen[0] == 23  # the corrupt batches stay skipped
    mon2.close()
