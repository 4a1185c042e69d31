"""``stabmon db upgrade``, ``stabmon runs`` and ``stabmon metrics`` through typer's runner and one real
process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stabmon.cli import app
from stabmon.events import StepRecord
from stabmon.store import StoreConfig, open_store
from stabmon.store.database import head_revision, schema_revision

runner = CliRunner()


def invoke(*args: str):  # noqa: ANN201
    return runner.invoke(app, list(args), catch_exceptions=False)


@pytest.fixture
def recorded(sqlite_url: str) -> tuple[str, str]:
    with open_store(sqlite_url, config=StoreConfig(flush_interval=0.02)) as store:
        run = store.start_run(name="cli-run", environment={})
        store.write_steps(
            run_id=run,
            records=[
                StepRecord(s, {"loss": 3.0 - s if s != 2 else math.nan, "grad_norm": float(s)})
                for s in range(4)
            ],
        )
        store.end_run(run_id=run, status="finished")
    return sqlite_url, run


def test_db_upgrade_creates_the_sqlite_file_in_an_existing_folder_only(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new' / 'dir' / 'runs.db'}"
    res = invoke("db", "upgrade", "--db", url)
    assert res.exit_code == 1 and "no folder" in res.output and not (tmp_path / "new").exists()
    (tmp_path / "new" / "dir").mkdir(parents=True)
    assert invoke("db", "upgrade", "--db", url).exit_code == 0
    assert schema_revision(url) == head_revision()


def test_db_upgrade_then_current(sqlite_url: str) -> None:
    res = invoke("db", "upgrade", "--db", sqlite_url)
    assert res.exit_code == 0, res.output
    assert f"schema {head_revision()}" in res.output
    assert schema_revision(sqlite_url) == head_revision()
    res = invoke("db", "current", "--db", sqlite_url)
    assert res.exit_code == 0 and f"schema {head_revision()} (newest {head_revision()})" in res.output


def test_db_upgrade_on_postgres_and_env_var(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STABMON_DB_URL", pg_url)
    res = invoke("db", "upgrade")
    assert res.exit_code == 0, res.output
    assert schema_revision(pg_url) == head_revision()


def test_runs_table_and_json(recorded: tuple[str, str]) -> None:
    url, run = recorded
    res = invoke("runs", "--db", url)
    assert res.exit_code == 0 and run in res.output and "cli-run" in res.output and "finished" in res.output
    res = invoke("runs", "--db", url, "--json")
    [row] = json.loads(res.output)
    assert (row["id"], row["name"], row["kind"], row["status"], row["steps"], row["anomalies"]) == (
        run,
        "cli-run",
        "live",
        "finished",
        4,
        0,
    )


def test_metrics_summary_and_json(recorded: tuple[str, str]) -> None:
    url, run = recorded
    res = invoke("metrics", "cli-run", "--db", url)
    assert res.exit_code == 0, res.output
    assert "grad_norm" in res.output and "loss" in res.output
    res = invoke("metrics", run, "--db", url, "--json", "--name", "loss")
    out = json.loads(res.output)
    assert out["run_id"] == run
    assert [(r["step"], r["value"]) for r in out["rows"]] == [(0, 3.0), (1, 2.0), (2, "nan"), (3, 0.0)]


def test_user_errors_are_one_line_with_exit_1(recorded: tuple[str, str], tmp_path: Path) -> None:
    url, _ = recorded
    cases = [
        (("metrics", "nope", "--db", url), "error: no run matches 'nope'"),
        (("metrics", "cli-run", "--db", url, "--name", "zzz"), "has no metric named zzz"),
        (("runs", "--db", f"sqlite:///{tmp_path / 'absent.db'}"), "error: no stabmon database at"),
        (("runs", "--db", "xyz://h"), "error: store: cannot open 'xyz://h'"),
        (("db", "upgrade", "--db", "xyz://h"), "error: store: cannot open 'xyz://h'"),
    ]
    for args, message in cases:
        res = runner.invoke(app, list(args))
        assert res.exit_code == 1, (args, res.output)
        assert message in res.output and res.output.strip().count("\n") == 0, res.output


def test_runs_on_a_database_without_schema(pg_url: str) -> None:
    res = runner.invoke(app, ["runs", "--db", pg_url])
    assert res.exit_code == 1 and "has no stabmon schema; run `stabmon db upgrade" in res.output


@pytest.mark.slow
def test_real_process_db_upgrade(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'proc.db'}"
    env = {**os.environ, "STABMON_DB_URL": url}
    done = subprocess.run(
        [sys.executable, "-m", "stabmon", "db", "upgrade"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert schema_revision(url) == head_revision()
    done = subprocess.run(
        [sys.executable, "-m", "stabmon", "metrics", "x"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and done.stderr.strip() == "error: no run matches 'x' (see `stabmon runs`)"


@pytest.mark.parametrize("args", [["runs"], ["metrics", "x"], ["events", "x"], ["trace", "x"], ["db", "upgrade"],
                                  ["approve", "x", "y"]])
def test_an_unparseable_store_url_is_one_line(args: list[str]) -> None:
    result = runner.invoke(app, [*args, "--db", "notaurl"])
    assert result.exit_code == 1 and result.exception is not None and isinstance(result.exception, SystemExit)
    assert result.output.strip().splitlines() == [
        "error: store: cannot parse 'notaurl' as a database URL "
        "(e.g. sqlite:///stabmon.db or postgresql+psycopg://user@host:5432/db)"
    ]


def test_json_output_is_strict_json(capsys: pytest.CaptureFixture[str]) -> None:
    from stabmon.cli._common import print_json

    print_json({"clip": math.inf, "loss": [1.0, math.nan], "floor": -math.inf})
    out = capsys.readouterr().out
    assert json.loads(out, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}")) == {
        "clip": "inf", "loss": [1.0, "nan"], "floor": "-inf"}


def test_approve_on_an_ended_run_says_the_answer_is_only_recorded(sqlite_url: str) -> None:
    from stabmon.events import Decision, DecisionStatus

    def proposal() -> Decision:
        return Decision(10, "scale_lr", {"factor": 0.5}, DecisionStatus.PROPOSED, "opt175b", "grad_spike", 0,
                        "grad norm spike", anomaly_id="a1", incident_id="inc1")

    with open_store(sqlite_url, config=StoreConfig(flush_interval=0.02)) as store:
        live, ended = store.start_run(name="live", environment={}), store.start_run(name="ended", environment={})
        d_live, d_ended = proposal(), proposal()
        store.write_events(run_id=live, events=[d_live])
        store.write_events(run_id=ended, events=[d_ended])
        store.end_run(run_id=ended, status="finished")
        assert store.flush(20)
    res = invoke("approve", ended, d_ended.id, "--db", sqlite_url, "--by", "t")
    assert res.exit_code == 0, res.output
    assert "the run has ended (status finished), so the answer is recorded only" in res.output
    assert "next flush" not in res.output
    res = invoke("reject", live, d_live.id, "--db", sqlite_url, "--by", "t")
    assert res.exit_code == 0, res.output
    assert "the run picks it up at its next flush" in res.output and "has ended" not in res.output
