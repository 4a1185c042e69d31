"""One pipeline: replaying a live run's stored metrics reproduces its anomalies and decisions exactly.

The issue asks for this on examples/tiny_gpt.py; that example is not in the tree yet, so this records a small
real training loop of its own (a regression that is destabilised by a learning-rate blow-up mid-run) through
the live :class:`stabmon.Monitor`, then replays the StepRecords read back from the store.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from stabmon.events import Anomaly, Decision  # noqa: E402
from stabmon.replay.replay import canonical, replay, simulated_pipeline  # noqa: E402
from stabmon.replay.simulate import Simulation  # noqa: E402


def _live_run(store_url: str, mode: str) -> tuple[str, list]:
    from stabmon.monitor import Monitor, MonitorConfig

    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w = torch.randn(8, 1, generator=gen)
    data = [torch.randn(32, 8, generator=gen) for _ in range(160)]
    mon = Monitor(
        model,
        opt,
        store=store_url,
        runbook="default",
        mode=mode,
        run_name="live",
        config=MonitorConfig(flush_every=10),
    )
    with mon:
        for step, x in mon.steps(data):
            for g in opt.param_groups:
                g["lr"] = 5.0 if 120 <= step < 123 else 0.05  # the blow-up
            loss = (model(x) - x @ w).pow(2).mean()
            loss.backward()
            mon.observe(loss=loss)
            opt.step()
            opt.zero_grad()
    return mon.run_id, list(mon.events)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["propose", "apply"])
def test_replay_of_stored_live_run_is_identical(sqlite_url: str, mode: str) -> None:
    from stabmon.store import open_store
    from stabmon.store.repo import load_steps, run_config

    run_id, live_events = _live_run(sqlite_url, mode)
    with open_store(sqlite_url) as store, store.session() as session:
        records = load_steps(session=session, run_id=run_id)
        config, _ = run_config(session=session, run_id=run_id)
    assert len(records) == 160
    live = [e for e in live_events if isinstance(e, (Anomaly, Decision))]
    assert [e for e in live if isinstance(e, Anomaly)], "the blow-up should have been detected live"
    # the live run saved no checkpoints: its rollbacks and diagnoses could not act, and were dropped from its
    # ladders at start (its stored config says which): the simulated target and the replay's ladders know the same
    assert config["ladder"]["dropped"], config
    target = Simulation(checkpoint_interval=None)
    pipeline, target = simulated_pipeline(runbook="default", mode=mode, target=target, live_config=config)
    result = replay(records, pipeline=pipeline, target=target, flush_every=10)  # the live MonitorConfig's
    replayed = [e for e in result.events if isinstance(e, (Anomaly, Decision))]
    assert canonical(replayed) == canonical(live)


@pytest.mark.slow
def test_cli_replay_of_stored_live_run_mimics_its_flushes_and_mode(sqlite_url: str) -> None:
    from typer.testing import CliRunner

    from stabmon.cli import app
    from stabmon.replay.replay import event_rows

    run_id, live_events = _live_run(sqlite_url, "apply")
    res = CliRunner().invoke(app, ["replay", run_id, "--db", sqlite_url, "--json", "--no-store"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.output.splitlines()]
    got = [(r["type"], r["step"], r["kind"], r["metric"], r["severity"]) for r in rows if r["type"] != "summary"]
    want = [(r["type"], r["step"], r["kind"], r["metric"], r["severity"]) for r in event_rows(live_events)]
    assert got == want
