"""A hostile or broken ``trainer_state.json``: a bad value costs only itself, and what is not a file is refused.

Before, the importer ``json.load``-ed the whole file: a value that was a 401-digit integer raised an uncaught
``OverflowError``; one 5,001-digit integer rejected the whole file (0 of 20 good entries imported: Python's
int-string limit); ``/dev/zero`` filled 2.4 GB before a ``MemoryError``; a FIFO blocked for ever; a folder named
``trainer_state.json`` ended in a traceback. Now entries are read one at a time (ijson's C backend), a value
beyond float range is a counted skip of its entry, and a FIFO or a device is a one-line error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_support import report

from stabmon.replay.importers import hf_trainer

GOOD = [{"step": s, "loss": 2.0 + 1 / s, "grad_norm": 0.5, "learning_rate": 1e-4} for s in range(1, 21)]


def _with(bad_value: str, tmp_path: Path, *, key: str = "loss") -> Path:
    """A ``trainer_state.json`` of 20 entries whose 11th (step 11) has ``key`` written as ``bad_value`` (raw
    JSON text)."""
    body = [json.dumps(e) for e in GOOD]
    body[10] = {"loss": '{"step": 11, "grad_norm": 0.5, "loss": %s}',
                "grad_norm": '{"step": 11, "loss": 2.0, "grad_norm": %s}',
                "step": '{"loss": 2.0, "step": %s}'}[key] % bad_value
    path = tmp_path / "trainer_state.json"
    path.write_text('{"global_step": 20, "log_history": [' + ",\n".join(body) + "]}")
    return path


@pytest.mark.parametrize(("name", "value", "key"), [
    ("401-digit integer", "1" * 401, "loss"),
    ("5001-digit integer", "2" * 5001, "loss"),
    ("negative 5001-digit integer", "-" + "3" * 5001, "loss"),
    ("exponent beyond float range", "1e400", "loss"),
    ("20-digit integer", "9" * 20, "grad_norm"),
    ("30-digit step", "9" * 30, "step"),
])
def test_a_number_beyond_float_range_costs_only_its_entry(name: str, value: str, key: str, tmp_path: Path) -> None:
    result = hf_trainer.read(_with(value, tmp_path, key=key))
    steps = [r.step for batch in result.batches(100) for r in batch]
    if key == "grad_norm":  # 1e20 is a float: read as one (before, ijson's 64-bit integers ended the whole parse)
        values = {r.step: r.metrics["grad_norm"] for batch in result.batches(100) for r in batch}
        assert steps == list(range(1, 21)) and result.malformed == 0 and values[11] == float(value), result.problems
    else:
        assert steps == [s for s in range(1, 21) if s != 11], f"{name}: {len(steps)} of 19 good entries imported"
        assert result.malformed == 1 and "entry 10" in result.problems[0], result.problems
    report("hostile trainer_state.json value", value=name, good_entries_imported=len(set(steps)),
           problems=result.malformed)


def test_nan_and_infinity_tokens_are_still_values(tmp_path: Path) -> None:
    path = tmp_path / "trainer_state.json"
    path.write_text('{"log_history": [{"step": 1, "loss": 2.0, "grad_norm": NaN}, '
                    '{"step": 2, "loss": 1.0, "grad_norm": Infinity}, {"step": 3, "loss": -Infinity}]}')
    result = hf_trainer.read(path)
    rows = [dict(r.metrics) for batch in result.batches(10) for r in batch]
    assert str(rows[0]["grad_norm"]) == "nan" and rows[1]["grad_norm"] == float("inf")
    assert rows[2]["loss"] == float("-inf") and result.malformed == 0


def test_a_value_split_across_read_chunks_is_read_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_trainer.NumberGuard, "CHUNK", 7)  # every token straddles a chunk boundary somewhere
    path = _with("1" * 401, tmp_path)
    text = path.read_text().replace('"grad_norm": 0.5', '"grad_norm": NaN', 3)
    path.write_text(text)
    result = hf_trainer.read(path)
    rows = {r.step: dict(r.metrics) for batch in result.batches(100) for r in batch}
    assert sorted(rows) == [s for s in range(1, 21) if s != 11] and result.malformed == 1
    assert sum(1 for m in rows.values() if m["grad_norm"] != m["grad_norm"]) == 3


def _import(target: str, tmp_path: Path, timeout: float = 60) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "stabmon", "import", target, "--format", "hf_trainer", "--run", "x",
           "--db", f"sqlite:///{tmp_path / 'runs.db'}"]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    return proc.returncode, proc.stderr, time.monotonic() - started


@pytest.mark.parametrize("kind", ["folder", "fifo", "/dev/zero"])
def test_what_is_not_a_file_is_one_line_and_no_hang(kind: str, tmp_path: Path) -> None:
    if kind == "folder":
        target = tmp_path / "trainer_state.json"
        target.mkdir()
    elif kind == "fifo":
        target = tmp_path / "state.fifo"
        os.mkfifo(target)
    else:
        target = Path("/dev/zero")
        if not target.exists():
            pytest.skip("no /dev/zero on this machine")
    code, err, seconds = _import(str(target), tmp_path)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    assert "Traceback" not in err
    report("trainer_state.json that is not a file", kind=kind, seconds=round(seconds, 1), line=lines[0])
