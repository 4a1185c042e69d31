"""The loop's own checkpoints (UserCheckpoints), checkpoints that survive a resume into another directory, a
failed rollback as one line followed by the runbook's next rung, and a resume that would restart the step count."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from stabmon.checkpoints import NoValidCheckpointError, UserCheckpoints
from stabmon.monitor import Monitor, MonitorConfig
from stabmon.store import Store


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(mon: Monitor, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, *, nan_at: int = -1) -> None:
    for _ in range(steps):
        mon.begin_step()
        x = torch.randn(16, 4)
        loss = model(x).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss * float("nan") if mon.step >= nan_at >= 0 else loss)
        opt.step()
        opt.zero_grad()
        mon.end_step()


def saver(directory: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, mon: list[Monitor]) -> Any:
    def save(step: int) -> str:  # the loop's own dict, in nanoGPT's shape
        path = directory / f"ckpt-{step:06d}.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": step,
                    "best_val_loss": 1.0, "monitor": mon[0].state_dict()}, path)
        return str(path)

    return save


def test_user_checkpoints_validate_like_the_monitors_own(tmp_path: Path) -> None:
    model, opt = make()
    holder: list[Monitor] = []
    loads: list[str] = []
    ckpts = UserCheckpoints(tmp_path, save=saver(tmp_path, model, opt, holder),
                            load=lambda p: loads.append(p) or torch.load(p, weights_only=True))
    mon = Monitor(model, opt, store=None, checkpoints=ckpts, config=MonitorConfig(checkpoint_every=5))
    holder.append(mon)
    train(mon, model, opt, 12)
    assert [c.step for c in ckpts.checkpoints] == [0, 5, 10]
    Path(ckpts.checkpoints[-1].path).write_bytes(b"truncated")  # newest: wrong byte count
    with torch.no_grad():
        model[0].weight.fill_(float("nan"))
    result = mon.rollback(onset_step=11, lookback=0, skip_batches=0)
    assert result["checkpoint_step"] == 5 and mon.step == 5  # step 10 refused, step 5 restored through load
    assert loads and loads[-1].endswith("ckpt-000005.pt")
    assert torch.isfinite(model[0].weight).all()
    mon.close()


def test_a_user_checkpoint_without_the_monitor_state_is_refused(tmp_path: Path) -> None:
    model, opt = make()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    ckpts = UserCheckpoints(tmp_path, existing=lambda: [(0, path)])
    mon = Monitor(model, opt, store=None, checkpoints=ckpts)
    with pytest.raises(NoValidCheckpointError, match=r"holds no monitor state \(save monitor.state_dict\(\)"):
        mon.rollback(onset_step=3, lookback=0, skip_batches=0)
    mon.close()


def test_callables_are_checked() -> None:
    with pytest.raises(ValueError, match=r"^checkpoints\.save must be callable, got str$"):
        UserCheckpoints(".", save="ckpt.pt")  # type: ignore[arg-type]


def test_checkpoints_survive_a_resume_into_another_directory(tmp_path: Path) -> None:
    model, opt = make()
    mon = Monitor(model, opt, store=None, checkpoint_dir=str(tmp_path / "a"),
                  config=MonitorConfig(checkpoint_every=10, checkpoint_keep=5))
    train(mon, model, opt, 50)
    state = mon.training_state()
    mon.close()

    model2, opt2 = make()
    mon2 = Monitor(model2, opt2, store=None, checkpoint_dir=str(tmp_path / "b"),
                   config=MonitorConfig(checkpoint_every=10))
    mon2.load_training_state(state)
    train(mon2, model2, opt2, 20)  # saves 60 and 70 in the new directory
    result = mon2.rollback(onset_step=55, lookback=0, skip_batches=0)
    assert result["checkpoint_step"] == 50 and "/a/" in result["checkpoint_path"]
    with pytest.raises(NoValidCheckpointError, match=r"no valid checkpoint at or before step -1 .*registered after"):
        mon2.checkpoints.last_known_good(before_step=-1)
    mon2.close()


def test_a_failed_rollback_is_one_line_and_the_next_rung_follows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    model, opt = make()
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    ckpts = UserCheckpoints(tmp_path / "none")  # no save, nothing registered
    mon = Monitor(model, opt, store=store, runbook="palm-rollback", mode="apply", checkpoints=ckpts,
                  config=MonitorConfig(flush_every=5))
    with caplog.at_level(logging.INFO, logger="stabmon"):
        train(mon, model, opt, 80, nan_at=60)
    mon.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and "rollback" in r.getMessage()]
    assert errors and all(r.exc_info is None and "\n" not in r.getMessage() for r in errors)
    assert "no valid checkpoint" in errors[0].getMessage()
    assert "Traceback" not in capsys.readouterr().out + caplog.text
    from stabmon.store import repo

    assert store.flush(timeout=30)
    with store.session() as s:
        events = repo.load_events(session=s, run_id=mon.run_id)
    actions = [getattr(e, "action", None) for e in events if type(e).__name__ == "Decision"]
    assert actions[:3] == ["rollback", "rollback", "checkpoint_and_stop"], actions  # the ladder, then on_failure
    failed = [e for e in events if type(e).__name__ == "InterventionRecord" and e.error is not None]
    assert len(failed) == 2 and "NoValidCheckpointError" in failed[0].error
    store.close()


def test_a_resume_that_would_restart_the_step_count_refuses_its_first_step(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    model, opt = make()
    mon = Monitor(model, opt, store=url, config=MonitorConfig(flush_every=5))
    train(mon, model, opt, 12)
    run_id, state = mon.run_id, mon.state_dict()
    mon.close()

    forgot = Monitor(model, opt, store=url, resume_run_id=run_id)
    with pytest.raises(ValueError, match=rf"^resume_run_id='{run_id}': the run already holds steps up to 11 but "
                                         r"the monitor starts at step 0; load the monitor's saved state"):
        train(forgot, model, opt, 1)
    forgot.close()
    resumed = Monitor(model, opt, store=url, resume=state)
    assert resumed.run_id == run_id and resumed.step == 12
    train(resumed, model, opt, 3)
    resumed.close()
    synced = Monitor(model, opt, store=url, resume_run_id=run_id)
    synced.sync_step(15)
    train(synced, model, opt, 2)
    synced.close()
    store = Store(url)
    from stabmon.store import repo

    with store.session() as s:
        steps = [r.step for r in repo.load_steps(session=s, run_id=run_id)]
    store.close()
    assert steps == list(range(17))  # the refused start wrote nothing
