"""Interventions on the live Monitor: scale_lr holds under LR schedulers and across a resume; rollback picks
the
previous good checkpoint when the newest is corrupt, skips batches and records them."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler as sch

from stabmon.events import Decision, DecisionStatus
from stabmon.interventions import Executor
from stabmon.monitor import Monitor, MonitorConfig

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "cosine": lambda o: sch.CosineAnnealingLR(o, T_max=20),
    "onecycle": lambda o: sch.OneCycleLR(o, max_lr=0.05, total_steps=60),
    "lambda": lambda o: sch.LambdaLR(o, lambda s: 0.95**s),
    "warmup_chain": lambda o: sch.SequentialLR(
        o, [sch.LinearLR(o, start_factor=0.1, total_iters=5), sch.CosineAnnealingLR(o, T_max=30)],
        milestones=[5]),
}


def decision(action: str, params: dict[str, Any]) -> Decision:
    return Decision(step=0, action=action, params=params, status=DecisionStatus.APPLY, runbook="test",
                    rule="r",
                    rung=0, reason="test")


def setup(make_sched: Callable[[torch.optim.Optimizer], Any], seed: int = 0) -> tuple[Any, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt, make_sched(opt)


def lr_probe(opt: torch.optim.Optimizer) -> list[float]:
    """Records the learning rate the optimizer actually uses: a pre-hook registered after the monitor's."""
    used: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: used.append(o.param_groups[0]["lr"]))
    return used


def train(mon: Monitor, model: Any, opt: Any, sched: Any, n: int) -> None:
    data = [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    for _, x in mon.steps(data):
        loss = model(x).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        sched.step()
        opt.zero_grad()


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scale_lr_holds_under_schedulers_and_across_resume(name: str) -> None:
    make = SCHEDULERS[name]
    ref_model, ref_opt, ref_sched = setup(make)  # the scheduler's own trajectory, unmonitored
    model, opt, sched = setup(make)
    mon = Monitor(model, opt, scheduler=sched, store=None, detectors=False,
                  config=MonitorConfig(flush_every=5))
    used = lr_probe(opt)
    expected: list[float] = []

    def ref_steps(n: int, scale: float) -> None:
        for _ in range(n):
            expected.append(ref_opt.param_groups[0]["lr"] * scale)
            ref_opt.step()
            ref_sched.step()

    train(mon, model, opt, sched, 10)
    ref_steps(10, 1.0)
    rec = Executor(mon.handle).execute(decision("scale_lr", {"factor": 0.5}))
    assert rec.error is None and rec.after["lr_scale"] == 0.5
    train(mon, model, opt, sched, 10)
    ref_steps(10, 0.5)
    assert used == pytest.approx(expected, rel=1e-12)
    # the scheduler's value is back in the param group after every step: its trajectory continues underneath
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"], rel=1e-12)
    assert mon.records[-1].get("lr") == pytest.approx(expected[-1], rel=1e-12)

    state = mon.training_state()
    mon.close()
    # resume into fresh objects: the override comes back with the monitor state and keeps holding
    model2, opt2, sched2 = setup(make, seed=1)
    mon2 = Monitor(model2, opt2, scheduler=sched2, store=None, detectors=False,
                   config=MonitorConfig(flush_every=5))
    mon2.load_training_state(state)
    assert mon2.overrides.lr_scale == 0.5 and mon2.step == 20
    used2 = lr_probe(opt2)
    train(mon2, model2, opt2, sched2, 10)
    ref_steps(10, 0.5)
    assert used2 == pytest.approx(expected[20:], rel=1e-12)
    mon2.close()


def checkpointed_run(tmp_path: Path, store: Any = None) -> tuple[Monitor, Any, Any, list[int]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = Monitor(model, opt, store=store, detectors=False, checkpoint_dir=str(tmp_path / "ckpt"),
                  config=MonitorConfig(flush_every=5, checkpoint_every=5))
    return mon, model, opt, []


def feed(mon: Monitor, model: Any, opt: Any, data: list[torch.Tensor], seen: list[int],
         max_steps: int) -> None:
    for _, x in mon.steps(data, max_steps=max_steps):
        seen.append(int(x[0, 0].item()))  # each batch carries its own index (test bookkeeping only)
        loss = model(x[:, 1:]).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()


def indexed_data(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.cat([torch.full((8, 1), float(i)), torch.randn(8, 4, generator=g)], dim=1)
            for i in range(n)]


@pytest.mark.parametrize("corruption", ["truncate", "nan"])
def test_rollback_skips_a_corrupt_newest_checkpoint(tmp_path: Path, corruption: str, sqlite_url: str) -> None:
    from stabmon.store import open_store, repo

    store = open_store(sqlite_url)
    mon, model, opt, seen = checkpointed_run(tmp_path, store)
    data = indexed_data(100)
    feed(mon, model, opt, data, seen, max_steps=20)
    steps = [c.step for c in mon.checkpoints.checkpoints]
    assert steps == [10, 15, 20]  # keep=3
    newest = mon.checkpoints.checkpoints[-1]
    if corruption == "truncate":
        raw = Path(newest.path).read_bytes()
        Path(newest.path).write_bytes(raw[:-100])
    else:
        state = torch.load(newest.path, weights_only=True)
        state["model"]["weight"][0, 1] = math.nan
        torch.save(state, newest.path)
        mon.checkpoints.register(newest.path, step=20)  # same size is possible; NaN is still caught
    params = {"onset_step": 20, "lookback": 0, "skip_batches": 7}
    rec = Executor(mon.handle).execute(decision("rollback", params))
    assert rec.error is None, rec.error
    assert rec.after["checkpoint_step"] == 15 and rec.after["restored_step"] == 15 and mon.step == 15
    skipped = list(range(*rec.after["skipped"]))
    assert skipped == list(range(15, 22))
    after: list[int] = []
    feed(mon, model, opt, data, after, max_steps=30)
    assert after == list(range(22, 37))  # 15 more steps; the skipped batches were never fed
    assert all(math.isfinite(v) for v in model.weight.detach().flatten().tolist())
    mon.close()
    store.flush(timeout=10)
    with store.session() as s:
        recorded = repo.skipped_batches(session=s, run_id=mon.run_id)
        checkpoints = repo.list_checkpoints(session=s, run_id=mon.run_id)
    store.close()
    assert sorted(b for _, b in recorded) == skipped
    assert any(c["step"] == 20 and not c["valid"] for c in checkpoints)


def test_rollback_without_any_valid_checkpoint_is_recorded_not_raised(tmp_path: Path) -> None:
    mon, model, opt, seen = checkpointed_run(tmp_path)
    feed(mon, model, opt, indexed_data(20), seen, max_steps=10)
    for c in mon.checkpoints.checkpoints:
        Path(c.path).unlink()
    ex = Executor(mon.handle)
    rec = ex.execute(decision("rollback", {"onset_step": 10, "lookback": 0, "skip_batches": 0}))
    assert rec.error.startswith("NoValidCheckpointError: no valid checkpoint at or before step 10")
    assert ex.errors == 1 and mon.step == 10
    mon.close()
