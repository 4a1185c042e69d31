"""Imports that meet huge fields and lines, and imports that die: a record over the documented size is a counted
skip in bounded memory; an import killed with SIGKILL reads as interrupted and is replaced by the next import of
its name (one run per name)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fault_support import count, peak_run, report, wait_for
from typer.testing import CliRunner

from stabmon.cli import app
from stabmon.replay.importers.tabular import MAX_LINE_BYTES

BOUND_MIB = 300  # the 2-line footprint is ~133 MiB; before, one 100 MB field peaked at 587 MiB
HUGE = 100 * (1 << 20)


def _import(path: Path, db: Path, *extra: str) -> tuple[int, dict, str, float]:
    cmd = [sys.executable, "-m", "stabmon", "import", str(path), "--run", "r", "--db", f"sqlite:///{db}", "--json",
           *extra]
    code, out, err, peak = peak_run(cmd, db.parent)
    return code, (json.loads(out) if code == 0 else {}), err, peak


def _write_with_a_huge_record(path: Path, head: str, row: str, huge: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(head.encode())
        fh.write("".join(row.format(s=s) for s in range(500)).encode())
        fh.write(huge)
        fh.write("".join(row.format(s=s) for s in range(501, 1000)).encode())


def test_a_hundred_megabyte_csv_field_is_a_counted_skip_in_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "huge.csv"
    _write_with_a_huge_record(path, "step,loss,note\n", "{s},2.5,ok\n", b"500,2.5," + b"x" * HUGE + b"\n")
    code, out, err, peak = _import(path, tmp_path / "a.db")
    assert code == 0, err[-2000:]
    assert out["records"] == 999 and out["malformed"] == 1, out
    assert any("huge.csv:502: a line of" in p and "skipped" in p for p in out["problems"]), out["problems"]
    report("CSV with one 100 MB field", records="999/999 (+1 skipped, counted)", peak_rss_mib=round(peak),
           max_line_bytes=MAX_LINE_BYTES)
    assert peak < BOUND_MIB, f"peak RSS {peak:.0f} MiB"


def test_a_hundred_megabyte_json_line_is_a_counted_skip_in_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "huge.jsonl"
    row = '{{"step": {s}, "loss": 2.5}}\n'
    _write_with_a_huge_record(path, "", row, b'{"step": 500, "note": "' + b"x" * HUGE + b'"}\n')
    code, out, err, peak = _import(path, tmp_path / "b.db")
    assert code == 0, err[-2000:]
    assert out["records"] == 999 and out["malformed"] == 1, out
    assert any("huge.jsonl:501: a line longer than" in p for p in out["problems"]), out["problems"]
    report("JSONL with one 100 MB line", records="999/999 (+1 skipped, counted)", peak_rss_mib=round(peak))
    assert peak < BOUND_MIB, f"peak RSS {peak:.0f} MiB"


def test_a_hundred_megabyte_header_is_one_line_in_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "header.csv"
    with open(path, "wb") as fh:
        fh.write(b"step," + b"h" * HUGE + b"\n" + b"".join(b"%d,2.5\n" % s for s in range(100)))
    code, _, err, peak = _import(path, tmp_path / "h.db", "--format", "generic")
    assert code == 1 and err.strip().count("\n") == 0 and "header line is longer than" in err, err[-2000:]
    report("CSV with a 100 MB header", exit_code=code, stderr_lines=1, peak_rss_mib=round(peak))
    assert peak < BOUND_MIB, f"peak RSS {peak:.0f} MiB"  # before: 799 MiB


def _steps(url: str) -> int:
    """Steps stored so far (0 while the database or its schema is not there yet)."""
    try:
        return count(url, "select count(*) from steps")
    except Exception:  # noqa: BLE001 - the import has not created it yet
        return 0


def test_an_import_killed_midway_reads_interrupted_and_is_replaced(tmp_path: Path) -> None:
    rows = 300_000
    path, db = tmp_path / "big.csv", tmp_path / "c.db"
    with open(path, "w") as fh:
        fh.write("step,loss\n")
        fh.writelines(f"{s},{2.0 + (s % 7) / 10}\n" for s in range(rows))
    url = f"sqlite:///{db}"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "stabmon", "import", str(path), "--run", "big", "--db", url],
                            env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: _steps(url) > 0, timeout=120)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    partial = count(url, "select count(*) from steps")
    runner = CliRunner()
    listed = json.loads(runner.invoke(app, ["runs", "--json", "--db", url]).stdout)
    assert [(r["name"], r["status"]) for r in listed] == [("big", "interrupted")], listed  # before: running
    started = time.monotonic()
    again = runner.invoke(app, ["import", str(path), "--run", "big", "--db", url, "--json"])
    assert again.exit_code == 0, again.output
    listed = json.loads(runner.invoke(app, ["runs", "--json", "--db", url]).stdout)
    assert [(r["name"], r["status"], r["steps"]) for r in listed] == [("big", "completed", rows)], listed
    refused = runner.invoke(app, ["import", str(path), "--run", "big", "--db", url])
    assert refused.exit_code == 1 and "exists already" in refused.output and "--replace" in refused.output
    assert refused.output.strip().count("\n") == 0, refused.output
    report("import killed with SIGKILL", partial_steps=f"{partial}/{rows}", status_after="interrupted",
           reimport_steps=f"{rows}/{rows}", runs_named=1, reimport_s=round(time.monotonic() - started, 1))
