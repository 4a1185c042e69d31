"""Checkpoints are distrusted until checked: atomic saves, registry, validation, fallback, kill switch."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from stabmon.checkpoints import (
    REGISTRY_NAME,
    STOP_EXIT_CODE,
    CheckpointManager,
    KillSwitch,
    NoValidCheckpointError,
)


def state(step: int) -> dict[str, Any]:
    model = torch.nn.Linear(4, 3)
    torch.manual_seed(step)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "clip": float("inf")}


class RecordingSink:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def write_checkpoint(self, **kw: Any) -> None:
        self.rows.append(kw)


def manager(tmp_path: Path, **kw: Any) -> CheckpointManager:
    return CheckpointManager(tmp_path / "ckpt", **kw)


def test_truncated_newest_falls_back_to_the_previous(tmp_path: Path) -> None:
    m = manager(tmp_path)
    m.save(state(10), step=10)
    newest = m.save(state(20), step=20)
    data = Path(newest.path).read_bytes()
    Path(newest.path).write_bytes(data[: len(data) // 2])
    info, loaded = m.last_known_good(before_step=100)
    assert info.step == 10 and loaded["step"] == 10


def test_same_size_corruption_is_caught_by_loading(tmp_path: Path) -> None:
    m = manager(tmp_path)
    m.save(state(10), step=10)
    newest = m.save(state(20), step=20)
    size = os.path.getsize(newest.path)
    Path(newest.path).write_bytes(b"\0" * size)  # byte count still matches
    assert m.validate(newest)[1].startswith("does not load")
    assert m.last_known_good()[0].step == 10


def test_nan_in_one_tensor_falls_back_to_the_previous(tmp_path: Path) -> None:
    m = manager(tmp_path)
    m.save(state(10), step=10)
    bad = state(20)
    bad["optimizer"]["state"][0]["exp_avg_sq"][1, 2] = float("nan")
    info = m.save(bad, step=20)
    assert m.validate(info)[1] == "non-finite values in optimizer.state.0.exp_avg_sq"
    assert m.last_known_good()[0].step == 10


def test_nothing_valid_is_a_clear_error(tmp_path: Path) -> None:
    sink = RecordingSink()
    m = manager(tmp_path, sink=sink, run_id="r1")
    a = m.save(state(10), step=10)
    b = m.save(state(20), step=20)
    Path(a.path).unlink()
    Path(b.path).write_bytes(b"garbage")
    with pytest.raises(NoValidCheckpointError) as exc:
        m.last_known_good()
    msg = str(exc.value)
    assert msg.startswith(f"no valid checkpoint at all in {tmp_path / 'ckpt'}")
    assert f"{a.path}: file does not exist" in msg and f"{b.path}: byte count 7 differs" in msg
    assert [(r["step"], r["valid"]) for r in sink.rows] == [(10, True), (20, True), (20, False), (10, False)]
    with pytest.raises(NoValidCheckpointError, match="no checkpoints registered"):
        manager(tmp_path / "empty").last_known_good()


def test_only_checkpoints_saved_before_the_step_qualify(tmp_path: Path) -> None:
    m = manager(tmp_path, keep=5)
    for s in (100, 200, 300):
        m.save(state(s), step=s)
    assert m.last_known_good(before_step=250)[0].step == 200
    assert m.last_known_good(before_step=200)[0].step == 200
    with pytest.raises(NoValidCheckpointError, match="at or before step 50"):
        m.last_known_good(before_step=50)


def test_keep_prunes_own_files_but_never_the_users(tmp_path: Path) -> None:
    user = tmp_path / "mine.pt"
    torch.save(state(5), user)
    m = manager(tmp_path, keep=2)
    m.register(user, step=5)
    for s in (10, 20, 30):
        m.save(state(s), step=s)
    assert [(c.step, c.own) for c in m.checkpoints] == [(5, False), (20, True), (30, True)]
    assert user.exists() and not (tmp_path / "ckpt" / "ckpt-000000010.pt").exists()


def test_an_open_incidents_rollback_target_is_not_pruned_while_it_is_answered(tmp_path: Path) -> None:
    """An incident whose onset is step 12 opens after the checkpoint of step 20; with keep=2 the saves at 30 and
    40 (made while it is diagnosed and answered) would push out the checkpoint of step 10, the one its rollback
    needs. Held, it stays (one file over keep) until the incident closes."""
    m = manager(tmp_path, keep=2)
    for s in (10, 20):
        m.save(state(s), step=s)
    m.hold_before = 12
    for s in (30, 40):
        m.save(state(s), step=s)
    assert [c.step for c in m.checkpoints] == [10, 30, 40]
    assert m.last_known_good(before_step=12)[0].step == 10
    m.hold_before = None  # the incident closed: keep applies again at the next save
    m.save(state(50), step=50)
    assert [c.step for c in m.checkpoints] == [40, 50]


def test_a_run_starting_before_registered_checkpoints_sets_them_aside_without_deleting_them(tmp_path: Path) -> None:
    """A fresh run (step 0) in the directory of a longer one: the other's later checkpoints are never restored nor
    resumed from, do not count against ``keep`` (so the new run's own survive for its rollback), and are not this
    run's to delete."""
    first = manager(tmp_path, keep=3)
    for s in (40, 50, 60):
        first.save(state(s), step=s)
    again = manager(tmp_path, keep=3)  # a new process, a new run
    assert again.starts_at(60) == [] and again.timeline == 0  # nothing after its start: nothing touched
    aside = again.starts_at(0)
    assert [e.step for e in aside] == [40, 50, 60]
    for s in (10, 20, 30):
        again.save(state(s), step=s)
    assert again.last_known_good(before_step=25)[0].step == 20
    assert again.latest() is not None and again.latest().step == 30  # a resume continues this run's line
    assert all(Path(e.path).is_file() for e in aside)  # the other run's files are still there
    assert [(c.step, c.abandoned, c.own) for c in manager(tmp_path).checkpoints] == [  # and so says the registry
        (10, False, True), (20, False, True), (30, False, True),
        (40, True, False), (50, True, False), (60, True, False)]
    with pytest.raises(NoValidCheckpointError):
        again.last_known_good(before_step=5)  # (the first run's files are no candidates)


def test_registry_is_persisted_beside_the_files(tmp_path: Path) -> None:
    m = manager(tmp_path)
    info = m.save(state(10), step=10)
    on_disk = json.loads((tmp_path / "ckpt" / REGISTRY_NAME).read_text())
    assert on_disk == {"checkpoints": [{"step": 10, "path": info.path, "nbytes": info.nbytes, "own": True,
                                        "timeline": 0, "abandoned": False}]}
    assert info.nbytes == os.path.getsize(info.path)
    assert manager(tmp_path).checkpoints == [info]  # a new process sees the same registry
    assert m.state_dict() == on_disk
    other = manager(tmp_path / "b")
    other.load_state_dict(m.state_dict())
    assert other.checkpoints == [info]


def test_save_is_atomic_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    m = manager(tmp_path)
    m.save(state(1), step=1)

    class Unsaveable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError):
        m.save({"x": Unsaveable()}, step=2)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["ckpt-000000001.pt", REGISTRY_NAME]


