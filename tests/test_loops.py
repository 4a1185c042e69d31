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
    (no_checkpoints,) = [line for line in lines if "rollback needs checkpoints" in line]  # one line for all
    assert "rule loss_scale_collapse rung 1, rule instability rung 7 dropped from the ladder" in no_checkpoints
    caplog.clear()
    with caplog.at_level("WARNING", logger="stabmon"):
        Monitor(model, optimizer, store=None, runbook="palm-rollback", mode="apply").close()
    assert any("needs checkpoints" in r.getMessage() for r in caplog.records)


def test_propose_mode_without_alerts_prints_one_line_with_the_commands_that_answer(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    import shlex

    from typer.testing import CliRunner

    from stabmon.cli import app
    from stabmon.events import Anomaly, Severity
    from stabmon.factory import NullDetectors
    from stabmon.runbook import loads_runbook

    class LossAbove(NullDetectors):
        def update(self, record):  # type: ignore[no-untyped-def]
            loss = record.get("loss")
            if loss is None or loss < 100:
                return []
            return [Anomaly(kind="spike", metric="loss", step=record.step, score=loss, severity=Severity.ERROR,
                            detector="test")]

    runbook = loads_runbook("name: p\nmode: propose\nrules:\n  - name: r\n    when: {kind: spike}\n"
                            "    ladder: [{action: set_clip, params: {max_norm: 0.5}, observe: 5}]\n")
    url = f"sqlite:///{tmp_path / 'p.db'}"
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with caplog.at_level("WARNING", logger="stabmon"):
        with Monitor(model, optimizer, store=url, runbook=runbook, mode="propose", detectors=LossAbove()) as mon:
            for step, _ in mon.steps(range(30)):
                mon.observe(loss=torch.tensor(500.0 if step == 12 else 1.0))
                model(torch.ones(2)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    (line,) = [r.getMessage() for r in caplog.records if "waits for an answer" in r.getMessage()]
    assert "set_clip(max_norm=0.5)" in line
    approve = line.split("; ", 1)[1].split("  |  ")[0]
    args = shlex.split(approve)
    assert args[:2] == ["stabmon", "approve"]
    res = CliRunner().invoke(app, args[1:])
    assert res.exit_code == 0, res.output


def test_the_monitor_names_every_problem_of_a_bad_runbook_on_one_line(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nrules:\n  - name: r\n    ladder:\n      - action: set_clip\n        observe: -1\n")
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError) as info:
        Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=None, runbook=str(bad))
    message = str(info.value)
    assert "\n" not in message and message.startswith("runbook: 2 problems: ")
    assert f"{bad}:5: rules[0].ladder[0].params: Field required" in message
    assert f"{bad}:6: rules[0].ladder[0].observe: Input should be greater than or equal to 1" in message
