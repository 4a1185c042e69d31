"""Secrets never reach the database, the spool, the logs or any ``--json`` output; a hung alert endpoint never
holds up training."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import sqlalchemy as sa
import torch
from fault_support import SpikeDetectors, Tiny, report, spike_runbook, train
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_alerts_support import Receiver  # noqa: E402

from stabmon.alerts import AlertsConfig, make_notifier  # noqa: E402
from stabmon.alerts.config import ChannelConfig  # noqa: E402
from stabmon.cli import app  # noqa: E402
from stabmon.collect.config import MonitorConfig  # noqa: E402
from stabmon.monitor import Monitor  # noqa: E402
from stabmon.store import StoreConfig, open_store, upgrade  # noqa: E402

SECRETS = ["HOOKTOKEN0451", "SLACKTOKEN0452", "PDROUTING0453", "PDAPIKEY0454", "DBPASSWORD0455"]


def test_no_secret_anywhere(pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            caplog: pytest.LogCaptureFixture) -> None:
    upgrade(pg_url)
    receiver = Receiver()
    hook = f"json://{receiver.netloc}/hook/{SECRETS[0]}"
    monkeypatch.setenv("STABMON_ALERTS", hook)  # the documented way to configure alerts
    monkeypatch.setenv("STABMON_ALERTS_SPARE", f"slack://T0/{SECRETS[1]}/x pagerduty://{SECRETS[2]}@{SECRETS[3]}")
    url = f"{pg_url}?password={SECRETS[4]}"  # trust authentication accepts any password
    monkeypatch.setenv("STABMON_DB_URL", url)
    caplog.set_level(logging.DEBUG)
    spool = tmp_path / "spool"
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    store = open_store(url, config=StoreConfig(spool_dir=str(spool)))
    mon = Monitor(model, opt, store=store, detectors=SpikeDetectors(), runbook=spike_runbook(), mode="apply",
                  config=MonitorConfig(flush_every=2, hang_timeout=None))
    train(mon, model, opt, 12, spike_at=(4,))
    mon.close()
    store.close()
    receiver.close()
    assert mon.anomalies and receiver.requests  # alerts were really sent through the secret hook
    with pytest.raises(ValueError) as bad:  # an unreachable database, fail-fast: the error names the URL
        open_store(f"postgresql+psycopg://ann:{SECRETS[4]}@127.0.0.1:1/x?password={SECRETS[4]}",
                   config=StoreConfig(fail_fast=True))
    from stabmon.cli.demo import summary

    outputs = [str(bad.value), *summary(mon, url, SimpleNamespace(steps=12, seconds=1.0, exit_code=0, val_loss=2.0))]
    runner = CliRunner()
    for args in (["runs", "--json"], ["trace", mon.run_id, "--json"], ["events", mon.run_id, "--json"],
                 ["metrics", mon.run_id, "--json"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (args, result.output)
        outputs.append(result.output)
    engine = sa.create_engine(pg_url)
    with engine.connect() as conn:
        tables = [r[0] for r in conn.execute(sa.text("select tablename from pg_tables where schemaname='public'"))]
        dump = [str(r[0]) for t in tables for r in conn.execute(sa.text(f'select t::text from "{t}" t'))]
    engine.dispose()
    files = [p.read_bytes().decode("utf-8", "replace") for p in spool.rglob("*") if p.is_file()]
    logs = [r.getMessage() for r in caplog.records]
    assert any("STABMON_ALERTS" in row for row in dump)  # the environment was recorded, redacted
    report("secrets", rows_searched=len(dump), files=len(files), log_lines=len(logs), outputs=len(outputs))
    for where, texts in (("database", dump), ("spool", files), ("logs", logs), ("output", outputs)):
        for secret in SECRETS:
            leaked = [t for t in texts if secret in t]
            assert not leaked, f"{secret} found in the {where}: {leaked[0][:300]}"


def test_a_hung_alert_endpoint_never_holds_up_training(sqlite_url: str, tmp_path: Path) -> None:
    receiver = Receiver()
    receiver.hang = True  # accepts the connection, never answers
    cfg = AlertsConfig(channels=[ChannelConfig(url=f"json://{receiver.netloc}/hook")], timeout=30.0, queue_size=5,
                       dedup_window=0, rate_per_minute=1e6, burst=1000, incident_limit=1000)
    notifier = make_notifier(cfg)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(model, opt, store=sqlite_url, detectors=SpikeDetectors(), notifier=notifier, mode="observe",
                  config=MonitorConfig(flush_every=2, hang_timeout=None))
    trained = train(mon, model, opt, 300, spike_at=tuple(range(5, 300, 5)))
    mon.close()
    notifier.close(timeout=0.5)
    receiver.close()
    stats = notifier.stats
    report("hung alert endpoint", steps=trained.steps, stored=300, longest_step_s=trained.longest,
           alerts=len(mon.anomalies), dropped=stats.get("dropped", 0))
    assert len(mon.anomalies) == 59 and trained.longest < 0.5, f"a training step took {trained.longest:.2f}s"
    assert stats.get("dropped", 0) >= 59 - 5 - 1  # the queue stayed capped and the overflow was counted
    with open_store(sqlite_url) as store, store.session() as s:
        n = s.execute(sa.text("select count(*) from steps")).scalar()
    assert n == 300


def test_a_long_run_keeps_a_bounded_number_of_events_in_memory(tmp_path: Path) -> None:
    """An anomaly on every step for 400 steps (the loss NaN by construction): the monitor keeps the newest
    ``config.history`` events and anomalies in memory, the store every one (before: two lists that grew with
    the run, an event per step here)."""
    import sqlite3

    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    url = f"sqlite:///{tmp_path / 'run.db'}"
    mon = Monitor(model, opt, store=url, config=MonitorConfig(history=50, flush_every=10, hang_timeout=None))
    with mon:
        for _, x in mon.steps([torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(400)]):
            loss = model(x).pow(2).mean() * float("nan")
            loss.backward()
            mon.observe(loss=loss)
            opt.step()
            opt.zero_grad()
        assert 0 < len(mon.events) <= 50 and 0 < len(mon.anomalies) <= 50
        newest = mon.events[-1]
    with sqlite3.connect(tmp_path / "run.db") as con:
        stored = con.execute("select count(*) from anomalies").fetchone()[0]
    assert stored > 200, stored
    assert newest.step >= 390
    report("bounded event memory", events_in_memory=len(mon.events), events_stored=stored)
