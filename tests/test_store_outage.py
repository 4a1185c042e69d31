"""The database goes away mid-run and comes back: nothing lost, nothing duplicated, training never blocked."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from stabmon.events import StepRecord
from stabmon.store import StoreConfig, open_store, repo, upgrade
from stabmon.store.batch import Batch, NameCache, write_batch
from stabmon.store.database import make_engine
from stabmon.store.spool import Spool

FAST = {"flush_interval": 0.02, "retry_initial": 0.05, "retry_max": 0.2}


def recs(start: int, stop: int) -> list[StepRecord]:
    return [
        StepRecord(
            s, {"loss": math.nan if s % 7 == 0 else 1.0 / (s + 1), "grad_norm": float(s)}, batch_index=s
        )
        for s in range(start, stop)
    ]


def wait_for(cond, timeout: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def exactly_once(url: str, run_id: str, want: list[StepRecord]) -> None:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            n = conn.execute(
                sa.text(
                    "select count(*) from step_metrics m join runs r on r.key = m.run_key where r.id = :r"
                ),
                {"r": run_id},
            ).scalar()
        assert n == sum(len(r.metrics) for r in want)
        from sqlalchemy.orm import Session

        with Session(engine) as s:
            got = repo.load_steps(session=s, run_id=run_id)
    finally:
        engine.dispose()
    assert [r.step for r in got] == [r.step for r in want]
    for g, w in zip(got, want, strict=True):
        assert g.metrics.keys() == w.metrics.keys()
        assert all(
            g.metrics[k] == w.metrics[k] or math.isnan(w.metrics[k]) and math.isnan(g.metrics[k])
            for k in w.metrics
        )


def _move(db: Path, suffix: str) -> None:
    for ext in ("", "-wal", "-shm"):
        src = Path(str(db) + ext)
        if src.exists():
            src.rename(Path(str(db) + ext + suffix))


def _unmove(db: Path, suffix: str) -> None:
    for ext in ("", "-wal", "-shm"):
        src = Path(str(db) + ext + suffix)
        if src.exists():
            src.rename(Path(str(db) + ext))


def test_sqlite_file_goes_away_and_comes_back(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    url = f"sqlite:///{db}"
    store = open_store(url, config=StoreConfig(spool_dir=str(tmp_path / "spool"), **FAST))
    run = store.start_run(name="outage", environment={})
    store.write_steps(run_id=run, records=recs(0, 50))
    assert store.flush(20)
    store.engine.dispose()  # no reader connection keeps the old file open either

    _move(db, ".away")
    for chunk in range(5):  # the training thread keeps going while the database is away
        store.write_steps(run_id=run, records=recs(50 + 20 * chunk, 70 + 20 * chunk))
    wait_for(lambda: store.stats.spooled_batches >= 1)
    assert store.flush(0.3) is False
    assert store.spool_path.exists() and store.spool_path.stat().st_size > 0
    assert not db.exists(), "the writer must not create an empty database in place of the missing one"

    _unmove(db, ".away")
    assert store.flush(30)
    stats = store.stats
    assert stats.failures >= 1 and stats.spooled_rows > 0 and stats.replayed_batches >= 1
    store.close()
    exactly_once(url, run, recs(0, 150))
    assert not store.spool_path.exists()


def test_postgres_refuses_connections_then_returns(pg_admin_url: str, pg_url: str, tmp_path: Path) -> None:
    upgrade(pg_url)
    name = make_url(pg_url).database
    admin = sa.create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")

    def allow(flag: bool) -> None:
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(flag).lower()}'))
            if not flag:
                conn.execute(
                    sa.text("select pg_terminate_backend(pid) from pg_stat_activity where datname = :d"),
                    {"d": name},
                )

    store = open_store(pg_url, config=StoreConfig(spool_dir=str(tmp_path), **FAST))
    try:
        run = store.start_run(name="pg-outage", environment={})
        store.write_steps(run_id=run, records=recs(0, 30))
        assert store.flush(20)
        allow(False)
        store.write_steps(run_id=run, records=recs(30, 60))
        wait_for(lambda: store.stats.spooled_batches >= 1)
        store.write_steps(run_id=run, records=recs(60, 90))
        assert store.flush(0.3) is False
        allow(True)
        assert store.flush(30)
        assert store.stats.failures >= 1
    finally:
        allow(True)
        store.close()
        admin.dispose()
    exactly_once(pg_url, run, recs(0, 90))


def test_spool_left_by_a_closed_store_is_adopted_by_the_next(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    url = f"sqlite:///{db}"
    cfg = StoreConfig(spool_dir=str(tmp_path / "spool"), close_timeout=0.3, **FAST)
    first = open_store(url, config=cfg)
    run = first.start_run(name="crashy", environment={})
    assert first.flush(20)
    first.engine.dispose()
    _move(db, ".away")
    first.write_steps(run_id=run, records=recs(0, 40))
    first.close()  # gives up after close_timeout; the rows stay in the spool file
    assert first.spool_path.exists() and first.spool_path.stat().st_size > 0
    _unmove(db, ".away")

    with open_store(url, config=cfg) as second:
        wait_for(lambda: not first.spool_path.exists() or first.spool_path.stat().st_size == 0)
        assert second.flush(20)
    exactly_once(url, run, recs(0, 40))


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_writing_a_batch_twice_leaves_one_copy(backend: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_url")
    upgrade(url)
    batch = Batch(hi=1)
    batch.runs.append(
        {
            "id": "r1",
            "name": "r",
            "kind": "live",
            "status": "running",
            "started_at": 1.7e9,
            "ended_at": None,
            "config": {},
            "environment": {},
            "parent_run_id": None,
            "source": None,
        }
    )
    batch.steps.extend(
        (r, q, q, None, None, {"loss": float(q), "x": math.nan}) for r, q in [("r1", 0), ("r1", 1)]
    )
    batch.skipped.append(("r1", 1, 5))
    batch.alerts.append({"id": "al1", "run_id": "r1", "created_at": 1.7e9, "updated_at": 1.7e9, "channel": "x://***",
                         "severity": "error", "status": "queued", "attempts": 0, "error": None, "dedup_key": None,
                         "incident_id": None, "event_id": None, "title": "t"})
    batch.alert_updates.append(("al1", {"status": "sent", "attempts": 1, "error": None, "updated_at": 1.7e9 + 1}))
    again = Batch.from_json(batch.to_json())  # what a replayed spool line looks like
    engine = make_engine(url)
    names = NameCache()
    for b in (batch, again):
        with engine.begin() as conn:
            names.conn = conn
            write_batch(conn, b, names)
    with engine.connect() as conn:
        counts = [
            conn.execute(sa.text(f"select count(*) from {t}")).scalar()
            for t in ("runs", "steps", "step_metrics", "skipped_batches", "alerts")
        ]
        alert = conn.execute(sa.text("select status, attempts from alerts")).one()
    engine.dispose()
    assert counts == [1, 2, 4, 1, 1]
    assert tuple(alert) == ("sent", 1)


def test_a_batch_the_database_refuses_is_set_aside_not_retried_forever(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'run.db'}"
    with open_store(url, config=StoreConfig(spool_dir=str(tmp_path / "spool"), **FAST)) as store:
        run = store.start_run(name="r", environment={})
        bad = StepRecord(2, {"loss": "oops"})  # type: ignore[dict-item]
        store.write_steps(run_id=run, records=[*recs(0, 2), bad, *recs(3, 5)])  # one batch with the run row
        assert store.flush(20)
        store.write_steps(run_id=run, records=recs(5, 7))
        assert store.flush(20)
        assert store.stats.rejected_batches == 1
        [rejected] = (tmp_path / "spool").glob("rejected-*.jsonl")
        assert '"oops"' in rejected.read_text()
        with store.session() as s:
            assert [r.step for r in repo.load_steps(session=s, run_id=run)] == [0, 1, 3, 4, 5, 6]
            assert repo.get_run(session=s, run_id=run).name == "r"


def test_spool_skips_a_torn_last_line(tmp_path: Path) -> None:
    sp = Spool(tmp_path)
    sp.append(Batch(hi=1))
    sp.close(remove_if_empty=False)
    with open(sp.path, "a", encoding="utf-8") as fh:
        fh.write('{"hi": 2, "ru')
    assert [b.hi for b in Spool(tmp_path, sp.path).read()] == [1]


def test_a_live_stores_spool_is_never_adopted(tmp_path: Path) -> None:
    from stabmon.store.spool import orphans

    live = Spool(tmp_path, database="0123456789ab")
    live.append(Batch(hi=1))  # holds the lock while open
    assert orphans(tmp_path, database="0123456789ab") == []
    live.close(remove_if_empty=False)
    assert orphans(tmp_path, database="ba9876543210") == []  # another database's rows: never adopted
    [adopted] = orphans(tmp_path, database="0123456789ab")
    assert adopted.path == live.path and adopted.pending == 1
    adopted.close(remove_if_empty=False)
