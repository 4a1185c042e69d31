"""End to end through the store: the lr-too-high scenario under the default runbook, read back with
``stabmon trace``. The run is wrecked from its first steps (a peak learning rate 100x too high: every seed fails,
see docs/recovery.md); the default runbook restarts it from the initial checkpoint with the learning rate capped at
half the one in force, judges each restart before the next, and keeps halving the cap until the run learns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from stabmon.cli.demo import load_example

pytestmark = pytest.mark.slow


def test_default_runbook_restarts_a_wrecked_run_with_a_halving_lr_cap_one_attempt_at_a_time(
    sqlite_url: str, tmp_path: Path
) -> None:
    from stabmon.cli import app
    from stabmon.monitor import Monitor, MonitorConfig

    sc = load_example("scenarios")
    seed = 44
    config = sc.scenario("lr-too-high").config(seed)
    healthy = sc.tiny_gpt.train(sc.scenario("lr-too-high").healthy_config(seed))

    def factory(model: Any, opt: Any, sched: Any) -> Monitor:
        return Monitor(model, opt, scheduler=sched, store=sqlite_url, runbook="default", mode="apply",
                       config=MonitorConfig(clip=config.clip, checkpoint_every=25, checkpoint_keep=40),
                       checkpoint_dir=str(tmp_path), run_name="tiny-gpt-lr-too-high")

    monitored = sc.tiny_gpt.train(config, monitor=factory)
    summary = f"healthy {healthy.val_loss:.4f}, monitored {monitored.val_loss:.4f}"
    assert monitored.val_loss <= 1.1 * healthy.val_loss, summary
    assert monitored.monitor.step == config.steps and monitored.steps > config.steps  # restarts cost steps

    result = CliRunner().invoke(app, ["trace", monitored.monitor.run_id, "--db", sqlite_url, "--json"])
    assert result.exit_code == 0, result.output
    incidents = json.loads(result.output)["incidents"]
    steps = [s for inc in incidents for s in inc["steps"] if s["intervention"] is not None]
    changes = [s for s in steps if s["decision"]["action"] not in ("alert_only", "release")
               and "not_applied" not in s["intervention"]["after"]]  # a rung not applicable changed nothing
    assert changes, summary
    # once resolved, the caps are released: the newer ones at once, the first held until the schedule is below
    # the LR the trouble began at (a warm-up still climbing past the edge would bring it straight back)
    (release,) = [s for s in steps if s["decision"]["action"] == "release"]
    assert "lifted_below_lr" in release["intervention"]["after"], release
    for step in changes:  # each a restart from the initial state with the LR capped at half the one in force
        assert step["decision"]["action"] == "rollback" and step["decision"]["params"]["lr_cap"] == 0.5
        assert step["intervention"]["after"]["checkpoint_step"] == 0
    caps = [s["intervention"]["after"]["lr_cap"] for s in changes]
    assert caps[0] <= 0.5 * config.lr and all(b <= 0.5 * a * 1.0001 for a, b in zip(caps, caps[1:], strict=False))
    # one change at a time: each attempt was judged before the next was decided, and the last one resolved it
    for earlier, later in zip(changes, changes[1:], strict=False):
        assert earlier["outcome"] is not None and earlier["outcome"]["verdict"] == "escalated"
        assert earlier["outcome"]["step"] <= later["decision"]["step"]
    assert changes[-1]["outcome"]["verdict"] == "resolved", changes[-1]
    assert "attempt" in changes[-1]["decision"]["reason"] or len(changes) == 1
