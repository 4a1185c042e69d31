"""``--engine``: eval and tune give the same tables on the local process pool and on Ray (one task per run); Ray is
an optional extra, and asking for it without it installed is one line."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_tune import write_series
from typer.testing import CliRunner

from stabmon.replay.engines import RAY_MISSING, LocalEngine, RayEngine, make_engine
from stabmon.replay.eval import evaluate
from stabmon.replay.tune import tune

HAVE_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed (pip install 'stabmon[ray]')")

# small real runs of every corpus format (a few seconds each): fairseq, llm.c, DeepSpeed, Megatron, W&B segments
REAL_RUNS_SUBSET = (
    "fairseq-fsdp-13b-readme/gpt3-13b_1xV100_cpu-offload.log",
    "fairseq-fsdp-13b-readme/gpt3-13b_8xV100_full-shard.log",
    "llmc-gpt2-124m-SiddanthEmani/main.log",
    "deepspeed-chat-opt/actor_opt-1.3b_critic_opt-350m_globalBatchSize64.log",
    "bigscience-chronicles/tr11-176B_spike-it31214-31251.log",
    "bigscience-chronicles/tr1-13B_gpu-crash-it43680.log",
    "polypythias-wandb-lm-loss/160m-seed4_s5lcpsmk.tsv",
)


def _square(x: int) -> int:
    return x * x


def test_local_engine_keeps_the_items_order_and_counts_progress() -> None:
    done: list[int] = []
    assert LocalEngine(jobs=2).map(_square, [3, 1, 2], progress=done.append) == [9, 1, 4]
    assert done == [1, 1, 1]
    with pytest.raises(ValueError, match="--jobs must be >= 1, got 0"):
        make_engine("local", jobs=0)


def test_ray_missing_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stabmon.cli import app

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: find_spec and import both fail
    with pytest.raises(ValueError, match=r"^--engine ray needs the ray extra: pip install 'stabmon\[ray\]'$"):
        make_engine("ray")
    labels = tmp_path / "L.csv"
    labels.write_text("file,step_start,step_end,kind\na.log,1,2,loss_spike\n")
    for cmd in (["eval", "--labels", str(labels)], ["tune", "--labels", str(labels), "--out", str(tmp_path / "o")]):
        res = CliRunner().invoke(app, [*cmd, "--engine", "ray"])
        assert res.exit_code == 1 and res.output.strip() == f"error: {RAY_MISSING}", res.output
        res = CliRunner().invoke(app, [*cmd, "--engine", "spark"])
        assert res.exit_code == 1 and res.output.strip() == "error: --engine must be one of local, ray, got 'spark'"
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[None]:
    """One local Ray instance (2 CPUs) for the module's tests; the engines use it and leave it running."""
    if not HAVE_RAY:
        pytest.skip("ray is not installed (pip install 'stabmon[ray]')")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@needs_ray
def test_ray_engine_maps_in_order(ray_instance: None) -> None:
    done: list[int] = []  # (a function Ray's workers can import: this test module is not on their path)
    assert RayEngine(workers=2).map(abs, [-3, 1, -2], progress=done.append) == [3, 1, 2]
    assert done == [1, 1, 1] and RayEngine().map(abs, []) == []


def _subset(src: Path, dst: Path, names: tuple[str, ...] | None) -> Path:
    """A LABELS.csv in ``dst`` with ``src``'s rows for ``names`` (all: None), reading ``src``'s files."""
    (dst / "real").symlink_to(src)
    with open(src / "LABELS.csv", newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        rows = [r for r in reader if names is None or r["file"] in names]
        fields = reader.fieldnames or []
    with open(dst / "LABELS.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows({**r, "file": f"real/{r['file']}"} for r in rows)
    return dst / "LABELS.csv"


@needs_ray
def test_eval_on_ray_equals_the_local_engine_on_real_runs(ray_instance: None, real_runs: Path, tmp_path: Path) -> None:
    labels = _subset(real_runs, tmp_path, REAL_RUNS_SUBSET)
    local = evaluate(labels, jobs=1, group_wandb=True)
    on_ray = evaluate(labels, engine="ray", jobs=2, group_wandb=True)
    assert len({r["file"] for r in local.files}) == len(REAL_RUNS_SUBSET)
    assert not [r for r in local.files if r["error"]]
    assert on_ray.rows() == local.rows() and on_ray.summary == local.summary


@needs_ray
def test_eval_on_ray_equals_the_local_engine_on_real_finetunes(
    ray_instance: None, real_finetunes: Path, tmp_path: Path
) -> None:
    with open(real_finetunes / "LABELS.csv", newline="", encoding="utf-8") as fh:
        names = tuple(r["file"] for r in list(csv.DictReader(fh))[:6])
    labels = _subset(real_finetunes, tmp_path, names)
    local = evaluate(labels, jobs=1)
    on_ray = evaluate(labels, engine=RayEngine(workers=2))
    assert not [r for r in local.files if r["error"]]
    assert on_ray.rows() == local.rows() and on_ray.summary == local.summary


@needs_ray
def test_tune_on_ray_equals_the_local_engine(ray_instance: None, tmp_path: Path) -> None:
    from stabmon.cli import app

    rows = ["file,step_start,step_end,kind,label_source,note"]
    for i, spike in enumerate([120, 150, 180]):
        write_series(tmp_path / f"r{i}.csv", 300, spike)
        rows.append(f"r{i}.csv,{spike},{spike + 2},loss_spike,author,synthetic")
    write_series(tmp_path / "unread.csv", 300, 100)
    (tmp_path / "unread.csv").write_bytes(b"\x00\x01 not a log")  # no importer reads it: left out by both engines
    rows.append("unread.csv,1,2,loss_spike,author,x")
    labels = tmp_path / "LABELS.csv"
    labels.write_text("\n".join(rows) + "\n")
    space = {"spike.z_threshold": [3.0, 1000.0], "robust_spike.z_threshold": [1000.0]}
    local = tune(labels, space=space, folds=2)
    on_ray = tune(labels, space=space, folds=2, engine="ray", jobs=2)
    assert (on_ray.best, on_ray.best_metrics, on_ray.candidates, on_ray.folds) == (
        local.best, local.best_metrics, local.candidates, local.folds)
    assert on_ray.overrides_yaml() == local.overrides_yaml() and len(local.candidates) == 2
    assert local.best_metrics["numeric_incidents"] == 3 and local.best_metrics["recall"] == 1.0
    outs = []
    for engine in ("local", "ray"):
        out = tmp_path / f"{engine}.yaml"
        res = CliRunner().invoke(app, ["tune", "--labels", str(labels), "--random", "1", "--engine", engine,
                                       "--out", str(out), "--json"])
        assert res.exit_code == 0, res.output
        outs.append((out.read_text(), json.loads(res.output)["best"]))
    assert outs[0] == outs[1]
