"""A spool belongs to one database.

Before, a run meant for an unreachable PostgreSQL was spooled, and the next process that opened any store in
the same directory (``sqlite:///probe.db``) adopted the spool and wrote that run into the SQLite file. A spool
file's name now carries the identity of the database its rows were meant for; a store adopts only its own
database's, and ``stabmon db recover --any-database`` is the one way (a person's) to send them elsewhere.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import time
from pathlib import Path

import pytest
from fault_support import count, proxy_for, stored_steps
from typer.testing import CliRunner

from stabmon.events import StepRecord
from stabmon.store import StoreConfig, open_store, upgrade
from stabmon.store.spool import database_identity

FAST = {"flush_interval": 0.05, "retry_initial": 0.1, "retry_max": 0.2}


def _records(n: int) -> list[StepRecord]:
    return [StepRecord(s, {"loss": 1.0 / (s + 1), "grad_norm": math.sqrt(s)}) for s in range(n)]


def _runs(db: Path) -> int:
    if not db.exists():
        return 0
    with sqlite3.connect(db) as con:
        tables = {r[0] for r in con.execute("select name from sqlite_master where type = 'table'")}
        return con.execute("select count(*) from runs").fetchone()[0] if "runs" in tables else 0


def test_the_identity_is_the_database_not_the_spelling(tmp_path: Path) -> None:
    db = tmp_path / "a.db"
    assert database_identity(f"sqlite:///{db}") == database_identity(f"sqlite:///{tmp_path}/./a.db")
    assert database_identity(f"sqlite:///{db}") != database_identity(f"sqlite:///{tmp_path / 'b.db'}")
    pg = "postgresql+psycopg://u:secret@db.example:5432/runs"
    assert database_identity(pg) == database_identity("postgresql+psycopg://u:other@db.example:5432/runs")
    assert database_identity(pg) != database_identity("postgresql+psycopg://u@db.example:5432/other")


def test_rows_for_an_unreachable_database_never_land_in_another(pg_url: str, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    from stabmon.cli import app

    upgrade(pg_url)
    spool = tmp_path / "stabmon-spool"
    with proxy_for(pg_url) as proxy:
        proxy.set("refuse")  # PostgreSQL is down
        target = proxy.url(pg_url)
        cfg = StoreConfig(spool_dir=str(spool), close_timeout=1.0, **FAST)
        store = open_store(target, config=cfg)
        run = store.start_run(name="meant-for-postgres", environment={})
        store.write_steps(run_id=run, records=_records(50))
        store.end_run(run_id=run, status="finished")
        t0 = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="stabmon.store.store"):
            store.close()
        took = time.monotonic() - t0
        assert took < cfg.close_timeout + 3.0, f"close() took {took:.1f}s"
        left = sorted(spool.glob("spool-*.jsonl"))
        assert [p.name.split("-")[1] for p in left] == [database_identity(target)]
        assert str(left[0]) in caplog.text  # it says where the rows are
        probe = tmp_path / "probe.db"
        with open_store(f"sqlite:///{probe}", config=StoreConfig(spool_dir=str(spool), **FAST)) as other:
            assert other.flush(10)
        assert _runs(probe) == 0 and sorted(spool.glob("spool-*.jsonl")) == left  # not adopted (before: it was)
        result = CliRunner().invoke(app, ["db", "recover", "--db", f"sqlite:///{probe}", "--spool-dir", str(spool),
                                          "--timeout", "10"])
        assert result.exit_code == 0 and "0 spooled batch(es) written" in result.output, result.output
        assert _runs(probe) == 0
        proxy.set("forward")  # PostgreSQL is back: a store on its URL adopts the spool
        with open_store(target, config=StoreConfig(spool_dir=str(spool), **FAST)) as back:
            assert back.flush(30)
    assert stored_steps(pg_url, run) == list(range(50))
    assert count(pg_url, "select count(*) from runs where id = :r and status = 'finished'", r=run) == 1
    assert not list(spool.glob("spool-*.jsonl"))


def test_recover_sends_another_databases_spool_only_when_told(tmp_path: Path) -> None:
    """A database that moved: its spool names the old URL (nothing listens there), and the user sends it to the
    new one with ``--any-database``."""
    from stabmon.cli import app

    spool = tmp_path / "spool"
    moved = "postgresql+psycopg://stabmon@127.0.0.1:9/gone"  # the discard port: connection refused at once
    store = open_store(moved, config=StoreConfig(spool_dir=str(spool), close_timeout=0.5, **FAST))
    run = store.start_run(name="moved", environment={})
    store.write_steps(run_id=run, records=_records(10))
    store.close()
    assert [p.name.split("-")[1] for p in spool.glob("spool-*.jsonl")] == [database_identity(moved)]
    new = f"sqlite:///{tmp_path / 'new.db'}"
    upgrade(new)
    args = ["db", "recover", "--db", new, "--spool-dir", str(spool), "--timeout", "10"]
    assert "0 spooled batch(es) written" in CliRunner().invoke(app, args).output
    result = CliRunner().invoke(app, [*args, "--any-database"])
    assert result.exit_code == 0, result.output
    assert stored_steps(new, run) == list(range(10))