def test_maybe_save_follows_every(tmp_path: Path) -> None:
    m = manager(tmp_path, every=5)
    saved = [s for s in range(0, 16) if m.maybe_save(lambda: {"w": torch.zeros(1)}, step=s)]
    assert saved == [5, 10, 15]


def test_register_requires_an_existing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="cannot register checkpoint"):
        manager(tmp_path).register(tmp_path / "missing.pt", step=1)


def test_sink_failures_never_raise(tmp_path: Path) -> None:
    class Broken:
        def write_checkpoint(self, **kw: Any) -> None:
            raise OSError("database is down")

    m = manager(tmp_path, sink=Broken(), run_id="r")
    m.save(state(1), step=1)
    assert m.store_errors == 1


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^checkpoints\.every must be > 0, got 0$"):
        manager(tmp_path, every=0)
    with pytest.raises(ValueError, match=r"^checkpoints\.keep must be >= 1, got 0$"):
        manager(tmp_path, keep=0)
    with pytest.raises(ValueError, match=r"^kill_switch\.every must be >= 1, got 0$"):
        KillSwitch(tmp_path / "STOP", every=0)


def test_kill_switch_checks_every_n_calls(tmp_path: Path) -> None:
    path = tmp_path / "STOP"
    ks = KillSwitch(path, every=3)
    path.write_text("")
    assert [ks.triggered() for _ in range(6)] == [False, False, True, False, False, True]
    assert ks.reason() == f"kill switch file {path} appeared"
    assert STOP_EXIT_CODE not in (0, 1, 2)
