"""Checkpoint defaults a new user relies on without reading the config: a ``checkpoint_dir=`` with no cadence
saves at the default cadence (so a rollback has something to restore), an explicit ``checkpoint_every=0`` is
warned about at start, and the loop's own checkpoints are bounded by a default ``keep``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from stabmon.checkpoints import DEFAULT_USER_KEEP, UserCheckpoints
from stabmon.collect.config import DEFAULT_CHECKPOINT_EVERY
from stabmon.monitor import Monitor, MonitorConfig
from stabmon.store import Store, repo


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(mon: Monitor, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        mon.begin_step()
        loss = model(torch.randn(16, 4)).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
        mon.end_step()


def test_a_checkpoint_dir_without_a_cadence_saves_at_the_default_cadence(tmp_path: Path) -> None:
    model, opt = make()
    store = Store("sqlite://")
    mon = Monitor(model, opt, store=store, detectors=False, checkpoint_dir=str(tmp_path / "ckpt"),
                  config=MonitorConfig(hang_timeout=None))
    train(mon, model, opt, DEFAULT_CHECKPOINT_EVERY + 1)
    mon.close()
    assert [c.step for c in mon.checkpoints.checkpoints] == [0, DEFAULT_CHECKPOINT_EVERY]
    store.flush()
    with store.session() as session:
        config, _ = repo.run_config(session=session, run_id=mon.run_id)
    store.close()
    assert config["monitor"]["checkpoint_every"] == DEFAULT_CHECKPOINT_EVERY  # in force, as replay reads it


def test_no_checkpoint_dir_saves_nothing_and_records_no_cadence() -> None:
    model, opt = make()
    mon = Monitor(model, opt, store=None, detectors=False, config=MonitorConfig(hang_timeout=None))
    train(mon, model, opt, 3)
    mon.close()
    assert mon.checkpoints is None and mon.config.checkpoint_every == 0


def test_an_explicit_zero_cadence_with_a_rollback_runbook_is_warned_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt = make()
    with caplog.at_level(logging.WARNING, logger="stabmon.monitor"):
        mon = Monitor(model, opt, store=None, runbook="default", mode="apply",
                      checkpoint_dir=str(tmp_path / "ckpt"), config=MonitorConfig(checkpoint_every=0))
    mon.close()
    lines = [r.getMessage() for r in caplog.records if "checkpoint_every=0" in r.getMessage()]
    assert len(lines) == 1 and "a rollback fails until you save one" in lines[0]


def test_the_hf_snippet_in_the_docs_gives_rollback_a_checkpoint(tmp_path: Path) -> None:
    """docs/attach.md's HF example: ``checkpoint_dir=`` only. The initial state is saved at the first step."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from test_integrations_hf import dataset, make_args, tiny_model

    from stabmon.integrations.hf import StabmonCallback

    cb = StabmonCallback(store=None, runbook="default", mode="apply", checkpoint_dir=str(tmp_path / "stabmon-ckpt"))
    trainer = transformers.Trainer(model=tiny_model(), args=make_args(tmp_path / "out", max_steps=3),
                                   train_dataset=dataset(32), callbacks=[cb])
    trainer.train()
    assert [c.step for c in cb.monitor.checkpoints.checkpoints] == [1]  # the Trainer's first step is 1
    info, state = cb.monitor.checkpoints.last_known_good(before_step=3)
    assert info.step == 1 and "model" in state


def test_user_checkpoints_keep_a_bounded_number_of_files_by_default(tmp_path: Path) -> None:
    model, opt = make()
    holder: list[Monitor] = []

    def save(step: int) -> str:
        path = tmp_path / f"ckpt-{step:06d}.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "monitor": holder[0].state_dict()},
                   path)
        return str(path)

    ckpts = UserCheckpoints(tmp_path, save=save)
    mon = Monitor(model, opt, store=None, detectors=False, checkpoints=ckpts,
                  config=MonitorConfig(checkpoint_every=2, hang_timeout=None))
    holder.append(mon)
    train(mon, model, opt, 12)
    mon.close()
    on_disk = sorted(p.name for p in tmp_path.glob("ckpt-*.pt"))
    assert len(on_disk) == DEFAULT_USER_KEEP == 3
    assert on_disk == ["ckpt-000008.pt", "ckpt-000010.pt", "ckpt-000012.pt"]


def test_user_checkpoints_keep_none_still_deletes_nothing(tmp_path: Path) -> None:
    model, opt = make()

    def save(step: int) -> Any:
        path = tmp_path / f"ckpt-{step:06d}.pt"
        torch.save({"model": model.state_dict()}, path)
        return path

    ckpts = UserCheckpoints(tmp_path, save=save, keep=None)
    for step in range(0, 10, 2):
        ckpts.save(None, step=step)
    assert len(list(tmp_path.glob("ckpt-*.pt"))) == 5
