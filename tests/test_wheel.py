"""The built wheel carries the migrations and runbooks and works outside the source tree."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_installs_and_upgrades_a_database_outside_the_repo(tmp_path: Path) -> None:
    dist, site, work = tmp_path / "dist", tmp_path / "site", tmp_path / "work"
    work.mkdir()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(REPO),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    [wheel] = dist.glob("stabmon-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"stabmon/_migrations/env.py", "stabmon/_migrations/script.py.mako"} <= names
    assert any(n.startswith("stabmon/_migrations/versions/0001_") for n in names)
    assert any(n.startswith("stabmon/_runbooks/") and n.endswith(".yaml") for n in names)
    assert "stabmon/report/assets/report.js" in names  # the report inlines it; a wheel without it draws nothing

    # Only the wheel's own files; the dependencies (sqlalchemy, alembic, ...) come from this environment.
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("STABMON_DB_URL", None)
    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import stabmon, stabmon.resources as r; print(stabmon.__file__);"
            "print(r.migrations_dir()); print(r.runbooks_dir())",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in where), where
    assert Path(where[1]).name == "_migrations" and Path(where[2]).name == "_runbooks"

    db = work / "fresh.db"
    done = subprocess.run(
        [sys.executable, "-m", "stabmon", "db", "upgrade", "--db", f"sqlite:///{db}"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    head = sorted(p.name for p in (REPO / "migrations" / "versions").glob("[0-9]*.py"))[-1][:4]
    assert f"is at schema {head}" in done.stdout and db.is_file()
