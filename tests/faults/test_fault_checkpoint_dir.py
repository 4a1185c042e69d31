"""A checkpoint directory taken away under a running process: made read-only (a rollback still restores and
goes on, saying what it could not record) or deleted (checkpoint-and-stop still writes its checkpoint).

Each case runs ``ckpt_loop.py`` in its own process. Run as root, that process is started without the
capability to override file permissions (``setpriv``), so a read-only directory is read-only to it as it
would be to any user.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fault_support import report, stored_steps

from stabmon.checkpoints import STOP_EXIT_CODE

HERE = Path(__file__).resolve().parent


def _run(tmp_path: Path, fault: str, ladder: str) -> tuple[int, dict, str]:
    ckpt, url = tmp_path / "ckpt", f"sqlite:///{tmp_path / 'run.db'}"
    cmd = [sys.executable, str(HERE / "ckpt_loop.py"), str(ckpt), url, fault, ladder]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: a read-only directory cannot be made read-only")
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", *cmd]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    if ckpt.is_dir():
        os.chmod(ckpt, 0o755)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert lines, done.stdout[-2000:] + done.stderr[-3000:]
    return done.returncode, json.loads(lines[-1]), done.stderr


def test_a_read_only_checkpoint_directory_does_not_fail_a_rollback(tmp_path: Path) -> None:
    code, out, log = _run(tmp_path, "readonly", "rollback")
    (rollback,) = [a for a in out["after"] if "checkpoint_step" in a or "error" in a]
    assert "error" not in rollback, rollback  # before: the registry write failed the whole rollback
    assert rollback["checkpoint_step"] <= 30 and "registry_not_updated" in rollback, rollback
    assert code == 0 and out["exit_code"] == 0 and out["step"] == 60  # went on: no escalation to stop
    assert "cannot be written" in log or "could not be updated" in log
    report("read-only checkpoint directory", exit_code=code, restored_to=rollback["checkpoint_step"],
           rolled_back_from=rollback["from_step"], registry="not updated (recorded)",
           steps_stored=len(stored_steps(f"sqlite:///{tmp_path / 'run.db'}", _run_id(tmp_path))))


def test_a_deleted_checkpoint_directory_still_gets_the_stop_checkpoint(tmp_path: Path) -> None:
    code, out, _ = _run(tmp_path, "deleted", "stop")
    (stop,) = [a for a in out["after"] if "exit_code" in a]
    assert code == STOP_EXIT_CODE and stop["path"], stop  # before: path None, no checkpoint to resume from
    assert Path(stop["path"]).is_file() and "registry.json" in out["files"], out
    report("deleted checkpoint directory", exit_code=code, stop_checkpoint=Path(stop["path"]).name,
           files=len(out["files"]))


def test_an_unwritable_checkpoint_directory_is_reported_at_start_and_at_the_stop(tmp_path: Path) -> None:
    code, out, log = _run(tmp_path, "readonly-start", "stop")
    (stop,) = [a for a in out["after"] if "exit_code" in a]
    assert code == STOP_EXIT_CODE and stop["path"] is None and "could not be written" in stop["checkpoint_error"]
    first_error = next(ln for ln in log.splitlines() if "cannot be written" in ln or "WITHOUT" in ln)
    assert "cannot be written" in first_error  # said at start, before any step
    assert "STOPPING WITHOUT A CHECKPOINT" in log
    report("unwritable checkpoint directory at start", exit_code=code, reported_at_start=True)


def _run_id(tmp_path: Path) -> str:
    import sqlalchemy as sa

    engine = sa.create_engine(f"sqlite:///{tmp_path / 'run.db'}")
    with engine.connect() as conn:
        run = conn.execute(sa.text("select id from runs")).scalar_one()
    engine.dispose()
    return str(run)
