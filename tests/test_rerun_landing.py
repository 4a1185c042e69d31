"""The restart after a transient fault lands on the state the diagnosis' re-run trained again, not on the checkpoint
the re-run started from (:mod:`stabmon.collect.checkpoint.landing`).

The fault is there by construction: flaky-gpu's forward hook puts an inf in the first block's output the first time
step 110 runs (checkpoints every 25 steps, so the re-run starts at step 100). Another seed or thread count:
``STABMON_TEST_SEED=7 STABMON_TEST_THREADS=2 pytest tests/test_rerun_landing.py``.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from scenario_support import scenarios

from stabmon.collect.batches import BatchLog
from stabmon.collect.checkpoint.landing import PREFIX, RerunLanding
from stabmon.collect.checkpoint.restore import ROLLBACK, TrainingState
from stabmon.collect.run_state import RunState
from stabmon.events import InterventionRecord, StepRecord
from stabmon.monitor import Monitor, MonitorConfig
from stabmon.runbook.trace import diagnosis_lines

SEED = int(os.environ.get("STABMON_TEST_SEED", "5"))
THREADS = int(os.environ.get("STABMON_TEST_THREADS", "1"))
FAULT = 110




class Watched(Monitor):
    """A monitor that keeps the training state at the start of step :data:`FAULT` each time the run gets there (the
    last one is the state the run went on from after its restart)."""

    seen: list[dict[str, Any]]

    def begin_step(self, **kwargs: Any) -> None:
        super().begin_step(**kwargs)
        if self.run.step == FAULT:
            self.seen.append({
                "params": [p.detach().clone() for p in self.model.parameters()],
                "moments": [s["exp_avg_sq"].clone() for s in self.optimizer.state.values()],
                "lr": [g["lr"] for g in self.optimizer.param_groups],
                "last_epoch": self.scheduler.last_epoch, "position": self.cursor.position})


def train(tmp_path: Path, steps: int = 125) -> Any:
    sc = scenarios()
    config = sc.scenario("flaky-gpu").config(SEED, steps=steps, threads=THREADS)

    def factory(model: Any, opt: Any, sched: Any) -> Monitor:
        monitor = Watched(model, opt, scheduler=sched, store=None, runbook="default", mode="apply",
                          config=MonitorConfig(clip=config.clip, checkpoint_every=25, checkpoint_keep=40),
                          checkpoint_dir=str(tmp_path))
        monitor.seen = []
        return monitor

    return sc.tiny_gpt.train(config, monitor=factory)


def records(result: Any, action: str) -> list[InterventionRecord]:
    return [e for e in result.monitor.events if isinstance(e, InterventionRecord) and e.action == action]


def test_a_transient_fault_restarts_from_the_re_run_and_goes_on_as_from_the_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The re-run from step 100 trained steps 100-109 again and found step 110 does not reproduce: the restart lands
    there (3 steps trained again instead of 13), and the run goes on from the same state a restart from the
    checkpoint of step 100 reaches once it has trained those steps again: the same step, data position and
    schedule, the same weights and Adam moments to the re-run's tolerance, and by the end the same skip-guard mean."""
    landed = train(tmp_path / "landed")
    (diagnosis,) = records(landed, "diagnose")
    assert diagnosis.after["verdict"] == "hardware_suspect"
    assert diagnosis.after["checkpoint_step"] == 100 and diagnosis.after["cleared_step"] == FAULT
    assert diagnosis.after["landing"] == {"step": FAULT}
    (rollback,) = records(landed, "rollback")
    assert rollback.after["checkpoint_path"] == f"{PREFIX}{FAULT}" and rollback.after["checkpoint_step"] == FAULT
    assert rollback.after["landed_on_rerun"] == [100, FAULT]
    assert rollback.after["from_step"] - rollback.after["checkpoint_step"] < 5  # not 100's 13
    assert Path(rollback.after["rolled_back_state"]).is_file()  # a resume goes on from the state it landed on
    lines = diagnosis_lines({"step": diagnosis.step, "after": diagnosis.after})
    assert f"               the re-run's state at step {FAULT} kept for the restart" in lines, lines

    monkeypatch.setattr(RerunLanding, "offer", lambda self, **kw: "turned off for the twin")
    twin = train(tmp_path / "twin")
    (twin_rollback,) = records(twin, "rollback")
    assert twin_rollback.after["checkpoint_step"] == 100 and "landed_on_rerun" not in twin_rollback.after
    refused = records(twin, "diagnose")[0]
    assert refused.after["landing"] == {"step": FAULT, "refused": "turned off for the twin"}
    assert any(line.endswith("not kept for the restart: turned off for the twin")
               for line in diagnosis_lines({"step": refused.step, "after": refused.after}))

    a, b = landed.monitor.seen[-1], twin.monitor.seen[-1]  # the state each went on from at step 110
    assert len(landed.monitor.seen) == len(twin.monitor.seen) == 2  # (the faulted execution, then the good one)
    assert (a["lr"], a["last_epoch"], a["position"]) == (b["lr"], b["last_epoch"], b["position"])
    for x, y in zip(a["params"] + a["moments"], b["params"] + b["moments"], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-7)
    assert landed.monitor.step == twin.monitor.step
    # the skip guard's mean, fed the steps trained again by the landing and by the twin's flushes, once all flushed
    ema = [r.monitor.signals.hooks.guard.ema_host for r in (landed, twin)]
    assert ema[0] == pytest.approx(ema[1], rel=1e-4)
    assert landed.val_loss == pytest.approx(twin.val_loss, rel=1e-3)


