"""What a rollback restores and what it keeps: the named states of a checkpoint and their exclusions.

A rollback restores the model, the optimizer, the step and the data position from a checkpoint, and keeps what
describes the run as it is now: the detectors, the engine, the overrides in force, and the alert gates' memory
(which incidents each channel was told about, deduplication times, per-incident counts). A rollback that put the
gates back to the checkpoint's would page again for an incident already paged, and forget to send its
resolution to the channels that heard of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_alerts_support import Receiver, fast

from stabmon.alerts import Notifier
from stabmon.monitor import Monitor, MonitorConfig


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _run_with_an_alert(tmp_path: Path, notifier: Notifier) -> Monitor:
    """12 steps on a tiny model, the loss NaN at step 10 (by construction): the NaN rule fires and the channel
    is told; checkpoints at steps 0 and 5, before any alert."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, opt, store=None, notifier=notifier, checkpoint_dir=str(tmp_path / "ckpt"),
                      config=MonitorConfig(flush_every=6, checkpoint_every=5, hang_timeout=None))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for step, _ in monitor.steps(range(12)):
        loss = model(x).pow(2).mean()
        loss.backward()
        monitor.observe(loss=loss * float("nan") if step == 10 else loss)
        opt.step()
        opt.zero_grad()
    monitor.flush()
    return monitor


def _told(state: dict[str, Any]) -> dict[str, Any]:
    return {name: gate["told"] for name, gate in state["gates"].items()}


def test_a_rollback_keeps_the_alert_gates_memory(tmp_path: Path, receiver: Receiver) -> None:
    notifier = Notifier([f"json://{receiver.netloc}/hook"], config=fast())
    monitor = _run_with_an_alert(tmp_path, notifier)
    try:
        before = notifier.state_dict()
        assert any(_told(before).values()), "the NaN at step 10 was not alerted"
        facts = monitor.rollback(onset_step=10, lookback=5, skip_batches=0)
        assert facts["checkpoint_step"] == 5 and monitor.step == 5  # the training state did go back
        assert notifier.state_dict() == before  # ... and the channel still knows what it was told
    finally:
        monitor.close()
        notifier.close(5)


def test_a_resume_restores_the_alert_gates_memory(tmp_path: Path, receiver: Receiver) -> None:
    first = Notifier([f"json://{receiver.netloc}/hook"], config=fast())
    monitor = _run_with_an_alert(tmp_path, first)
    saved = monitor.state_dict()
    monitor.close()
    first.close(5)
    second = Notifier([f"json://{receiver.netloc}/hook"], config=fast())
    model = torch.nn.Linear(4, 1)
    resumed = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.01), store=None, notifier=second,
                      config=MonitorConfig(hang_timeout=None), resume=saved)
    try:
        assert _told(second.state_dict()) == _told(saved["notifier"])
        assert any(_told(second.state_dict()).values())
        assert resumed.step == 12
    finally:
        resumed.close()
        second.close(5)


FORMAT_1 = {"version", "step", "data", "overrides", "pipeline", "executor", "follower", "hooks", "embeddings",
            "notifier", "run_id", "run_name", "checkpoints"}
"""The monitor state's entries since format version 1: checkpoints saved by earlier releases hold these."""


def test_the_monitor_state_keeps_format_1(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 1)
    monitor = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.01), store=None, runbook="default",
                      checkpoint_dir=str(tmp_path), config=MonitorConfig(hang_timeout=None))
    try:
        state = monitor.state_dict()
        # format 1 and one entry added since, which a format-1 state without it leaves empty on load
        assert set(state) == FORMAT_1 | {"pending"} and state["version"] == 1
        assert set(monitor.training_state()) == {"model", "optimizer", "scaler", "scheduler", "monitor"}
    finally:
        monitor.close()


def test_a_format_1_state_written_as_a_dict_resumes(tmp_path: Path) -> None:
    """A state as an earlier release wrote it (a plain dict, some entries None) loads into a new monitor."""
    model = torch.nn.Linear(4, 1)
    first = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.01), store=None, runbook="default",
                    config=MonitorConfig(hang_timeout=None))
    saved = {**first.state_dict(), "step": 40, "data": {"position": 40, "skip": [3, 4]},
             "overrides": {"lr_scale": 0.5}, "embeddings": None, "notifier": None, "checkpoints": None}
    first.close()
    second = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.01), store=None, runbook="default",
                     config=MonitorConfig(hang_timeout=None), resume=saved)
    try:
        assert (second.step, second.cursor.position, second.cursor.skip) == (40, 40, {3, 4})
        assert second.overrides.lr_scale == 0.5
    finally:
        second.close()
