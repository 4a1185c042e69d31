"""Hugging Face ``trainer_state.json`` as a first-class format: sniffed by import / replay / eval, the file or a
``checkpoint-N`` folder, evaluation entries kept apart from the training loss, bad input a one-line error or a
counted skip; and ``stabmon eval`` on label files with only some kinds of rows."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stabmon.cli import app
from stabmon.events import Metric
from stabmon.replay.importers import hf_trainer
from stabmon.replay.importers.sniff import import_file, nothing_read, sniff_format

REAL = "Miguel-Alessio__qwen-chess-lora__qwen-7b-chess-lora.json"


def _state(path: Path, entries: list[object], **top: object) -> Path:
    path.write_text(json.dumps({"global_step": 0, **top, "log_history": entries}))
    return path


def test_a_real_trainer_state_is_sniffed_and_read_whole(real_finetunes: Path) -> None:
    path = real_finetunes / REAL
    raw = json.loads(path.read_text())["log_history"]
    train = [e for e in raw if "loss" in e]
    evals = [e for e in raw if "eval_loss" in e]
    assert sniff_format(path).FORMAT == "hf_trainer"
    result = import_file(path)
    assert result.malformed == 0 and len(result) == len({e["step"] for e in train + evals})
    by_step = {r.step: r for r in result.records}
    assert [by_step[e["step"]].get(Metric.LOSS) for e in train] == [e["loss"] for e in train]
    assert [by_step[e["step"]].get(Metric.GRAD_NORM) for e in train] == [e.get("grad_norm") for e in train]
    assert [by_step[e["step"]].get(Metric.VAL_LOSS) for e in evals] == [e["eval_loss"] for e in evals]


def test_a_checkpoint_folder_is_read_through_its_trainer_state(real_finetunes: Path, tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint-2750"
    folder.mkdir()
    shutil.copy(real_finetunes / REAL, folder / "trainer_state.json")
    (folder / "config.json").write_text("{}")
    assert sniff_format(folder).FORMAT == "hf_trainer"
    assert len(import_file(folder)) == len(import_file(real_finetunes / REAL))
    runner = CliRunner()
    db = f"sqlite:///{tmp_path / 's.db'}"
    res = runner.invoke(app, ["import", str(folder), "--run", "chess", "--db", db])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["replay", str(folder), "--runbook", "default", "--db", db])
    assert res.exit_code == 0, res.output


def test_values_written_as_strings_nan_and_infinity_are_numbers(tmp_path: Path) -> None:
    path = tmp_path / "trainer_state.json"
    path.write_text('{"log_history": [{"step": 1, "loss": NaN, "grad_norm": Infinity}, '
                    '{"step": 2, "loss": "2.5", "grad_norm": "inf", "learning_rate": "1e-4"}, '
                    '{"step": 3, "loss": 2.4, "grad_norm": NaN}]}')
    records = import_file(path).records
    assert math.isnan(records[0].get(Metric.LOSS)) and records[0].get(Metric.GRAD_NORM) == math.inf
    assert records[1].get(Metric.LOSS) == 2.5 and records[1].get(Metric.LR) == 1e-4
    assert records[2].get(Metric.LOSS) == 2.4


def test_the_trainers_nan_filter_is_read_as_a_nan_loss(tmp_path: Path) -> None:
    # logging_nan_inf_filter logs an interval whose every step was NaN as loss 0.0 beside a NaN grad norm
    path = _state(tmp_path / "s.json", [{"step": 10, "loss": 0.25, "grad_norm": 1.0},
                                        {"step": 20, "loss": 0.0, "grad_norm": math.nan},
                                        {"step": 30, "loss": 0.0, "grad_norm": 0.5}])
    result = import_file(path)
    assert [r.get(Metric.LOSS) for r in result.records][2] == 0.0  # a finite grad norm: a real 0.0
    assert math.isnan(result.records[1].get(Metric.LOSS)) and result.events_total == 1


def test_bad_entries_are_counted_skips_that_name_the_entry(tmp_path: Path) -> None:
    path = _state(tmp_path / "s.json", [
        {"epoch": 0.1, "loss": 2.0},              # no step
        {"step": 10, "loss": 1.9},
        {"step": 10, "loss": 1.8},                # the same step again
        {"step": 5, "loss": 1.7},                 # a step back
        {"step": 20, "loss": "oops"},             # not a number
        {"step": 30, "loss": 1.6, "grad_norm": [1]},
        "not an entry",
        {"step": 30, "eval_loss": 1.7, "eval_runtime": 2.0},
    ])
    result = import_file(path)
    assert [(r.step, dict(r.metrics)) for r in result.records] == [
        (10, {Metric.LOSS: 1.9}), (30, {Metric.LOSS: 1.6, Metric.VAL_LOSS: 1.7})]
    assert result.malformed == 6
    assert result.problems == [
        "s.json:entry 0: no usable step (None)",
        "s.json:entry 2: training step 10 repeats or precedes step 10; skipped",
        "s.json:entry 3: training step 5 repeats or precedes step 10; skipped",
        "s.json:entry 4: loss is not a number (or beyond float range): 'oops'",
        "s.json:entry 5: grad_norm is not a number (or beyond float range): '[1]'",
        "s.json:entry 6: not an object: 'not an entry'",
    ]


@pytest.mark.parametrize(
    ("entries", "reason"),
    [
        ([{"step": 10, "eval_loss": 2.0}, {"step": 20, "eval_loss": 1.9}],
         "no training entries (no 'loss') among 2 log_history entries (2 evaluation)"),
        ([], "no training entries (no 'loss') among 0 log_history entries (0 evaluation)"),
        ([{"step": 10, "train_loss": 2.0, "train_runtime": 5.0}],
         "no training entries (no 'loss') among 1 log_history entries (0 evaluation)"),
    ],
)
def test_a_file_without_training_entries_is_one_line_error(entries: list[object], reason: str,
                                                            tmp_path: Path) -> None:
    path = _state(tmp_path / "trainer_state.json", entries)
    result = import_file(path)
    message = nothing_read(result, [path])
    assert message is not None and reason in message
    res = CliRunner().invoke(app, ["import", str(path), "--run", "x", "--db", f"sqlite:///{tmp_path / 'a.db'}"])
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1 and reason in res.output


def test_broken_json_with_the_format_named_is_one_problem(tmp_path: Path) -> None:
    path = tmp_path / "trainer_state.json"
    path.write_text('{"log_history": [{"step": 1, "loss": 2.0},')  # cut short: what was read stays
    result = hf_trainer.read(path)
    assert len(result) == 1 and result.malformed == 1
    where = f"{tmp_path.name}/trainer_state.json"  # the checkpoint folder names a Trainer's state file
    assert result.problems[0].startswith(f"{where}: stops being a readable trainer_state.json after 1 entries (")
    path.write_text('{"log_history": [')
    result = hf_trainer.read(path)
    assert len(result) == 0 and result.problems[0].startswith(f"{where}: stops being a readable trainer_state.json")
    path.write_text('{"global_step": 3}')
    assert hf_trainer.read(path).problems == [
        f"{where}: no training entries (no 'loss') among 0 log_history entries (0 evaluation)"]


@pytest.mark.parametrize("kinds", [["loss_spike"], ["none_control"]])
def test_eval_never_ends_in_a_traceback_on_label_files_with_only_some_rows(kinds: list[str],
                                                                           real_finetunes: Path,
                                                                           tmp_path: Path) -> None:
    rows = [line for line in (real_finetunes / "LABELS.csv").read_text().splitlines()[1:]
            if line.split(",")[3] in kinds][:3]
    for line in rows:
        shutil.copy(real_finetunes / line.split(",")[0], tmp_path)
    (tmp_path / "LABELS.csv").write_text("file,step_start,step_end,kind,label_source,note\n" + "\n".join(rows))
    res = CliRunner().invoke(app, ["eval", "--labels", str(tmp_path / "LABELS.csv")], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "summary" in res.output and "Traceback" not in res.output
    if kinds == ["none_control"]:
        assert "on the 3 healthy run(s): training changed on 0" in res.output
