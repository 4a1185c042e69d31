"""End to end on examples/tiny_gpt.py: its unstable setting, monitored with runbooks/opt175b.yaml in apply
mode, recovers to within 10% of the stable baseline while the unmonitored run diverges or ends at least 2x
worse; the trace shows one intervention at a time, each with an outcome. The setting diverges a few steps after
its first flagged spike, so the ladder's changes alone do not pull it back: the ladder's last rung rolls back to a
checkpoint from before the onset with every change still in force, as OPT restarted with its changes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def tiny_gpt() -> ModuleType:
    path = REPO / "examples" / "tiny_gpt.py"
    if not path.is_file():
        pytest.fail("examples/tiny_gpt.py is missing")
    spec = importlib.util.spec_from_file_location("tiny_gpt_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_opt175b_recovers_the_unstable_tiny_gpt(sqlite_url: str, tmp_path: Path) -> None:
    from stabmon.cli import app
    from stabmon.monitor import Monitor, MonitorConfig

    tg = tiny_gpt()
    stable = tg.train(tg.TrainConfig())
    config = tg.unstable(tg.TrainConfig())
    unmonitored = tg.train(config)

    def factory(model: Any, opt: Any, sched: Any) -> Monitor:
        return Monitor(model, opt, scheduler=sched, store=sqlite_url, runbook="opt175b", mode="apply",
                       config=MonitorConfig(clip=config.clip, checkpoint_every=50, checkpoint_keep=6),
                       checkpoint_dir=str(tmp_path), run_name="tiny-gpt-opt175b")

    monitored = tg.train(config, monitor=factory)
    summary = (f"stable {stable.final_loss:.4f}, unmonitored {unmonitored.final_loss:.4f}, "
               f"monitored {monitored.final_loss:.4f}")
    assert unmonitored.diverged or unmonitored.final_loss >= 2 * stable.final_loss, summary
    assert monitored.final_loss <= 1.1 * stable.final_loss, summary

    result = CliRunner().invoke(app, ["trace", monitored.monitor.run_id, "--db", sqlite_url, "--json"])
    assert result.exit_code == 0, result.output
    incidents = json.loads(result.output)["incidents"]
    changes = [s for inc in incidents for s in inc["steps"] if s["intervention"] is not None]
    assert changes, summary
    # one intervention at a time: each change is judged before the next one is decided and made. A rollback's
    # record carries the step it restored; the step it was made at is in its "before" values.
    for earlier, later in zip(changes, changes[1:], strict=False):
        if earlier["decision"]["action"] == "revert":
            continue
        assert earlier["outcome"] is not None
        made_at = later["intervention"]["step"]
        if later["intervention"]["action"] == "rollback":
            made_at = later["intervention"]["before"]["step"]
        assert earlier["outcome"]["step"] <= later["decision"]["step"] <= made_at
    engine = monitored.monitor.pipeline.engine
    unjudged = [s for s in changes if s["outcome"] is None and s["decision"]["action"] != "revert"]
    assert len(unjudged) <= (1 if engine.busy else 0)  # only a change still under observation at the end

    # the ladder's order from the OPT logbook, and what cured the run: the changes stay in force through the
    # rollback to a checkpoint from before the onset
    actions = [s["decision"]["action"] for s in changes]
    ladder = ["set_clip", "set_clip", "set_beta2", "set_weight_decay", "scale_lr", "scale_lr", "rollback"]
    assert actions == ladder[: len(actions)], actions
    if "rollback" in actions:
        rollback = changes[actions.index("rollback")]
        assert rollback["intervention"]["after"]["checkpoint_step"] <= rollback["decision"]["params"]["onset_step"]
        assert rollback["outcome"]["verdict"] == "resolved"
        o = monitored.monitor.overrides
        assert (o.max_norm, o.beta2, o.weight_decay, o.lr_scale) == (1.0, 0.95, 0.1, pytest.approx(0.667))
