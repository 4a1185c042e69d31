"""The monitor against the real store (SQLite and PostgreSQL): every step recorded, a human's answer picked up,
and the recorded metrics replayed through fresh detectors reproduce the live anomalies."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_monitor import ClipEngine, SpikeDetectors, Tiny, batches, loss_of

from stabmon.collect.config import MonitorConfig
from stabmon.events import Anomaly, Decision, DecisionStatus, InterventionRecord
from stabmon.monitor import Monitor


@pytest.fixture(params=["sqlite_url", pytest.param("pg_url", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest) -> str:
    value = request.getfixturevalue(request.param)
    from stabmon.store import upgrade

    upgrade(value)
    return value


def test_propose_answer_apply_through_the_store(url: str) -> None:
    from stabmon.store import open_store
    from stabmon.store.repo import answer_decision, load_events, load_steps

    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    mon = Monitor(
        model,
        opt,
        store=url,
        detectors=SpikeDetectors(),
        runbook=ClipEngine(DecisionStatus.PROPOSED),
        mode="propose",
        config=MonitorConfig(flush_every=4, hang_timeout=None),
        run_name="store-test",
    )
    reader = open_store(url)
    answered = False
    for step, idx in mon.steps(batches(40)):
        loss = loss_of(model, idx) * (1e6 if step == 5 else 1.0)
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
        proposed = [e for e in mon.events if isinstance(e, Decision) and e.status == DecisionStatus.PROPOSED]
        if proposed and not answered and mon.store.flush(timeout=10):  # type: ignore[union-attr]
            with reader.session() as s:  # a human answering from another process
                answer_decision(session=s, run_id=mon.run_id, decision_id=proposed[0].id, approved=True, by="test")
            assert mon.store.refresh_answers(run_id=mon.run_id, timeout=10)  # type: ignore[union-attr]
            answered, answered_at = True, mon.step
    mon.close()
    assert answered and mon.overrides.max_norm == 0.25
    first_clipped = [r.metrics["clip"] for r in mon.records].index(0.25)
    assert answered_at <= first_clipped <= answered_at + 4  # picked up at the next flush
    with reader.session() as s:
        steps = load_steps(session=s, run_id=mon.run_id)
        events = load_events(session=s, run_id=mon.run_id)
    reader.close()
    assert [r.step for r in steps] == list(range(40))
    assert steps[7].metrics == pytest.approx(dict(mon.records[7].metrics))
    kinds = [type(e) for e in events]
    assert Anomaly in kinds and Decision in kinds and InterventionRecord in kinds


@pytest.mark.slow
def test_replaying_recorded_metrics_reproduces_live_anomalies(sqlite_url: str) -> None:
    from stabmon.detect import DetectorSuite
    from stabmon.pipeline import Pipeline
    from stabmon.store import open_store
    from stabmon.store.repo import load_steps

    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    mon = Monitor(model, opt, store=sqlite_url, config=MonitorConfig(flush_every=10, hang_timeout=None))
    for step, idx in mon.steps(batches(300)):
        loss = loss_of(model, idx) * (50.0 if step in (150, 151, 230) else 1.0)
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
    mon.close()
    live = [(a.kind, a.metric, a.step, a.score) for a in mon.anomalies]
    reader = open_store(sqlite_url)
    with reader.session() as s:
        steps = load_steps(session=s, run_id=mon.run_id)
    reader.close()
    replay = Pipeline(DetectorSuite.from_config(None))
    replayed = [(a.kind, a.metric, a.step, a.score) for r in steps for a in replay.process(r) if isinstance(a, Anomaly)]
    assert any(k == "spike" for k, *_ in live)
    assert replayed == live


def test_store_that_goes_away_does_not_stop_training(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path / 'gone.db'}"
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = Monitor(model, opt, store=url, config=MonitorConfig(flush_every=2, hang_timeout=None))
    real = mon.store
    assert real is not None

    class Broken:
        def __getattr__(self, name: str) -> Any:
            def fail(*args: Any, **kwargs: Any) -> Any:
                raise OSError("database unavailable")

            return fail

    for step, idx in mon.steps(batches(10)):
        if step == 3:
            mon.store = Broken()  # type: ignore[assignment]
        if step == 7:
            mon.store = real
        loss = loss_of(model, idx)
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
    mon.close()
    assert mon.step == 10 and mon.errors["store"] >= 2


@pytest.mark.slow
def test_palm_rollback_runbook_end_to_end(tmp_path: Any) -> None:
    """Real detectors, the shipped palm-rollback runbook, the live executor, checkpoints and the data cursor:
    a loss spike caused by bad batches is answered by restoring an older checkpoint and skipping past them."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = batches(2000)
    bad = set(range(300, 304))
    cfg = MonitorConfig(checkpoint_every=50, checkpoint_keep=6, hang_timeout=None)
    mon = Monitor(model, opt, store=f"sqlite:///{tmp_path / 'rb.db'}", runbook="palm-rollback", mode="apply",
                  config=cfg, checkpoint_dir=str(tmp_path / "ckpt"))
    seen = []
    for step, idx in mon.steps(data, max_steps=600):
        index = mon.buffer._current.batch_index  # type: ignore[union-attr]
        seen.append((step, index))
        loss = loss_of(model, idx) * (1e3 if index in bad else 1.0)
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
    mon.close()
    rollbacks = [e for e in mon.events if isinstance(e, InterventionRecord) and e.action == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0].error is None
    after = rollbacks[0].after
    assert after["checkpoint_step"] <= rollbacks[0].before["onset_step"] - 100
    start, stop = after["skipped"]
    assert stop - start == 300 and start == after["checkpoint_step"]
    first_after = next(i for i, (s, _) in enumerate(seen) if i > 0 and s <= seen[i - 1][0])
    replayed = seen[first_after:]
    assert replayed[0] == (after["restored_step"], stop)  # resumes at the restored step, past the skipped batches
    assert not {b for _, b in replayed} & (set(range(start, stop)) | bad)
    assert mon.step == 600 and not mon.should_stop


def test_database_outage_mid_run_loses_nothing(tmp_path: Any) -> None:
    """The SQLite file vanishes for five steps of a monitored run: training goes on, the store spools, and once
    the file is back every step's metrics are in it exactly once."""
    from sqlalchemy.orm import Session
    from test_store_outage import FAST, _move, _unmove, wait_for

    from stabmon.store import StoreConfig, open_store, repo

    db = tmp_path / "run.db"
    store = open_store(f"sqlite:///{db}", config=StoreConfig(spool_dir=str(tmp_path / "spool"), **FAST))
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = Monitor(model, opt, store=store, config=MonitorConfig(flush_every=2, hang_timeout=None))
    for step, idx in mon.steps(batches(14)):
        if step == 4:
            assert store.flush(20)
            store.engine.dispose()
            _move(db, ".away")
        if step == 10:
            wait_for(lambda: store.stats.spooled_batches >= 1)  # the writer met the outage and spooled
            assert not db.exists()
            _unmove(db, ".away")
        loss = loss_of(model, idx)
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
    mon.close()
    assert store.flush(30)
    assert store.stats.failures >= 1 and store.stats.replayed_batches >= 1
    store.close()
    with Session(store.engine) as s:
        stored = repo.load_steps(session=s, run_id=mon.run_id)
    assert [r.step for r in stored] == [r.step for r in mon.records] == list(range(14))
    assert all(a.metrics == b.metrics for a, b in zip(stored, mon.records, strict=True))
