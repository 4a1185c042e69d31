"""Faults against the store: a full disk, torn spool files, resumes over a backlog, a writer stuck on a dead
connection, locks, killed backends, hostile names. Every test counts rows trained against rows stored."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from fault_support import FAST, count, proxy_for, report, stored_steps, wait_for

from stabmon.events import StepRecord
from stabmon.store import StoreConfig, open_store, upgrade
from stabmon.store.batch import Batch
from stabmon.store.spool import database_identity


def frame(batch: Batch) -> bytes:
    from stabmon.store.spool import frame as framed

    return framed(batch)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def recs(start: int, stop: int) -> list[StepRecord]:
    return [
        StepRecord(s, {"loss": 1.0 / (s + 1), "grad_norm": math.sqrt(s)}, batch_index=s) for s in range(start, stop)
    ]


@pytest.fixture(params=["sqlite_url", pytest.param("pg_url", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest) -> str:
    value = request.getfixturevalue(request.param)
    upgrade(value)
    return value


def _disk_full(tmp_path: Path, mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    db = tmp_path / "run.db"
    out = subprocess.run(
        [sys.executable, str(HERE / "disk_full.py"), f"sqlite:///{db}", str(tmp_path / "spool"), mode],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "url": f"sqlite:///{db}"}


def test_disk_fills_then_frees_nothing_lost(tmp_path: Path) -> None:
    got = _disk_full(tmp_path, "free")
    assert got["flushed"] and got["later_flushed"] and got["failures"] >= 1
    report("disk full, then freed", steps=got["trained"], stored=len(stored_steps(got["url"], got["run"])),
           dropped=got["dropped_rows"])
    assert stored_steps(got["url"], got["run"]) == list(range(got["trained"]))  # 490 of 490, in order
    assert stored_steps(got["url"], got["run2"]) == list(range(20))  # the next run is not wedged either
    assert count(got["url"], "select count(*) from runs where id = :r and status = 'finished'", r=got["run"]) == 1
    assert got["dropped_rows"] == 0 and got["kept_rows"] == 0


def test_disk_never_frees_every_loss_is_counted(tmp_path: Path) -> None:
    got = _disk_full(tmp_path, "never")
    written = 1 + 3 * got["trained"] + 1  # run row, steps with two metrics each, the final status
    stored = count(got["url"], "select count(*) from runs") + 3 * len(stored_steps(got["url"], got["run"]))
    report("disk never frees", rows=written, stored=stored, kept=got["kept_rows"], dropped=got["dropped_rows"])
    assert got["dropped_rows"] > 0
    assert stored + got["kept_rows"] + got["dropped_rows"] == written  # nothing unaccounted for


def _legacy_line(batch: Batch) -> bytes:
    return (batch.to_json() + "\n").encode()


def test_a_torn_line_in_a_left_spool_is_quarantined_and_the_rest_replayed(tmp_path: Path) -> None:
    db, spool_dir = tmp_path / "run.db", tmp_path / "spool"
    url = f"sqlite:///{db}"
    cfg = StoreConfig(spool_dir=str(spool_dir), **FAST)
    with open_store(url, config=cfg) as first:
        run = first.start_run(name="torn", environment={})
        first.write_steps(run_id=run, records=recs(0, 10))
        assert first.flush(20)
    a, b = Batch(hi=0), Batch(hi=0)
    a.steps = [(run, 10 + i, 10 + i, None, None, {"loss": 1.0}) for i in range(10)]
    b.steps = [(run, 20 + i, 20 + i, None, None, {"loss": 2.0}) for i in range(10)]
    torn = frame(a)[:37]  # what a full disk left in the middle of an append, ended by the next append
    spool_dir.mkdir(exist_ok=True)
    left = spool_dir / f"spool-{database_identity(url)}-00000000c001.jsonl"
    left.write_bytes(_legacy_line(a) + torn + b"\n" + frame(b) + torn)
    with open_store(url, config=cfg) as second:  # adopts the file
        assert second.flush(20), "a damaged spool line wedged the store"
        second.start_run(name="torn", resume_run_id=run, environment={})
        second.write_steps(run_id=run, records=recs(30, 35))
        assert second.flush(20)
        assert second.stats.quarantined_lines == 2
    assert stored_steps(url, run) == list(range(35))
    quarantined = list(spool_dir.glob("quarantine-*.jsonl"))
    assert len(quarantined) == 1 and quarantined[0].read_bytes().count(b"\n") == 2
    assert not list(spool_dir.glob("spool-*.jsonl"))


def test_a_flipped_byte_fails_the_checksum(tmp_path: Path) -> None:
    good = frame(Batch(hi=1))
    bad = good.replace(b'"hi":1', b'"hi":7')
    (tmp_path / "spool-x.jsonl").write_bytes(good + bad + good)
    from stabmon.store.spool import Spool

    sp = Spool(tmp_path, tmp_path / "spool-x.jsonl")
    assert [b.hi for b in sp.read()] == [1, 1] and sp.quarantined == 1


def test_resume_while_rows_are_still_spooled_loses_none(tmp_path: Path) -> None:
    db, spool_dir = tmp_path / "run.db", tmp_path / "spool"
    url = f"sqlite:///{db}"
    with open_store(url, config=StoreConfig(spool_dir=str(spool_dir), **FAST)) as first:
        run = first.start_run(name="resume", environment={})
        first.write_steps(run_id=run, records=recs(0, 40))
        assert first.flush(20)
        first.engine.dispose()
        db.rename(tmp_path / "away.db")  # the database goes away; the next 60 steps are spooled
        first.write_steps(run_id=run, records=recs(40, 100))
        wait_for(lambda: first.stats.spooled_batches >= 1)
        first.config.close_timeout = 0.3
    assert first.stats.kept_rows == 60 * 3
    (tmp_path / "away.db").rename(db)  # it is back when the run resumes
    slow = StoreConfig(spool_dir=str(spool_dir), flush_interval=1.0)
    with open_store(url, config=slow) as second:
        assert second.start_run(name="resume", resume_run_id=run, environment={}) == run
        second.write_steps(run_id=run, records=recs(100, 150))
        assert second.flush(20)
    assert stored_steps(url, run) == list(range(150))


def test_close_with_the_writer_stuck_on_a_dead_connection_keeps_every_row(pg_url: str, tmp_path: Path) -> None:
    upgrade(pg_url)
    spool_dir = tmp_path / "spool"
    with proxy_for(pg_url) as proxy:
        cfg = StoreConfig(spool_dir=str(spool_dir), close_timeout=1.0, **FAST)
        store = open_store(proxy.url(pg_url), config=cfg)
        run = store.start_run(name="cut", environment={})
        store.write_steps(run_id=run, records=recs(0, 100))
        assert store.flush(20)
        proxy.set("pause")  # a silent network cut: the writer's next transaction never returns
        store.write_steps(run_id=run, records=recs(100, 600))
        store.end_run(run_id=run, status="finished")
        t0 = time.monotonic()
        store.close()
        took = time.monotonic() - t0
        report("writer stuck at close", close_s=took, kept=store.stats.kept_rows, dropped=store.stats.dropped_rows)
        assert took < cfg.close_timeout + 3.0, f"close() took {took:.1f}s"
        assert store.stats.kept_rows >= 500 * 3 + 1 and store.stats.dropped_rows == 0
        # the same database behind its own URL, not the proxy's: the spool names the proxy's, so say so
        with open_store(pg_url, config=StoreConfig(spool_dir=str(spool_dir), adopt_any=True, **FAST)) as recover:
            assert recover.flush(30)
    assert stored_steps(pg_url, run) == list(range(600))
    assert count(pg_url, "select count(*) from runs where id = :r and status = 'finished'", r=run) == 1


def test_a_locked_sqlite_database_loses_nothing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'run.db'}"
    with open_store(url, config=StoreConfig(spool_dir=str(tmp_path / "spool"), **FAST)) as store:
        run = store.start_run(name="locked", environment={})
        assert store.flush(20)
        locker = sa.create_engine(url)
        conn = locker.connect()
        conn.exec_driver_sql("BEGIN EXCLUSIVE")  # another process holds the write lock for a while
        store.write_steps(run_id=run, records=recs(0, 100))
        threading.Timer(1.0, conn.rollback).start()
        assert store.flush(30)
        conn.close()
        locker.dispose()
    assert stored_steps(url, run) == list(range(100))


@pytest.mark.postgres
def test_terminated_backends_lose_nothing(pg_url: str, pg_admin_url: str, tmp_path: Path) -> None:
    upgrade(pg_url)
    name = sa.engine.make_url(pg_url).database
    admin = sa.create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    with open_store(pg_url, config=StoreConfig(spool_dir=str(tmp_path), **FAST)) as store:
        run = store.start_run(name="killed", environment={})
        for chunk in range(10):
            store.write_steps(run_id=run, records=recs(30 * chunk, 30 * chunk + 30))
            with admin.connect() as c:
                c.execute(
                    sa.text(
                        "select pg_terminate_backend(pid) from pg_stat_activity "
                        "where datname = :d and pid <> pg_backend_pid()"
                    ),
                    {"d": name},
                )
            time.sleep(0.03)
        assert store.flush(30)
    admin.dispose()
    assert stored_steps(pg_url, run) == list(range(300))


HOSTILE = ["x'); DROP TABLE runs; --", 'q"uote\\back', "ünï çødé ✓", "%s %(x)s ?", "a\tb"]


def test_injection_like_names_are_stored_verbatim(url: str, tmp_path: Path) -> None:
    with open_store(url, config=StoreConfig(spool_dir=str(tmp_path), **FAST)) as store:
        runs = [store.start_run(name=n, environment={}) for n in HOSTILE]
        for run in runs:
            store.write_steps(run_id=run, records=[StepRecord(0, {n: 1.0 for n in HOSTILE})])
        assert store.flush(20) and store.stats.rejected_batches == 0
    assert count(url, "select count(*) from runs") == len(HOSTILE)
    assert count(url, "select count(*) from step_metrics") == len(HOSTILE) ** 2
    assert count(url, "select count(distinct name) from metric_names") == len(HOSTILE)


def test_names_longer_than_the_store_holds(url: str, tmp_path: Path) -> None:
    long = "m" * 300
    with open_store(url, config=StoreConfig(spool_dir=str(tmp_path), **FAST)) as store:
        with pytest.raises(ValueError, match=r"^store.start_run.name is 256 characters long, more than"):
            store.start_run(name="r" * 256, environment={})
        run = store.start_run(name="r" * 255, environment={})
        store.write_steps(run_id=run, records=[StepRecord(s, {"loss": 1.0, long: 2.0}) for s in range(20)])
        assert store.flush(20)
        assert store.stats.bad_names == 20 and store.stats.rejected_batches == 0
    assert stored_steps(url, run) == list(range(20))  # every step kept, with its loss
    assert count(url, "select count(*) from step_metrics") == 20


def test_db_recover_writes_what_a_crashed_run_left_in_the_spool(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from stabmon.cli import app

    db, spool_dir = tmp_path / "run.db", tmp_path / "spool"
    url = f"sqlite:///{db}"
    with open_store(url, config=StoreConfig(spool_dir=str(spool_dir), **FAST)) as store:
        run = store.start_run(name="crashed", environment={})
        assert store.flush(20)
    spooled = Batch(hi=0)
    spooled.steps = [(run, s, s, None, None, {"loss": 1.0}) for s in range(25)]
    spool_dir.mkdir(exist_ok=True)
    left = spool_dir / f"spool-{database_identity(url)}-0000000dead1.jsonl"
    left.write_bytes(frame(spooled) + frame(spooled)[:20])  # torn by the crash
    result = CliRunner().invoke(app, ["db", "recover", "--db", url, "--spool-dir", str(spool_dir)])
    assert result.exit_code == 0, result.output
    assert "1 spooled batch(es) written, 1 damaged line(s) quarantined" in result.output
    assert stored_steps(url, run) == list(range(25))
