"""``stabmon diff``: two tiny-GPT runs that differ only in one numerics setting (bfloat16 autocast switched on at
a known step) are told apart at that step; two identical seeded runs are not."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from stabmon.cli import app
from stabmon.cli.demo import load_example
from stabmon.monitor import Monitor, MonitorConfig

runner = CliRunner()
SWITCH = 12  # the step from which run B computes its forward pass in bfloat16
STEPS = 24
SEED = int(os.environ.get("STABMON_TEST_SEED", "1337"))
THREADS = int(os.environ.get("STABMON_TEST_THREADS", "1"))


def _train(url: str, name: str, bf16_from: int | None) -> None:
    tg = load_example()
    config = tg.TrainConfig(steps=STEPS, seed=SEED, n_layer=1, n_embd=32, block_size=32, batch_size=8,
                            threads=THREADS)
    model, opt, sched, batches = tg.build(config)
    with Monitor(model, opt, scheduler=sched, store=url, run_name=name, mode=None,
                 config=MonitorConfig(clip=1.0, flush_every=4)) as mon:
        for step, (x, y) in mon.steps(batches, max_steps=STEPS):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_from is not None and step >= bf16_from):
                loss = model(x, y)
            loss.backward()
            mon.observe(loss=loss, tokens=x.numel())
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('diff') / 'runs.db'}"
    _train(url, "fp32-a", None)
    _train(url, "fp32-b", None)
    _train(url, "bf16-from-12", SWITCH)
    return url


def _diff(url: str, *args: str, exit_code: int = 0) -> dict:
    res = runner.invoke(app, ["diff", *args, "--json", "--db", url])
    assert res.exit_code == exit_code, res.output
    return json.loads(res.output)


def test_identical_seeded_runs_agree_bit_for_bit(runs: str) -> None:
    out = _diff(runs, "fp32-a", "fp32-b")
    assert out["first_divergence"] is None
    assert out["tolerance"]["name"] == "tight"
    assert out["metrics"]["loss"]["compared"] == STEPS and out["metrics"]["grad_norm"]["first_divergence"] is None
    assert "step_time" not in out["metrics"]  # timing differs between any two runs


def test_one_numerics_setting_is_found_at_the_step_it_took_effect(runs: str) -> None:
    out = _diff(runs, "fp32-a", "bf16-from-12")
    assert out["first_divergence"] == SWITCH
    loss = out["metrics"]["loss"]
    assert loss["first_divergence"] == SWITCH and loss["a"] != loss["b"] and loss["rel_diff"] > 0
    # the loose preset forgives rounding, so it can only report the same step or a later one (or none)
    loose = _diff(runs, "fp32-a", "bf16-from-12", "--preset", "loose")["first_divergence"]
    assert loose is None or loose >= SWITCH


def test_text_output_names_the_step_and_the_environment(runs: str) -> None:
    res = runner.invoke(app, ["diff", "fp32-a", "bf16-from-12", "--db", runs])
    assert res.exit_code == 0, res.output
    assert f"first divergence: step {SWITCH}" in res.output
    assert "environment:" in res.output
    same = runner.invoke(app, ["diff", "fp32-a", "fp32-b", "--db", runs])
    assert "first divergence: none (the trajectories agree)" in same.output


def test_environment_differences_are_listed(sqlite_url: str) -> None:
    from stabmon.events import StepRecord
    from stabmon.store import open_store

    with open_store(sqlite_url) as store:
        for name, version, tf32 in (("old", "2.3.0", False), ("new", "2.4.0", True)):
            env = {"packages": {"torch": version}, "torch": {"matmul_allow_tf32": tf32}, "env": {"NCCL_ALGO": "x"}}
            run = store.start_run(name=name, environment=env)
            store.write_steps(run_id=run, records=[StepRecord(step=0, metrics={"loss": 1.0})])
        assert store.flush(20)
    out = _diff(sqlite_url, "old", "new")
    assert {d["path"]: (d["a"], d["b"]) for d in out["environment"]} == {
        "packages.torch": ("2.3.0", "2.4.0"),
        "torch.matmul_allow_tf32": (False, True),
    }


def test_bad_options_are_one_line(sqlite_url: str, tmp_path: Path) -> None:
    from stabmon.store import open_store

    with open_store(sqlite_url) as store:
        store.start_run(name="x", environment={})
        assert store.flush(20)
    for args, msg in ((["--preset", "medium"], "--preset must be one of tight, loose"),
                      (["--rtol", "-1"], "--rtol must be a finite number >= 0"),
                      (["--metric", "nope"], "neither run recorded nope")):
        res = runner.invoke(app, ["diff", "x", "x", *args, "--db", sqlite_url])
        assert res.exit_code == 1 and msg in res.output, res.output
    res = runner.invoke(app, ["diff", "x", "missing", "--db", sqlite_url])
    assert res.exit_code == 1 and "no run matches" in res.output


def test_the_recipe_is_stored_and_diffed(sqlite_url: str) -> None:
    """Two runs with another LR, runbook and scenario: `environment: 0 difference(s)` hid it; the recipe shows it."""

    def run(name: str, lr: float, runbook: str, scenario: str) -> None:
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        Monitor(model, opt, store=sqlite_url, run_name=name, runbook=runbook, mode="apply",
                recipe={"scenario": scenario, "batch_size": 8}).close()

    run("a", 3e-4, "default", "healthy")
    run("a2", 3e-4, "default", "healthy")
    run("b", 3e-2, "opt175b", "lr-too-high")
    # runs without steps: no trajectory to compare (exit 3, no-overlap), the recipes still differ
    paths = {d["path"]: (d["a"], d["b"]) for d in _diff(sqlite_url, "a", "b", exit_code=3)["recipe"]}
    assert paths["recipe.optimizer.lr"] == (3e-4, 3e-2)
    assert paths["recipe.runbook.name"] == ("default", "opt175b") and "recipe.runbook.digest" in paths
    assert paths["recipe.user.scenario"] == ("healthy", "lr-too-high")
    assert "recipe.user.batch_size" not in paths
    assert _diff(sqlite_url, "a", "a2", exit_code=3)["recipe"] == []
    text = runner.invoke(app, ["diff", "a", "b", "--db", sqlite_url]).output
    assert "recipe: 4 difference(s):" in text and "recipe.user.scenario" in text, text


def test_a_recipe_that_is_not_a_mapping_is_one_line() -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=r"^recipe: expected a mapping .* got list$"):
        Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=None, recipe=["lr"])
