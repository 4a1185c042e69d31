"""``stabmon eval`` over a corpus of mixed formats: each LABELS.csv row may say how its file is read (``format`` or
``pattern`` column), runs are joined only where the labels say so (a glob, the ``run`` column) or ``--group-wandb``
asks for it, and a bad row is one line naming the labels file and line, the row's file and the column."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stabmon.replay.eval import STABMON, evaluate
from stabmon.replay.labels import read_labels, runs_of

HEADER = "file,step_start,step_end,kind,label_source,note,format,pattern,run\n"
N, SPIKE = 400, 250


def _series(n: int = N, spike: int | None = SPIKE, start: int = 0) -> list[tuple[int, float, float]]:
    """(step, loss, grad norm): a flat, wiggling run with a 3-step spike of both at ``spike``."""
    out = []
    for s in range(start, n):
        loss, norm = 3.0 + 0.02 * math.sin(s), 0.5 + 0.02 * math.cos(s * 1.7)
        if spike is not None and spike <= s < spike + 3:
            loss, norm = loss + 30.0, norm * 40
        out.append((s, loss, norm))
    return out


def write_llmc(path: Path, **kw: int | None) -> None:
    path.write_text("".join(f"s:{s} trl:{loss:.4f} lr:0.000600 norm:{norm:.4f}\n" for s, loss, norm in _series(**kw)))


def write_lightning_csv(path: Path, **kw: int | None) -> None:
    rows = ["epoch,step,train_loss,grad_norm"] + [f"0,{s},{loss},{norm}" for s, loss, norm in _series(**kw)]
    path.write_text("\n".join(rows) + "\n")


def write_nanogpt(path: Path, **kw: int | None) -> None:
    path.write_text("".join(f"iter {s}: loss {loss:.4f}, time 21.30ms, mfu 0.05%\n" for s, loss, _ in _series(**kw)))


def write_custom(path: Path, **kw: int | None) -> None:
    path.write_text("".join(f"2026-01-01 | it={s} | lm={loss:.4f}\n" for s, loss, _ in _series(**kw)))


CUSTOM = r"it=(?P<step>\d+) \| lm=(?P<loss>\S+)"


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """One llm.c log, one Lightning CSV, one nanoGPT stdout, one text log no importer knows; the nanoGPT file's
    name ends in ``_`` and 8 characters beside another such file, which is a different run."""
    write_llmc(tmp_path / "main.log")
    write_lightning_csv(tmp_path / "metrics.csv")
    write_nanogpt(tmp_path / "out_abcd1234.txt")
    write_nanogpt(tmp_path / "out_zz991234.txt", spike=None)
    write_custom(tmp_path / "custom.log")
    (tmp_path / "LABELS.csv").write_text(
        HEADER
        + f"main.log,{SPIKE},{SPIKE + 2},loss_spike,author,llm.c,llmc,,\n"
        + f"metrics.csv,{SPIKE},{SPIKE + 2},loss_spike,author,Lightning CSVLogger,generic,,\n"
        + f"out_abcd1234.txt,{SPIKE},{SPIKE + 2},loss_spike,author,nanoGPT,nanogpt,,\n"
        + f"out_zz991234.txt,0,{N - 1},none_control,observed_by_us,nanoGPT healthy,nanogpt,,\n"
        + f'custom.log,{SPIKE},{SPIKE + 2},loss_spike,author,any text log,,"{CUSTOM}",\n'
    )
    return tmp_path / "LABELS.csv"


def test_each_row_says_how_its_file_is_read_and_every_run_is_scored(corpus: Path) -> None:
    labels = read_labels(corpus)
    assert [(lb.format, lb.patterns) for lb in labels] == [
        ("llmc", ()), ("generic", ()), ("nanogpt", ()), ("nanogpt", ()), ("pattern", (CUSTOM,))]
    report = evaluate(corpus, peers=False)
    files = {r["file"]: r for r in report.files if r["method"] == STABMON}
    assert {f: (r["steps"], r["error"]) for f, r in files.items()} == {
        "main.log": (N, None), "metrics.csv": (N, None), "out_abcd1234.txt": (N, None),
        "out_zz991234.txt": (N, None), "custom.log": (N, None)}  # the two nanoGPT runs are not joined
    incidents = {r["file"]: r for r in report.incidents if r["method"] == STABMON and r["category"] == "numeric"}
    assert all(r["detected"] for r in incidents.values()), incidents
    assert files["out_zz991234.txt"]["false_alarms"] == 0


def test_a_row_s_reader_wins_over_the_command_s_pattern(corpus: Path) -> None:
    """``--pattern`` reads only the files whose row names no format (here: none is left without one)."""
    report = evaluate(corpus, peers=False, patterns=[r"nothing (?P<step>\d+) (?P<loss>\S+)"])
    assert not [r for r in report.files if r["error"]]


def test_runs_are_joined_only_where_said(tmp_path: Path) -> None:
    write_llmc(tmp_path / "job_ab12cd34.log", n=200, spike=None)
    write_llmc(tmp_path / "job_ef56gh78.log", n=N, start=150)  # resumed from step 150
    write_llmc(tmp_path / "seg1.log", n=200, spike=None)
    write_llmc(tmp_path / "seg2.log", n=N, start=150)
    labels = tmp_path / "LABELS.csv"
    labels.write_text(
        HEADER
        + f"job_ef56gh78.log,{SPIKE},{SPIKE + 2},loss_spike,author,x,,,\n"
        + f"seg2.log,{SPIKE},{SPIKE + 2},loss_spike,author,x,,,resumed\n"
        + "seg1.log,0,149,none_control,observed_by_us,x,,,resumed\n"
    )
    _, specs = runs_of(read_labels(labels), tmp_path)
    assert {n: [p.name for p in s.files] for n, s in specs.items()} == {
        "job_ef56gh78.log": ["job_ef56gh78.log"], "resumed": ["seg1.log", "seg2.log"]}
    _, specs = runs_of(read_labels(labels), tmp_path, group_wandb=True)
    assert [p.name for p in specs["job"].files] == ["job_ab12cd34.log", "job_ef56gh78.log"]
    report = evaluate(labels, peers=False)
    files = {r["file"]: r for r in report.files if r["method"] == STABMON}
    assert files["resumed"]["steps"] == N and files["resumed"]["restarts"] == [150]
    assert files["job_ef56gh78.log"]["steps"] == N - 150
    grouped = {r["file"]: r for r in evaluate(labels, peers=False, group_wandb=True).files if r["method"] == STABMON}
    assert grouped["job"]["steps"] == N and grouped["job"]["restarts"] == [150]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("a.log,1,2,loss_spike,author,x,llmcc,,",
         "L.csv:3 (a.log): column format: unknown format 'llmcc' (known: "),
        ('a.log,1,2,loss_spike,author,x,,"it=(?P<step>\\d+ (?P<loss>\\S+)",',
         "L.csv:3 (a.log): column pattern: 'it=(?P<step>\\d+ (?P<loss>\\S+)': not a regular expression"),
        ("a.log,1,2,loss_spike,author,x,,it=(?P<loss>\\S+),",
         "L.csv:3 (a.log): column pattern: 'it=(?P<loss>\\S+)': no (?P<step>...) group"),
        ('a.log,1,2,loss_spike,author,x,llmc,"it=(?P<step>\\d+) (?P<loss>\\S+)",',
         "L.csv:3 (a.log): column pattern: a pattern reads the file as format pattern, but column format says 'llmc'"),
        ("a.log,1,2,loss_spike,author,x,pattern,,",
         "L.csv:3 (a.log): column format: format pattern needs a regular expression in column pattern"),
        ("b.log,1,2,loss_spike,author,x,nanogpt,,",
         "L.csv:3 (b.log): column format: nanogpt, but L.csv:2 reads b.log as llmc"),
    ],
)
def test_a_bad_row_is_one_line_naming_file_row_and_column(tmp_path: Path, row: str, message: str) -> None:
    from stabmon.cli import app

    (tmp_path / "b.log").write_text("s:1 trl:2.0 lr:0.1 norm:1.0\n")
    labels = tmp_path / "L.csv"
    labels.write_text(HEADER + "b.log,1,2,loss_spike,author,x,llmc,,\n" + row + "\n")
    res = CliRunner().invoke(app, ["eval", "--labels", str(labels), "--no-peers"])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1, res.output
    assert lines[0].startswith("error: " + message), lines[0]
    res = CliRunner().invoke(app, ["tune", "--labels", str(labels), "--out", str(tmp_path / "o.yaml")])
    assert res.exit_code == 1 and res.output.strip().splitlines() == lines, res.output


def test_cli_eval_mixed_corpus_json(corpus: Path) -> None:
    from stabmon.cli import app

    res = CliRunner().invoke(app, ["eval", "--labels", str(corpus), "--json", "--no-peers"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.output.splitlines()]
    summary = next(r for r in rows if r["type"] == "summary")
    assert summary["recall"] == 1.0 and summary["numeric_incidents"] == 4


def test_a_run_with_a_row_that_matches_nothing_is_an_error_row(tmp_path: Path) -> None:
    write_llmc(tmp_path / "seg1.log", n=200, spike=None)
    labels = tmp_path / "LABELS.csv"
    labels.write_text(HEADER + "seg1.log,0,149,none_control,observed_by_us,x,llmc,,resumed\n"
                      + f"seg2.log,{SPIKE},{SPIKE + 2},loss_spike,author,x,llmc,,resumed\n")
    row = next(r for r in evaluate(labels, peers=False).files if r["method"] == STABMON)
    assert row["file"] == "resumed" and row["error"] == "no file matches 'seg2.log' under the labels' directory"
