"""Importers (fairseq, W&B, generic tables, TensorBoard) and format detection, on real files read in place."""

from __future__ import annotations

import json
import math
from pathlib import Path

import polars as pl
import pytest

from stabmon.events import Metric
from stabmon.replay.importers import fairseq, generic, tensorboard, wandb
from stabmon.replay.importers.sniff import (
    UnknownFormatError,
    formats,
    import_file,
    import_files,
    sniff_format,
)
from stabmon.replay.stitch import group_segments, run_key, stitch

FAIRSEQ = "fairseq-fsdp-13b-readme/gpt3-13b_1xV100_cpu-offload.log"
PYTHIA = "polypythias-wandb-lm-loss"


# -- fairseq ---------------------------------------------------------------------------------------
def test_fairseq_real_log_values_overflow_and_scale(real_runs: Path) -> None:
    r = fairseq.read(real_runs / FAIRSEQ)
    assert r.format == "fairseq" and r.malformed == 0
    assert [x.step for x in r.records] == list(range(1, 11))
    third = r.records[2]
    assert third.get(Metric.LOSS) == pytest.approx(25.22)
    assert third.get(Metric.GRAD_NORM) == pytest.approx(131.281)
    assert third.get(Metric.LOSS_SCALE) == 1.0
    assert third.get(Metric.OVERFLOW) == 1.0  # two NOTE lines before update 3
    assert all(x.get(Metric.OVERFLOW) is None for x in r.records if x.step != 3)
    assert sum("overflow" in text for _, text in r.events) == 2
    assert r.records[0].get(Metric.LOSS_SCALE) == 4.0


def test_fairseq_full_shard_log(real_runs: Path) -> None:
    r = import_file(real_runs / "fairseq-fsdp-13b-readme/gpt3-13b_8xV100_full-shard.log")
    assert r.format == "fairseq"
    assert r.records[2].get(Metric.LOSS) == pytest.approx(23.68, abs=0.01)
    assert r.records[2].get(Metric.OVERFLOW) == 1.0


def test_fairseq_malformed_lines_counted(tmp_path: Path) -> None:
    p = tmp_path / "train.log"
    p.write_text(
        '| INFO | train_inner | {"loss": "2.5", "num_updates": "1"}\n'
        '| INFO | train_inner | {"loss": "2.5", "num_updates"\n'  # truncated JSON
        '| INFO | train_inner | {"loss": "abc", "num_updates": "2"}\n'
        '| INFO | train_inner | {"loss": "nan", "num_updates": "3"}\n'
    )
    r = fairseq.read(p)
    assert r.malformed == 2 and len(r.problems) == 2 and "train.log:2" in r.problems[0]
    assert [x.step for x in r.records] == [1, 3]
    assert math.isnan(r.records[1].get(Metric.LOSS))


def test_fairseq_restart_supersedes(tmp_path: Path) -> None:
    lines = [
        f'| train_inner | {{"loss": "{v}", "num_updates": "{s}"}}'
        for s, v in [(1, 3.0), (2, 2.9), (3, 2.8), (2, 5.0), (3, 4.0)]
    ]
    p = tmp_path / "t.log"
    p.write_text("\n".join(lines) + "\n")
    r = fairseq.read(p)
    assert r.restarts == [2]
    assert [(x.step, x.get("loss")) for x in r.records] == [(1, 3.0), (2, 5.0), (3, 4.0)]


# -- W&B and stitching -----------------------------------------------------------------------------
def test_wandb_single_segment(real_runs: Path) -> None:
    r = wandb.read(real_runs / PYTHIA / "410m-seed3_vjl8rypi.tsv")
    assert r.malformed == 0
    steps = [x.step for x in r.records]
    assert steps == sorted(steps) and steps[0] == 75001
    by_step = {x.step: x for x in r.records}
    assert by_step[75002].get(Metric.LOSS) == pytest.approx(11.08, abs=0.01)


def test_wandb_stitch_seed5_restarts(real_runs: Path) -> None:
    files = sorted((real_runs / PYTHIA).glob("410m-seed5_*.tsv"))
    r = import_files(files)
    assert r.restarts == [81001, 83001, 95001, 124001, 127001, 137001]
    steps = [x.step for x in r.records]
    assert steps == list(range(1, 143001))  # one value per step, later segments win


def test_wandb_stitch_later_segment_wins(real_runs: Path) -> None:
    seg_a = wandb.read(real_runs / PYTHIA / "410m-seed5_4cpv52gc.tsv")  # 1..81715
    seg_b = wandb.read(real_runs / PYTHIA / "410m-seed5_i8jjatq1.tsv")  # 81001..83463
    r = stitch([seg_a, seg_b])
    b_first = {x.step: x.get("loss") for x in seg_b.records}
    by_step = {x.step: x.get("loss") for x in r.records}
    assert by_step[81500] == b_first[81500]
    assert r.restarts == [81001]


def test_stitch_orders_aborted_attempt_first() -> None:
    from stabmon.events import StepRecord
    from stabmon.replay.importers.base import ImportResult

    long = ImportResult("wandb", [StepRecord(s, {"loss": 2.0}) for s in range(10, 20)])
    short = ImportResult("wandb", [StepRecord(s, {"loss": 9.0}) for s in range(10, 13)])
    head = ImportResult("wandb", [StepRecord(s, {"loss": 1.0}) for s in range(0, 15)])
    r = stitch([long, head, short])
    assert [x.get("loss") for x in r.records if x.step >= 10] == [2.0] * 10
    assert r.restarts == [10]


