"""Tuning: search space validation, grid/random, cross-validated search, override file a runbook can
include."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from stabmon.replay.tune import grid, objective, random_candidates, tune, validate_space


def write_series(path: Path, n: int, spike_at: int) -> None:
    """A flat, slightly wiggling loss and grad norm with a 3-step spike of both at ``spike_at``."""
    rows = ["step,loss,grad_norm"]
    for s in range(n):
        loss, norm = 3.0 + 0.02 * math.sin(s), 0.5 + 0.02 * math.cos(s * 1.7)
        if spike_at <= s < spike_at + 3:
            loss, norm = loss + 4.0, norm * 30
        rows.append(f"{s},{loss},{norm}")
    path.write_text("\n".join(rows) + "\n")


SPACE = {"spike.z_threshold": [3.0, 1000.0], "robust_spike.z_threshold": [1000.0]}


@pytest.fixture
def labelled(tmp_path: Path) -> Path:
    d = tmp_path / "runs"
    d.mkdir()
    rows = ["file,step_start,step_end,kind,label_source,note"]
    for i, spike in enumerate([120, 150, 180, 210]):
        write_series(d / f"r{i}.csv", 300, spike)
        rows.append(f"runs/r{i}.csv,{spike},{spike + 2},loss_spike,author,synthetic")
    (tmp_path / "LABELS.csv").write_text("\n".join(rows) + "\n")
    return tmp_path / "LABELS.csv"


@pytest.mark.parametrize(
    ("space", "message"),
    [
        ({}, "tune.space must be a non-empty mapping"),
        ({"z_threshold": [1]}, "tune.space.z_threshold must name detector.param"),
        ({"spike.z_threshold": []}, "tune.space.spike.z_threshold must be a non-empty list of values"),
    ],
)
def test_validate_space_errors(space: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_space(space)


def test_grid_and_random_are_deterministic() -> None:
    space = {"a.x": [1, 2, 3], "b.y": [4, 5]}
    assert len(grid(space)) == 6
    assert random_candidates(space, 3, seed=1) == random_candidates(space, 3, seed=1)
    assert len({json.dumps(c, sort_keys=True) for c in random_candidates(space, 4, seed=2)}) == 4


def test_objective_penalises_false_alarms_and_rewards_lead() -> None:
    base = {"recall": 1.0, "mean_lead": 0.0, "false_alarms_per_10k": 0.0}
    assert objective({**base, "false_alarms_per_10k": 1.0}) < objective(base)
    assert objective({**base, "mean_lead": 5.0}) > objective(base)
    assert objective({**base, "mean_lead": 1e9}) == objective({**base, "mean_lead": 10.0})


def test_tune_picks_the_detecting_setting_and_cross_validates(labelled: Path) -> None:
    res = tune(labelled, space=SPACE, folds=2)
    assert res.best["spike.z_threshold"] == 3.0
    assert res.best_metrics["recall"] == 1.0
    assert len(res.candidates) == 2 and len(res.folds) == 2
    for f in res.folds:
        assert not set(f["train_runs"]) & set(f["test_runs"])
        assert f["test_metrics"]["recall"] == 1.0


def test_override_file_is_includable_by_a_runbook(labelled: Path, tmp_path: Path) -> None:
    from stabmon.resources import runbooks_dir
    from stabmon.runbook import load_runbook

    res = tune(labelled, space=SPACE, folds=1)
    out = tmp_path / "tuned.yaml"
    out.write_text(res.overrides_yaml())
    assert yaml.safe_load(out.read_text()) == {
        "detectors": {"spike": {"z_threshold": 3.0}, "robust_spike": {"z_threshold": 1000.0}}
    }
    rb = tmp_path / "mine.yaml"
    rb.write_text((runbooks_dir() / "default.yaml").read_text() + f"\ninclude: {out}\n")
    loaded = load_runbook(str(rb))
    assert loaded.detectors["spike"]["z_threshold"] == 3.0


@pytest.mark.slow
def test_tune_parallel_matches_serial(labelled: Path) -> None:
    serial = tune(labelled, space=SPACE, folds=2, jobs=1)
    parallel = tune(labelled, space=SPACE, folds=2, jobs=2)
    assert [c["objective"] for c in serial.candidates] == [c["objective"] for c in parallel.candidates]
    assert serial.best == parallel.best


def test_cli_tune(labelled: Path, tmp_path: Path) -> None:
    from stabmon.cli import app

    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    out = tmp_path / "o.yaml"
    runner = CliRunner()
    res = runner.invoke(
        app,
        [
            "tune",
            "--labels",
            str(labelled),
            "--space",
            str(space),
            "--random",
            "1",
            "--out",
            str(out),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert len(data["candidates"]) == 1 and out.is_file()
    res = runner.invoke(
        app, ["tune", "--labels", str(labelled), "--grid", "--random", "2", "--out", str(out)]
    )
    assert res.exit_code == 1 and "exclusive" in res.output


def test_replay_applies_the_included_tune_result(labelled: Path, tmp_path: Path) -> None:
    from stabmon.replay.replay import simulated_pipeline
    from stabmon.resources import runbooks_dir

    out = tmp_path / "tuned.yaml"
    out.write_text(tune(labelled, space={"spike.z_threshold": [3.5]}, folds=1).overrides_yaml())
    rb = tmp_path / "mine.yaml"
    rb.write_text((runbooks_dir() / "default.yaml").read_text() + f"\ninclude: {out}\n")
    pipeline, _ = simulated_pipeline(runbook=str(rb))
    assert pipeline.detectors.configs["spike"].z_threshold == 3.5
    pipeline, _ = simulated_pipeline(runbook=str(rb), overrides=["spike.z_threshold=7"])
    assert pipeline.detectors.configs["spike"].z_threshold == 7.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("spike.z_threshold: 6\n", "tune.space.spike.z_threshold must be a non-empty list of values, got 6"),
        ("- spike.z_threshold\n- 6\n", "tune.space must be a non-empty mapping"),
        ("", "tune.space must be a non-empty mapping"),
        ("spike.z_threshold: [4\n", "--space"),
    ],
)
def test_cli_tune_rejects_a_malformed_space_file(labelled: Path, tmp_path: Path, text: str, message: str) -> None:
    from stabmon.cli import app

    space = tmp_path / "space.yaml"
    space.write_text(text)
    out = tmp_path / "o.yaml"
    res = CliRunner().invoke(
        app, ["tune", "--labels", str(labelled), "--space", str(space), "--out", str(out)]
    )
    assert res.exit_code == 1, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.output
    assert str(space) in lines[0] and not out.exists()


def test_cli_tune_checks_options_and_out_before_searching(
    labelled: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stabmon.replay.tune as tune_module
    from stabmon.cli import app

    def no_search(*args: object, **kwargs: object) -> None:
        raise AssertionError("the search ran before the options were checked")

    monkeypatch.setattr(tune_module, "tune", no_search)
    base = ["tune", "--labels", str(labelled)]
    cases = [
        (["--out", str(tmp_path / "no" / "such" / "dir" / "x.yaml")], "directory"),
        (["--out", str(tmp_path)], "is a directory"),
        (["--out", str(tmp_path / "o.yaml"), "--random", "0"], "--random must be >= 1, got 0"),
        (["--out", str(tmp_path / "o.yaml"), "--random", "-3"], "--random must be >= 1, got -3"),
        (["--out", str(tmp_path / "o.yaml"), "--folds", "1"], "--folds must be >= 2"),
        (["--out", str(tmp_path / "o.yaml"), "--folds", "0"], "--folds must be >= 2"),
        (["--out", str(tmp_path / "o.yaml"), "--jobs", "0"], "--jobs must be >= 1"),
        (["--out", str(tmp_path / "o.yaml"), "--space", str(tmp_path / "nope.yaml")], "no such space file"),
    ]
    for extra, message in cases:
        res = CliRunner().invoke(app, base + extra)
        lines = res.output.strip().splitlines()
        assert res.exit_code == 1 and len(lines) == 1 and message in lines[0], (extra, res.output)
    assert "x.yaml" in CliRunner().invoke(app, base + cases[0][0]).output
    assert not (tmp_path / "o.yaml").exists()


def test_leave_one_out_holds_out_each_run_once_and_sums_the_held_out_folds(labelled: Path, tmp_path: Path) -> None:
    from stabmon.cli import app
    from stabmon.replay.tune import held_out

    res = tune(labelled, space=SPACE, leave_one_out=True)
    assert len(res.folds) == 4
    assert sorted(r for f in res.folds for r in f["test_runs"]) == [f"runs/r{i}.csv" for i in range(4)]
    assert all(len(f["test_runs"]) == 1 and len(f["train_runs"]) == 3 for f in res.folds)
    total = held_out(res.folds)
    assert (total["numeric_incidents"], total["detected"], total["recall"], total["steps"]) == (4, 4, 1.0, 1200)
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    out = CliRunner().invoke(app, ["tune", "--labels", str(labelled), "--space", str(space), "--leave-one-out",
                                   "--out", str(tmp_path / "o.yaml")])
    assert out.exit_code == 0, out.output
    assert (f"held out, all folds: 4/4 incidents detected (recall 1.0), {total['false_alarms']} false alarms in "
            "1200 steps") in out.output
    assert out.output.count("  fold ") == 4
