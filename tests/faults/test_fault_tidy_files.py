"""Files nothing else would clean up: a save killed outright, a database path that does not exist.

- A SIGKILL (the OOM killer, a lost node) in the middle of a checkpoint save left its temporary file beside
  the checkpoints forever (a 1 GB model: 1 GB per kill). A save's temporary file now names its writer (host
  and process); the next :class:`~stabmon.checkpoints.CheckpointManager` on the directory removes those whose
  process is gone, and any older than a day, and leaves a save in progress alone.
- ``stabmon db upgrade --db sqlite:////nonexistent/dir/x.db`` created the whole directory tree; now one line
  says the folder does not exist, and nothing is created.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fault_support import report
from typer.testing import CliRunner

from stabmon.checkpoints import REGISTRY_NAME, STALE_AFTER_S, CheckpointManager

HERE = Path(__file__).resolve().parent


def _killed_in_a_save(tmp_path: Path) -> Path:
    """``save_signal_loop.py`` stopped half-way through writing its step-15 checkpoint, then SIGKILLed."""
    ckpt, marker = tmp_path / "ckpt", tmp_path / "marker"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(HERE / "save_signal_loop.py"), str(ckpt), f"sqlite:///{tmp_path / 'run.db'}",
           "write-middle", str(marker)]
    with subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the save never reached its middle"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    return ckpt


def test_the_temporary_file_of_a_killed_save_is_removed_when_the_directory_is_next_opened(tmp_path: Path) -> None:
    ckpt = _killed_in_a_save(tmp_path)
    left = [p.name for p in ckpt.iterdir() if p.name.endswith(".tmp")]
    assert len(left) == 1, left  # what a kill leaves (before: forever)
    size = (ckpt / left[0]).stat().st_size
    manager = CheckpointManager(ckpt)
    assert [p.name for p in ckpt.iterdir() if p.name.endswith(".tmp")] == []
    assert (ckpt / REGISTRY_NAME).is_file() and manager.checkpoints
    for info in manager.checkpoints:  # the whole checkpoints stay, and load
        state, problem = manager.validate(info)
        assert problem is None and state is not None, (info, problem)
    report("temporary file of a killed save", bytes_removed=size, checkpoints_kept=len(manager.checkpoints))


def test_a_save_in_progress_and_a_recent_file_of_another_host_are_left_alone(tmp_path: Path) -> None:
    import socket

    ours = tmp_path / f".ckpt-000000010.pt.~{socket.gethostname()}~{os.getpid()}~abc.tmp"  # this process: alive
    other = tmp_path / ".ckpt-000000010.pt.~another-node~12345~abc.tmp"  # another host: cannot be checked
    old = tmp_path / ".ckpt-000000005.pt.~another-node~12345~def.tmp"
    unnamed = tmp_path / ".ckpt-000000005.pt.x1y2z3.tmp"  # an older release's name, no writer in it
    for path in (ours, other, old, unnamed):
        path.write_bytes(b"partial")
    day_and_more = time.time() - STALE_AFTER_S - 60
    os.utime(old, (day_and_more, day_and_more))
    os.utime(unnamed, (day_and_more, day_and_more))
    CheckpointManager(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == sorted([ours.name, other.name])


def test_db_upgrade_on_a_folder_that_does_not_exist_is_one_line_and_creates_nothing(tmp_path: Path) -> None:
    from stabmon.cli import app

    target = tmp_path / "no" / "such" / "dir" / "x.db"
    result = CliRunner().invoke(app, ["db", "upgrade", "--db", f"sqlite:///{target}"])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [f"error: no folder '{target.parent}' for the SQLite database 'x.db': create it first"], lines
    assert not (tmp_path / "no").exists()
    target.parent.mkdir(parents=True)
    assert CliRunner().invoke(app, ["db", "upgrade", "--db", f"sqlite:///{target}"]).exit_code == 0
    assert target.is_file()
