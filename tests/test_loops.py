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
