"""Fitting real training loops: gradient accumulation (one observed loss per micro-batch)."""

from __future__ import annotations

import pytest
import torch

from stabmon.monitor import Monitor


@pytest.mark.parametrize("as_tensor", [True, False])
def test_a_loss_observed_per_micro_batch_is_recorded_as_their_mean(as_tensor: bool) -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = Monitor(model, optimizer, store=None)
    micro_losses = [[1.0, 2.0], [4.0, 0.0, 2.0]]
    for _, micro in monitor.steps(micro_losses):
        for value in micro:
            loss = model(torch.ones(2)).sum() * 0 + value
            loss.backward()
            monitor.observe(loss=loss if as_tensor else float(value))
        optimizer.step()
        optimizer.zero_grad()
    records = monitor.flush()
    monitor.close()
    assert [r.metrics["loss"] for r in records] == [pytest.approx(1.5), pytest.approx(2.0)]


def test_the_monitor_warns_at_start_about_rungs_that_cannot_act_on_this_optimizer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from stabmon.collect.config import MonitorConfig

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    with caplog.at_level("WARNING", logger="stabmon"):
        Monitor(model, optimizer, store=None, runbook="opt175b", mode="apply", config=MonitorConfig(clip=1.0)).close()
    lines = [r.getMessage() for r in caplog.records if "runbook opt175b" in r.getMessage()]
    unfit = [line for line in lines if "would not" in line or "has no" in line]
    assert len(unfit) == 4 and "set_clip to 1.5 would not lower clip (1 in force)" in unfit[0]
    assert sum("rollback needs checkpoints" in line for line in lines) == 2
    caplog.clear()
    with caplog.at_level("WARNING", logger="stabmon"):
        Monitor(model, optimizer, store=None, runbook="palm-rollback", mode="apply").close()
    assert any("needs checkpoints" in r.getMessage() for r in caplog.records)