def test_clean_resumes_are_not_restarts(real_runs: Path) -> None:
    r = import_files(sorted((real_runs / PYTHIA).glob("410m-seed2_*.tsv")))
    assert r.restarts == []
    assert len(r.records) == 143000
    assert any("resumed at step 3001" in text for _, text in r.events)


def test_run_key_and_grouping(real_runs: Path) -> None:
    assert run_key("160m-seed4_bvgfairr.tsv") == "160m-seed4"
    assert run_key("tr8-104B_exp1_spike-it7000-7220.log") == "tr8-104B_exp1_spike-it7000-7220"
    groups = group_segments((real_runs / PYTHIA).glob("*seed*.tsv"))
    assert sorted(len(v) for v in groups.values()) == [3, 6, 8, 10]


# -- generic tables --------------------------------------------------------------------------------
def test_generic_csv_mapping_and_unmapped(tmp_path: Path) -> None:
    p = tmp_path / "m.csv"
    p.write_text("iteration,train/loss,my_norm,note\n1,2.5,0.5,ok\n2,2.4,0.6,fine\n")
    r = generic.read(p, mapping={"my_norm": "grad_norm"})
    assert [dict(x.metrics) for x in r.records] == [
        {"loss": 2.5, "grad_norm": 0.5},
        {"loss": 2.4, "grad_norm": 0.6},
    ]
    assert r.malformed == 0  # the text column is not a metric


def test_generic_jsonl_and_parquet(tmp_path: Path) -> None:
    j = tmp_path / "m.jsonl"
    j.write_text(
        json.dumps({"step": 1, "loss": 3.0}) + "\nnot json\n" + json.dumps({"step": 2, "loss": 2.0}) + "\n"
    )
    r = import_file(j)
    assert r.format == "generic" and [x.step for x in r.records] == [1, 2] and r.malformed == 1
    pq = tmp_path / "m.parquet"
    pl.DataFrame({"_step": [5, 6], "train/grad_norm": [1.0, float("nan")]}).write_parquet(pq)
    r = import_file(pq)
    assert [x.step for x in r.records] == [5, 6] and math.isnan(r.records[1].get("grad_norm"))


def test_generic_missing_step_column_reported(tmp_path: Path) -> None:
    p = tmp_path / "m.csv"
    p.write_text("a,loss\n1,2\n")
    r = generic.read(p, step_column="nope")
    assert r.records == [] and r.malformed == 1 and "step column 'nope' not found" in r.problems[0]


def test_parse_mapping_errors() -> None:
    assert generic.parse_mapping(["train/loss=loss", "a=b=grad_norm"]) == {
        "train/loss": "loss",
        "a=b": "grad_norm",
    }
    with pytest.raises(ValueError, match=r"^import.map: expected COLUMN=METRIC, got 'oops'$"):
        generic.parse_mapping(["oops"])


# -- TensorBoard -----------------------------------------------------------------------------------
def test_tensorboard_event_file(tmp_path: Path) -> None:
    tb = pytest.importorskip("tensorboard.summary.writer.event_file_writer")
    from tensorboard.compat.proto import event_pb2, summary_pb2

    writer = tb.EventFileWriter(str(tmp_path))
    for step, (loss, norm) in enumerate([(3.0, 1.0), (2.5, 0.9), (9.0, 50.0)]):
        for tag, value in (("lm-loss-training/lm loss", loss), ("grad-norm", norm)):
            summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])
            writer.add_event(event_pb2.Event(step=step, wall_time=1000.0 + step, summary=summary))
    writer.close()
    files = list(tmp_path.glob("events.out.tfevents.*"))
    assert sniff_format(files[0]).FORMAT == "tensorboard"
    r = import_file(files[0])
    assert [(x.step, x.get("loss"), x.get("grad_norm")) for x in r.records] == [
        (0, 3.0, 1.0),
        (1, 2.5, pytest.approx(0.9)),
        (2, 9.0, 50.0),
    ]


def test_tensorboard_missing_package_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_tb(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("tensorboard"):
            raise ImportError("no tensorboard")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tb)
    r = tensorboard.read(tmp_path / "events.out.tfevents.x")
    assert r.malformed == 1 and "pip install 'stabmon[tensorboard]'" in r.problems[0]


# -- detection -------------------------------------------------------------------------------------
def test_detection_on_real_files(real_runs: Path) -> None:
    assert sniff_format(real_runs / FAIRSEQ).FORMAT == "fairseq"
    assert sniff_format(real_runs / PYTHIA / "160m-seed4_pxnucujw.tsv").FORMAT == "wandb"
    assert {"fairseq", "wandb", "tensorboard", "generic"} <= set(formats())
    assert formats()[-1] == "generic"  # the catch-all is tried last


def test_unknown_format(tmp_path: Path) -> None:
    p = tmp_path / "x.txt"
    p.write_text("hello there\nnothing to see\n")
    with pytest.raises(UnknownFormatError, match="format not recognised"):
        sniff_format(p)
    with pytest.raises(UnknownFormatError, match="unknown format 'nope'"):
        import_file(p, format="nope")
