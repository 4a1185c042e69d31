"""Text logs: ``--pattern`` (a regex with named groups) and the sniffed nanoGPT format, through the CLI into a
real SQLite file; an import or replay that finds no metric at all is an error for every format."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from stabmon.cli import app
from stabmon.replay.importers.pattern import compile_patterns, read
from stabmon.replay.importers.sniff import import_file, nothing_read, sniff_format
from stabmon.replay.labels import read_labels, run_files
from stabmon.store import open_store
from stabmon.store.repo import load_steps, resolve_run

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
ITER = r"iter (?P<step>\d+): loss (?P<loss>\S+), time (?P<step_time_ms>[\d.]+)ms"
EVAL = r"step (?P<step>\d+): train loss (?P<eval_train_loss>[\d.]+), val loss (?P<val_loss>[\d.]+)"
NANO_LOG = """\
tokens per iteration will be: 16,384
found vocab_size = 65 (inside data/shakespeare_char/meta.pkl)
number of parameters: 10.65M
step 0: train loss 4.2874, val loss 4.2823
iter 0: loss 4.2654, time 29120.46ms, mfu -100.00%
iter 10: loss 3.2431, time 21.30ms, mfu 0.05%
iter 20: loss 2.7890, time 21.10ms, mfu 0.06%
"""


def invoke(*args: str) -> tuple[int, str]:
    res = runner.invoke(app, list(args), catch_exceptions=False)
    return res.exit_code, res.output


def stored(url: str, run: str) -> dict[int, dict[str, float]]:
    with open_store(url) as store, store.session() as session:
        run_id = resolve_run(session=session, ref=run).id
        return {r.step: dict(r.metrics) for r in load_steps(session=session, run_id=run_id)}


def test_pattern_import_stores_every_named_group_with_units(tmp_path: Path, sqlite_url: str) -> None:
    log = tmp_path / "train.log"
    log.write_text(NANO_LOG)
    code, out = invoke("import", str(log), "--run", "nano", "--db", sqlite_url, "--pattern", ITER,
                       "--pattern", EVAL)
    assert code == 0 and "imported 3 steps (pattern)" in out, out
    steps = stored(sqlite_url, "nano")
    assert steps[0] == pytest.approx({"loss": 4.2654, "step_time": 29.12046, "eval_train_loss": 4.2874,
                                      "val_loss": 4.2823})
    assert steps[10] == pytest.approx({"loss": 3.2431, "step_time": 0.0213})
    assert sorted(steps) == [0, 10, 20]


def test_nanogpt_output_is_sniffed_and_read(tmp_path: Path, sqlite_url: str) -> None:
    log = tmp_path / "out.txt"
    log.write_text(NANO_LOG)
    assert sniff_format(log).FORMAT == "nanogpt"
    code, out = invoke("import", str(log), "--run", "nano", "--db", sqlite_url)
    assert code == 0 and "(nanogpt)" in out, out
    steps = stored(sqlite_url, "nano")
    assert "mfu" not in steps[0]  # nanoGPT's -100% placeholder is not a measurement
    assert steps[20] == pytest.approx({"loss": 2.789, "step_time": 0.0211, "mfu": 0.0006})


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--pattern", r"iter (\d+): loss (?P<loss>\S+)"), "no (?P<step>...) group"),
        (("--pattern", r"iter (?P<step>\d+"), "not a regular expression (missing )"),
        (("--pattern", r"iter (?P<step>\d+)"), "no metric group besides step"),
        (("--pattern", ITER, "--format", "llmc"), "cannot be combined with --format llmc"),
        (("--format", "pattern"), "--format pattern needs --pattern REGEX"),
        (("--pattern", r"^nothing (?P<step>\d+) (?P<loss>\S+)"), "no line of"),
        (("--format", "generic"), "no metric found in"),
    ],
    ids=["no-step-group", "bad-regex", "no-metric-group", "format-conflict", "pattern-format-alone",
         "nothing-matched", "generic-text"],
)
def test_bad_patterns_and_metricless_imports_are_one_line_errors(
    tmp_path: Path, sqlite_url: str, args: tuple[str, ...], needle: str
) -> None:
    log = tmp_path / "train.log"
    log.write_text(NANO_LOG)
    code, out = invoke("import", str(log), "--run", "r", "--db", sqlite_url, *args)
    assert code == 1 and needle in out and out.strip().count("\n") == 0, out
    if needle != "no metric found in":
        return
    assert "train.log" in out  # the file is named
    with open_store(sqlite_url) as store, store.session() as session:  # and no empty run was left behind
        with pytest.raises(ValueError, match="no run"):
            resolve_run(session=session, ref="r")


def test_metricless_table_is_an_error_for_replay_too(tmp_path: Path, sqlite_url: str) -> None:
    table = tmp_path / "steps.csv"
    table.write_text("step,note\n1,warmup\n2,warmup\n")
    code, out = invoke("replay", str(table), "--db", sqlite_url, "--no-store")
    assert code == 1 and out.startswith("error: no metric found in") and "steps.csv" in out, out


def test_replay_reads_a_text_log_with_pattern(tmp_path: Path, sqlite_url: str) -> None:
    log = tmp_path / "train.log"
    log.write_text("".join(f"iter {i}: loss {2.5 - i / 100:.4f}, time 20.00ms\n" for i in range(60)))
    code, out = invoke("replay", str(log), "--db", sqlite_url, "--no-store", "--json", "--pattern", ITER)
    assert code == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["type"] == "summary" and summary["steps"] == 60


def test_replay_of_a_stored_run_refuses_file_options(sqlite_url: str, tmp_path: Path) -> None:
    log = tmp_path / "out.txt"
    log.write_text(NANO_LOG)
    assert invoke("import", str(log), "--run", "nano", "--db", sqlite_url)[0] == 0
    code, out = invoke("replay", "nano", "--db", sqlite_url, "--pattern", ITER)
    assert code == 1 and "is not a file" in out, out


def test_a_resumed_log_supersedes_from_the_restart(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_text("iter 0: loss 3.0, time 1ms\niter 10: loss 2.0, time 1ms\niter 20: loss 9.0, time 1ms\n"
                   "resuming from iter 10\niter 10: loss 2.1, time 1ms\niter 20: loss 1.9, time 1ms\n")
    result = read(log, patterns=[ITER])
    assert [(r.step, r.metrics["loss"]) for r in result.records] == [(0, 3.0), (10, 2.1), (20, 1.9)]
    assert result.restarts == [10]


_NUMBERS = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False).map(lambda x: round(x, 4))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.dictionaries(st.integers(0, 10**6), st.tuples(_NUMBERS, st.floats(0, 1e4).map(lambda x: round(x, 2))),
                         max_size=30),
    noise=st.lists(st.text(alphabet=st.characters(blacklist_characters="\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029",
                                                  blacklist_categories=("Cs",)),  # a lone surrogate is no UTF-8
                           max_size=40).filter(lambda t: "iter" not in t), max_size=10),
)
def test_pattern_round_trips_any_values_among_noise(rows: dict[int, tuple[float, float]], noise: list[str]) -> None:
    lines = [f"[rank0] iter {s}: loss {loss!r}, time {ms!r}ms" for s, (loss, ms) in sorted(rows.items())]
    for i, text in enumerate(noise):
        lines.insert(i * 3 % (len(lines) + 1), text)
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"stabmon-pattern-{os.getpid()}.log"
    path.write_text("\n".join(lines) + "\n")
    try:
        result = read(path, patterns=compile_patterns([ITER]))
        got = {r.step: (r.metrics["loss"], r.metrics["step_time"]) for r in result.records}
    finally:
        path.unlink()
    assert got.keys() == rows.keys() and result.malformed == 0
    for step, (loss, ms) in rows.items():
        assert got[step][0] == loss and math.isclose(got[step][1], ms / 1000)


TRAIN = textwrap.dedent("""
    import json, sys, time
    import torch
    torch.manual_seed(int(sys.argv[2]))
    text = "the quick brown fox jumps over the lazy dog " * 40
    vocab = sorted(set(text)); ids = torch.tensor([vocab.index(c) for c in text])
    model = torch.nn.Sequential(torch.nn.Embedding(len(vocab), 16), torch.nn.Linear(16, len(vocab)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    def batch():
        ix = torch.randint(len(ids) - 1, (32,))
        return ids[ix], ids[ix + 1]
    truth = {}
    for iter_num in range(41):
        if iter_num % 20 == 0:
            with torch.no_grad():
                x, y = batch(); val = torch.nn.functional.cross_entropy(model(x), y).item()
            truth[f"val{iter_num}"] = val
            print(f"step {iter_num}: train loss {val:.4f}, val loss {val:.4f}")
        t0 = time.time()
        x, y = batch(); loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        dt = time.time() - t0
        if iter_num % 5 == 0:
            truth[iter_num] = (loss.item(), dt)
            print(f"iter {iter_num}: loss {loss.item():.4f}, time {dt*1000:.2f}ms, mfu {-100.0:.2f}%")
    json.dump(truth, open(sys.argv[1], "w"))
""")


@pytest.mark.parametrize("seed", [0, 1])
def test_real_training_process_stdout_imports(tmp_path: Path, sqlite_url: str, seed: int) -> None:
    """A real training process prints nanoGPT's lines; its stdout, imported sniffed and with --pattern, holds
    the values the process measured (to the 4 decimals printed)."""
    script, truth_file, log = tmp_path / "train.py", tmp_path / "truth.json", tmp_path / "stdout.txt"
    script.write_text(TRAIN)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        subprocess.run([sys.executable, str(script), str(truth_file), str(seed)], stdout=out, env=env,
                       check=True, timeout=120)
    truth = json.loads(truth_file.read_text())
    assert invoke("import", str(log), "--run", "sniffed", "--db", sqlite_url)[0] == 0
    assert invoke("import", str(log), "--run", "regex", "--db", sqlite_url, "--pattern", ITER,
                  "--pattern", EVAL)[0] == 0
    for run in ("sniffed", "regex"):
        steps = stored(sqlite_url, run)
        assert sorted(steps) == list(range(0, 41, 5))
        for step in range(0, 41, 5):
            loss, dt = truth[str(step)]
            assert steps[step]["loss"] == pytest.approx(loss, abs=5e-5)
            assert steps[step]["step_time"] == pytest.approx(dt, abs=5e-6)
        assert steps[20]["val_loss"] == pytest.approx(truth["val20"], abs=5e-5)


def test_every_labelled_real_log_still_has_metrics(real_runs: Path) -> None:
    """The no-metric error never fires on the real logs of the sniffed formats."""
    files = {f for label in read_labels(real_runs / "LABELS.csv") for f in run_files(label, real_runs)[1]}
    assert len(files) >= 10
    for path in sorted(files):
        with import_file(path) as result:
            assert nothing_read(result, [path]) is None, path


def test_eval_reads_labelled_text_logs_with_pattern(tmp_path: Path) -> None:
    """A labelled run in a text format no importer knows: an error row without --pattern, detected with it."""
    lines = [f"2024-01-01 | it={i} | lm={2.0 + (30.0 if 300 <= i < 305 else 0.0):.4f}" for i in range(400)]
    (tmp_path / "custom.log").write_text("\n".join(lines) + "\n")
    labels = tmp_path / "LABELS.csv"
    labels.write_text("file,step_start,step_end,kind,label_source,note\ncustom.log,300,305,loss_spike,author,x\n")
    rows = lambda out: [json.loads(x) for x in out.strip().splitlines()]  # noqa: E731
    code, out = invoke("eval", "--labels", str(labels), "--json", "--no-peers")
    incident = next(r for r in rows(out) if r["type"] == "incident")
    assert code == 0 and "format not recognised" in incident["error"] and not incident["detected"], out
    code, out = invoke("eval", "--labels", str(labels), "--json", "--no-peers",
                       "--pattern", r"it=(?P<step>\d+) \| lm=(?P<loss>\S+)")
    incident = next(r for r in rows(out) if r["type"] == "incident")
    assert code == 0 and incident["error"] is None and incident["detected"], out
    code, out = invoke("eval", "--labels", str(labels), "--pattern", r"it=(\d+)")
    assert code == 1 and "no (?P<step>...) group" in out and out.strip().count("\n") == 0, out


def test_tune_reads_labelled_text_logs_with_pattern(tmp_path: Path) -> None:
    """tune takes --pattern as eval does: without it the unknown format leaves no run to tune on."""
    for name, jump in (("a.log", 300), ("b.log", 200)):
        lines = [f"it={i} | lm={2.0 + (30.0 if jump <= i < jump + 5 else 0.0):.4f}" for i in range(400)]
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    labels = tmp_path / "LABELS.csv"
    labels.write_text("file,step_start,step_end,kind,label_source,note\n"
                      "a.log,300,305,loss_spike,author,x\nb.log,200,205,loss_spike,author,x\n")
    space = tmp_path / "space.yaml"
    space.write_text("spike.z_threshold: [6.0, 8.0]\n")
    out_file = tmp_path / "tuned.yaml"
    base = ("tune", "--labels", str(labels), "--out", str(out_file), "--space", str(space), "--json")
    code, out = invoke(*base)
    assert code == 1 and "no labelled run could be imported" in out, out
    code, out = invoke(*base, "--pattern", r"it=(?P<step>\d+) \| lm=(?P<loss>\S+)")
    assert code == 0, out
    result = json.loads(out)
    assert result["metrics"]["recall"] == 1.0 and result["held_out"]["detected"] == 2, result
    code, out = invoke(*base, "--pattern", r"it=(\d+)")
    assert code == 1 and "no (?P<step>...) group" in out and out.strip().count("\n") == 0, out