# -- when a landing is refused, and how long it lives ---------------------------------------------------------------
def _bench(*, counts_steps: bool = True, scheduler: str | None = "lambda") -> tuple[RerunLanding, dict[str, Any]]:
    """A landing over a small model at step 9, its checkpoint of step 5 (a LambdaLR stepped once a step)."""
    from stabmon.collect.build import build_training_state
    from stabmon.collect.checkpoint.restore import NamedStates

    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched: Any = None
    if scheduler == "lambda":
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    elif scheduler == "plateau":
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    model(torch.ones(3)).sum().backward()
    optimizer.step()  # (Adam's moments exist, as in a run)
    run = RunState(step=9)
    training = build_training_state(model, optimizer, scaler=None, scheduler=sched,
                                    monitor_state=NamedStates({}), counts_steps=counts_steps)
    saved_sched = None
    if scheduler == "lambda":
        for _ in range(5):
            sched.step()
        saved_sched = dict(sched.state_dict())
        for _ in range(4):
            sched.step()
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": None,
                  "scheduler": saved_sched, "monitor": {"step": 5, "data": {"position": 5, "skip": []}}}
    return RerunLanding(training, run), checkpoint


def _offer(landing: RerunLanding, checkpoint: dict[str, Any], start: int = 5, stop: int = 8,
           optimizer: Any = None) -> str | None:
    log = BatchLog(capacity=16)
    for s in range(10):
        log.remember(step=s, batch_index=s, batch=[s])
    trained = {"model": {k: v + 1 for k, v in checkpoint["model"].items()},
               "optimizer": optimizer or copy.deepcopy(checkpoint["optimizer"])}
    recorded = {s: StepRecord(s, {"grad_norm": 1.0}) for s in range(10)}
    return landing.offer(checkpoint=checkpoint, start=start, stop=stop, trained=trained, recorded=recorded,
                         batches=log)


def test_a_landing_is_the_checkpoint_moved_to_its_step_and_lives_for_its_flush() -> None:
    landing, checkpoint = _bench()
    landing.run.cursor.drawing = True
    assert _offer(landing, checkpoint) is None
    held = landing.held
    assert held is not None and held.info.step == 8 and held.info.path == f"{PREFIX}8"
    assert held.state["monitor"]["step"] == 8 and held.state["monitor"]["data"]["position"] == 8
    assert held.state["scheduler"]["last_epoch"] == 8  # the checkpoint's (5) stepped three times
    sched = landing.training.states["scheduler"]
    assert sched.last_epoch == 9 and landing.training.optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
    # a rollback takes it only at or after its step, and only when no checkpoint it could land on is newer
    check = landing.training.mismatch
    assert landing.take(7, newest=5, check=check) is None and landing.take(9, newest=9, check=check) is None
    assert landing.take(9, newest=5, check=check) is held and landing.held is None  # taken once
    assert _offer(landing, checkpoint) is None
    landing.drop()
    assert landing.take(9, newest=None, check=check) is None


@pytest.mark.parametrize(("setup", "expected"), [
    ({"counts_steps": False}, "a framework counts the steps"),
    ({"scheduler": "plateau"}, "the scheduler (ReduceLROnPlateau) is not one stepped once per optimizer step"),
])
def test_a_landing_that_cannot_be_exact_is_refused_in_one_line(setup: dict[str, Any], expected: str) -> None:
    landing, checkpoint = _bench(**setup)
    why = _offer(landing, checkpoint)
    assert why is not None and why.startswith(expected) and "\n" not in why and landing.held is None


def test_a_scheduler_not_stepped_once_a_step_or_data_drawn_elsewhere_is_refused() -> None:
    landing, checkpoint = _bench()
    landing.run.step = 12  # the scheduler moved 4 steps since the checkpoint, the run 7
    assert "not stepped once per optimizer step" in (_offer(landing, checkpoint) or "")
    landing, checkpoint = _bench()
    landing.run.cursor.drawing = True
    checkpoint["monitor"]["data"]["position"] = 3  # batches 3 and 4 were drawn after the checkpoint, not skipped
    assert "is not that of step 5's batch" in (_offer(landing, checkpoint) or "")
    checkpoint["monitor"]["data"]["skip"] = [3, 4]  # skipped: the next batch drawn is still step 5's
    assert _offer(landing, checkpoint) is None
    assert "did not reproduce its first step" in (_offer(landing, checkpoint, start=5, stop=5) or "")
    # the re-run's optimizer state must be its own: one the restore wrote the live state into would be the run's
    live = landing.training.optimizer.state_dict()
    assert "restored in place" in (_offer(landing, checkpoint, optimizer=live) or "")
    assert ROLLBACK in landing.training.exclude and isinstance(landing.training, TrainingState)
