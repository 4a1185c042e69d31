"""Replay: the live pipeline classes over recorded records, interventions simulated; CLI import/replay."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stabmon.events import Anomaly, Decision, DecisionStatus, InterventionRecord, Severity, StepRecord
from stabmon.pipeline import Pipeline
from stabmon.replay.replay import canonical, event_rows, replay, simulated_pipeline
from stabmon.replay.simulate import Simulation

FAIRSEQ = "fairseq-fsdp-13b-readme/gpt3-13b_1xV100_cpu-offload.log"


def spiky_records(n: int = 400, spike_at: int = 300) -> list[StepRecord]:
    """A smooth decaying loss with small deterministic wiggle and one grad-norm + loss spike."""
    out = []
    for s in range(n):
        wiggle = 0.01 * math.sin(s * 0.7)
        loss = 3.0 + 2.0 * math.exp(-s / 80) + wiggle
        norm = 0.5 + 0.05 * math.cos(s * 1.3)
        if spike_at <= s < spike_at + 4:
            norm *= 40.0
            loss += 3.0
        out.append(StepRecord(step=s, metrics={"loss": loss, "grad_norm": norm, "lr": 3e-4}))
    return out


# -- simulated target ------------------------------------------------------------------------------
def test_simulated_target_rollback_and_stop() -> None:
    t = Simulation(checkpoint_interval=250)
    t.begin_block([StepRecord(step=1233, metrics={"lr": 1e-3}, batch_index=4999)])
    got = t.rollback(onset_step=1200, lookback=100, skip_batches=300)
    assert got["checkpoint_step"] == 1000 and got["skipped_batches"] == [5000, 5300]
    assert got["steps_lost"] == 234
    t.overrides.lr_scale = 0.5
    assert t.hparams()["lr"] == pytest.approx(5e-4)
    assert t.checkpoint_and_stop(reason="x")["stopped_at"] == 1234
    t.begin_block([StepRecord(step=1299, metrics={})])
    t.checkpoint_and_stop(reason="again")
    assert t.stopped_at == 1234 and len(t.stops) == 2


def test_simulated_target_validates_interval() -> None:
    with pytest.raises(ValueError, match=r"^replay.checkpoint_interval must be >= 1 or None, got 0$"):
        Simulation(checkpoint_interval=0)


def test_live_executor_acts_on_simulated_target() -> None:
    from stabmon.interventions import Executor

    t = Simulation()
    t.begin_block([StepRecord(step=6, metrics={"lr": 1e-3})])
    ex = Executor(t.handle, simulated=True)
    d = Decision(
        step=7,
        action="scale_lr",
        params={"factor": 0.5},
        status=DecisionStatus.APPLY,
        runbook="r",
        rule="spike",
        rung=0,
        reason="test",
    )
    rec = ex.execute(d)
    assert isinstance(rec, InterventionRecord) and rec.simulated and rec.error is None
    assert t.overrides.lr_scale == pytest.approx(0.5)


# -- replay with the real detectors and runbook ----------------------------------------------------
def test_replay_finds_the_spike_with_live_classes() -> None:
    res = replay(spiky_records(), runbook="default")
    spikes = [a for a in res.anomalies if a.kind == "spike"]
    assert spikes and min(a.step for a in spikes) == 300
    assert not [a for a in res.anomalies if a.step < 290 and a.severity >= Severity.WARNING]
    assert res.steps == 400 and res.samples == 1200


def test_replay_is_deterministic() -> None:
    records = spiky_records()
    first = replay(records, runbook="default", approve=True)
    second = replay(records, runbook="default", approve=True)
    assert first.decisions, "the runbook should have reacted to the spike"
    assert canonical(first.events) == canonical(second.events)


def test_replay_overrides_change_detectors() -> None:
    records = spiky_records()
    strict = replay(records, overrides=["spike.z_threshold=1000", "robust_spike.z_threshold=1000"])
    assert not [a for a in strict.anomalies if a.kind == "spike"]


def test_approve_applies_proposals_to_the_simulated_target() -> None:
    pipeline, target = simulated_pipeline(runbook="propose-only")
    res = replay(spiky_records(), pipeline=pipeline, target=target, approve=True)
    statuses = {d.status for d in res.decisions}
    assert DecisionStatus.PROPOSED in statuses
    assert res.interventions and all(i.simulated for i in res.interventions)


def test_event_rows_have_required_fields() -> None:
    res = replay(spiky_records(), runbook="default")
    rows = event_rows(res.events)
    assert rows
    for row in rows:
        assert {"type", "step", "kind", "metric", "severity"} <= set(row)
    decisions = [r for r in rows if r["type"] == "Decision"]
    assert decisions and all(r["metric"] and r["severity"] for r in decisions)


class _Flag:
    """Test double for a detector suite: flags loss above 5, counts grace entries."""

    def __init__(self) -> None:
        self.graces = 0

    def update(self, record: StepRecord) -> list[Anomaly]:
        v = record.get("loss")
        return [Anomaly("spike", "loss", record.step, v, Severity.ERROR, "flag")] if v and v > 5 else []

    def enter_grace(self, steps: int | None = None) -> None:
        self.graces += 1

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_restarts_grace_only_when_asked() -> None:
    records = [StepRecord(s, {"loss": 2.0}) for s in range(10)]
    det = _Flag()
    replay(records, pipeline=Pipeline(det), restarts=[5])
    assert det.graces == 0
    replay(records, pipeline=Pipeline(det), restarts=[5], grace_on_restart=True)
    assert det.graces == 1


def test_progress_callback_counts_every_record() -> None:
    seen: list[int] = []
    replay(
        [StepRecord(s, {"loss": 1.0}) for s in range(2500)],
        pipeline=Pipeline(_Flag()),
        progress=seen.append,
        progress_every=1000,
    )
    assert seen == [1000, 1000, 500]


# -- CLI -------------------------------------------------------------------------------------------
def test_cli_import_then_replay_stored_run(real_runs: Path, sqlite_url: str) -> None:
    from stabmon.cli import app

    runner = CliRunner()
    res = runner.invoke(
        app, ["import", str(real_runs / FAIRSEQ), "--run", "fs13b", "--db", sqlite_url, "--json"]
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    assert summary["records"] == 10 and summary["format"] == "fairseq" and summary["malformed"] == 0
    res = runner.invoke(app, ["replay", "fs13b", "--db", sqlite_url, "--json"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.output.splitlines() if line.strip()]
    events = [r for r in rows if r["type"] in ("Anomaly", "Decision")]
    assert events and all({"step", "kind", "metric", "severity"} <= set(r) for r in events)
    assert any(r["kind"] == "loss_scale_collapse" and r["step"] == 3 for r in events)
    replay_id = rows[-1]["run_id"]

    from stabmon.store import open_store
    from stabmon.store.repo import get_run, load_events

    with open_store(sqlite_url) as store, store.session() as session:
        run = get_run(session=session, run_id=replay_id)
        assert run.kind == "replay"
        stored = load_events(session=session, run_id=replay_id)
    assert len([e for e in stored if isinstance(e, (Anomaly, Decision))]) == len(events)


def test_cli_replay_file_directly_and_errors(real_runs: Path, sqlite_url: str) -> None:
    from stabmon.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["replay", str(real_runs / FAIRSEQ), "--no-store", "--db", sqlite_url])
    assert res.exit_code == 0, res.output
    assert "10 steps replayed" in res.output
    res = runner.invoke(app, ["replay", "no-such-run", "--db", sqlite_url])
    assert res.exit_code == 1 and "no run matches 'no-such-run'" in res.output
    res = runner.invoke(app, ["replay", str(real_runs / FAIRSEQ), "--set", "nonsense", "--db", sqlite_url])
    assert res.exit_code == 1 and "detector.param" in res.output


def test_cli_replay_missing_file_and_bad_mode_are_named(real_runs: Path, sqlite_url: str, tmp_path: Path) -> None:
    from stabmon.cli import app

    runner = CliRunner()
    db_file = tmp_path / "stabmon.db"
    res = runner.invoke(app, ["replay", "nosuch.log", "--db", sqlite_url])
    assert res.exit_code == 1 and res.output.strip() == "error: no such file: nosuch.log", res.output
    assert not db_file.exists()  # nothing was created to find nothing in
    res = runner.invoke(app, ["import", str(real_runs / FAIRSEQ), "--run", "fs13b", "--db", sqlite_url])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["replay", "nosuch.log", "--db", sqlite_url])
    assert res.exit_code == 1 and res.output.strip() == "error: no file or run named 'nosuch.log'", res.output
    res = runner.invoke(app, ["replay", "logs/nosuch", "--db", sqlite_url])
    assert res.exit_code == 1 and res.output.strip() == "error: no such file: logs/nosuch", res.output
    res = runner.invoke(app, ["replay", str(real_runs / FAIRSEQ), "nosuch.log", "--db", sqlite_url])
    assert res.exit_code == 1 and res.output.strip().startswith("error: no such file: nosuch.log"), res.output
    for source in (str(real_runs / FAIRSEQ), "fs13b"):
        res = runner.invoke(app, ["replay", source, "--mode", "loud", "--no-store", "--db", sqlite_url])
        assert res.exit_code == 1, res.output
        assert res.output.strip() == "error: --mode must be one of apply, propose, got 'loud'"
    res = runner.invoke(app, ["replay", "fs13b", "--mode", "propose", "--no-store", "--db", sqlite_url])
    assert res.exit_code == 0, res.output


def test_cli_import_map_and_bad_map(tmp_path: Path, sqlite_url: str) -> None:
    from stabmon.cli import app

    p = tmp_path / "log.csv"
    p.write_text("it,my_loss\n1,2.0\n2,x\n")
    runner = CliRunner()
    res = runner.invoke(
        app,
        ["import", str(p), "--run", "c", "--map", "my_loss=loss", "--step-column", "it", "--db", sqlite_url],
    )
    assert res.exit_code == 0, res.output
    assert "imported 2 steps" in res.output and "1 malformed" in res.output
    res = runner.invoke(app, ["import", str(p), "--run", "c", "--map", "broken", "--db", sqlite_url])
    assert res.exit_code == 1 and "expected COLUMN=METRIC" in res.output
