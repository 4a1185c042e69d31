"""Hostile input files: runbook YAML built to exhaust memory or crash the parser, and logs far larger than
memory should allow for them."""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stabmon.cli import app
from stabmon.runbook import RunbookError, load_runbook

RULES = "rules:\n  - name: spike\n    when: {kind: spike}\n    ladder: [{action: set_clip, params: {max_norm: 1.0}}]\n"


def laughs(levels: int) -> str:
    """The billion-laughs document: each level refers ten times to the one before."""
    out = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        p = f"*l{i - 1}"
        out.append(f"l{i}: &l{i} [{', '.join([p] * 10)}]")
    return "\n".join(out) + "\n" + RULES


@pytest.mark.parametrize(
    ("text", "line", "needle"),
    [
        (laughs(9), 2, "aliases expand to more than 100000 values"),
        ("rules: " + "[" * 5000 + "]" * 5000 + "\n", 1, "nested deeper than 64 levels"),
        ("name: x\n" + RULES.replace("name: spike", "name: spike\n    name: other"), 4, "duplicate key 'name'"),
        ("name: x\nname: y\n" + RULES, 2, "duplicate key 'name' (first at line 1)"),
        ("name: ok\n# caf\xe9\n" + RULES, 2, "not UTF-8 text"),
        ("# " + "x" * (1 << 20) + "\n" + RULES, 1, "more than the 1048576 a runbook may hold"),
    ],
    ids=["billion-laughs", "deep-nesting", "duplicate-nested-key", "duplicate-top-key", "bad-utf8", "huge"],
)
def test_hostile_runbooks_are_one_line_file_line_errors(tmp_path: Path, text: str, line: int, needle: str) -> None:
    path = tmp_path / "hostile.yaml"
    path.write_bytes(text.encode("latin-1") if "\xe9" in text else text.encode())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises(RunbookError) as err:
        load_runbook(path)
    took, grew_kib = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert str(err.value).startswith(f"{path}:{line}: ") and needle in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
    assert took < 10 and grew_kib < 200_000, (took, grew_kib)  # bounded: nothing was expanded
    result = CliRunner().invoke(app, ["runbook", "validate", str(path)])
    assert result.exit_code == 1 and "Traceback" not in result.output and needle in result.output


def _import(tmp_path: Path, name: str, text: str, *args: str) -> tuple[int, str, str]:
    path = tmp_path / name
    path.write_text(text)
    url = f"sqlite:///{tmp_path / 'imp.db'}"
    result = CliRunner().invoke(app, ["import", str(path), "--run", "r", "--db", url, *args])
    return result.exit_code, result.output, url


def test_a_repeated_megatron_line_does_not_flood_the_run_config(tmp_path: Path) -> None:
    import json

    from fault_support import count

    line = " iteration {}/ 100 | lm loss: 2.0 | grad norm: 1.0 |\n"
    text = "".join(line.format(s) for _ in range(3000) for s in (1, 2))  # 2,999 "restarts"
    code, out, url = _import(tmp_path, "megatron.log", text, "--json")
    assert code == 0, out
    summary = json.loads(out)
    assert len(summary["restarts"]) == 100 and summary["restarts_total"] == 2999  # bounded in the output ...
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    with engine.connect() as conn:
        config = json.loads(conn.execute(sa.text("select config from runs")).scalar())
    engine.dispose()
    assert len(config["restarts"]) == 100 and config["restarts_total"] == 2999  # ... and in the config
    assert count(url, "select count(*) from steps") == 2


@pytest.mark.parametrize(
    ("text", "needle"),
    [("step,loss\nx,y\n", "no step records found"), (f"step,{'m' * 300}\n1,2.0\n", "more than the store's 255")],
    ids=["nothing-readable", "metric-name-too-long"],
)
def test_an_import_that_cannot_be_stored_leaves_no_run_behind(tmp_path: Path, text: str, needle: str) -> None:
    code, out, url = _import(tmp_path, "log.csv", text)
    assert code == 1 and needle in out and out.strip().count("\n") == 0, out
    assert not (tmp_path / "imp.db").exists() or _runs(url) == 0


def _import_peak_mib(path: Path, db: Path) -> float:
    """Peak RSS of ``stabmon import PATH`` in a subprocess (:func:`fault_support.peak_run`)."""
    from fault_support import peak_run

    cmd = [sys.executable, "-m", "stabmon", "import", str(path), "--run", "r", "--db", f"sqlite:///{db}", "--json"]
    code, out, err, peak = peak_run(cmd, db.parent)
    assert code == 0, out[-2000:] + err[-2000:]
    return peak


@pytest.mark.slow
def test_a_large_log_is_imported_in_bounded_memory(tmp_path: Path) -> None:
    from fault_support import count, report

    tiny, big = tmp_path / "tiny.csv", tmp_path / "big.csv"
    tiny.write_text("step,loss\n1,2.0\n")
    rows = 500_000
    with open(big, "w") as fh:
        fh.write("step,loss,grad_norm,lr,tokens_per_sec\n")
        for start in range(0, rows, 50_000):
            fh.write("".join(f"{s},{2 + 1 / (s + 1):.6f},{0.5 + s % 97 / 100:.4f},6.0e-05,{150000 + s % 1000}\n"
                             for s in range(start, start + 50_000)))
    footprint = _import_peak_mib(tiny, tmp_path / "tiny.db")
    peak = _import_peak_mib(big, tmp_path / "big.db")
    stored = count(f"sqlite:///{tmp_path / 'big.db'}", "select count(*) from steps")
    mb = big.stat().st_size / 1e6
    report("13 large CSV import", mb=mb, rows=rows, stored=stored, footprint_mib=footprint, peak_mib=peak)
    assert stored == rows
    # Reading the whole file first cost ~12 MiB per MB of CSV (about 290 MiB above the footprint here, 3.76 GB
    # for 200 MB); streamed, the growth is bounded by the batch sizes, not by the file.
    assert peak - footprint < 150, (footprint, peak)


def _runs(url: str) -> int:
    from fault_support import count

    return count(url, "select count(*) from runs")
