"""Every example runs, and the tiny GPT's documented settings behave as documented."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tg() -> ModuleType:
    return load("tiny_gpt")


@pytest.mark.slow
def test_stable_setting_trains(tg: ModuleType) -> None:
    result = tg.train(tg.TrainConfig(steps=150))
    assert result.steps == 150
    assert result.final_loss < result.losses[0] - 0.6
    assert not result.diverged


def test_config_errors_name_the_field(tg: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"^config\.n_embd must be divisible by config\.n_head"):
        tg.train(tg.TrainConfig(n_embd=30, n_head=4, steps=1))
    with pytest.raises(ValueError, match=r"^config\.norm must be 'pre' or 'post'"):
        tg.build(tg.TrainConfig(norm="mid"))
    with pytest.raises(ValueError, match=r"^config\.head_lr must be > 0, got 0.0$"):
        tg.build(tg.TrainConfig(head_lr=0.0))


def test_head_lr_puts_the_output_layer_in_a_group_of_its_own(tg: ModuleType) -> None:
    model, opt, _, _ = tg.build(tg.TrainConfig(lr=1e-3, head_lr=30.0, steps=1))
    assert [len(g["params"]) for g in opt.param_groups] == [len(list(model.parameters())) - 1, 1]
    assert opt.param_groups[1]["params"][0] is model.lm_head.weight
    assert opt.param_groups[1]["initial_lr"] == pytest.approx(0.03)
    _, plain, _, _ = tg.build(tg.TrainConfig(steps=1))
    assert len(plain.param_groups) == 1


def test_cli_runs_monitored_into_sqlite(
    tg: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "tiny.db"
    code = tg.main(["--steps", "12", "--db", f"sqlite:///{db}", "--runbook", "default", "--mode", "apply"])
    out = capsys.readouterr().out
    assert code == 0 and db.is_file() and "12 steps" in out


def test_stabmon_demo_command(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from stabmon.cli import app

    db = tmp_path / "demo.db"
    result = CliRunner().invoke(app, ["demo", "--db", f"sqlite:///{db}", "--steps", "25", "--scenario", "healthy"])
    assert result.exit_code == 0, result.output
    assert f"database: {db.resolve()}" in result.output
    for needle in ("grad_norm", "act_rms/h.0", "emb_drift/wte", "events:"):
        assert needle in result.output
    assert db.is_file() and (tmp_path / "stabmon-demo-checkpoints").is_dir()
    bad = CliRunner().invoke(app, ["demo", "--db", f"sqlite:///{db}", "--scenario", "nope"])
    assert bad.exit_code == 1 and "--scenario must be one of" in bad.output
    bad = CliRunner().invoke(app, ["demo", "--db", f"sqlite:///{db}", "--steps", "0"])
    assert bad.exit_code == 1 and "--steps must be >= 1" in bad.output


def test_stabmon_demo_rejects_a_bad_runbook_before_creating_anything(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from stabmon.cli import app

    db = tmp_path / "demo.db"
    bad = CliRunner().invoke(app, ["demo", "--db", f"sqlite:///{db}", "--runbook", "nosuch", "--steps", "5"])
    assert bad.exit_code == 1, bad.output
    lines = bad.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --runbook 'nosuch': ") and "no bundled runbook" in lines[0]
    assert list(tmp_path.iterdir()) == []  # no database, no checkpoint folder


@pytest.mark.parametrize("db", ["notaurl", "xyz://foo", "postgresql+psycopg://nobody@127.0.0.1:1/none"])
def test_stabmon_demo_rejects_a_bad_store_url_in_one_line(db: str) -> None:
    from typer.testing import CliRunner

    from stabmon.cli import app

    bad = CliRunner().invoke(app, ["demo", "--db", db, "--steps", "5"])
    assert bad.exit_code == 1, bad.output
    lines = bad.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: store: cannot open "), lines


@pytest.mark.slow
def test_stabmon_demo_fp16_scenario_is_rolled_back_before_the_loss_scale_collapses(tmp_path: Path) -> None:
    """The loss turns NaN at step 100 and every later step overflows, halving the scale: the nonfinite alarm
    flushes each NaN step, so the rollback comes within steps, while the scale is still 2^16 / 2^4 or more (it
    used to come at the next flush, at step 120, once the scale had fallen to its floor)."""
    from typer.testing import CliRunner

    from stabmon.cli import app

    db = f"sqlite:///{tmp_path / 'demo.db'}"
    result = CliRunner().invoke(app, ["demo", "--db", db, "--scenario", "fp16-overflow", "--seed", "41"])
    assert result.exit_code == 0, result.output
    assert "runbook default" in result.output
    lines = result.output.splitlines()
    scale = next(line for line in lines if line.strip().startswith("loss_scale"))
    assert float(scale.split(" min ")[1].split()[0]) >= 2.0**16 / 2**4, scale
    assert any(line.strip().startswith("anomaly nonfinite") for line in lines), result.output
    assert not any(line.strip().startswith("anomaly loss_scale_collapse") for line in lines), result.output
    decisions = [line for line in lines if line.strip().startswith("decision") and "rollback" in line]
    assert decisions and any(line.strip().startswith("outcome") and "resolved" in line for line in lines)
    for signal in ("grad_norm", "act_rms/h.0", "emb_drift/wte"):  # the four signals the project is named for
        assert any(line.strip().startswith(signal) for line in lines), signal


def test_the_demo_says_a_rung_that_was_not_applicable_was_skipped_not_applied() -> None:
    from stabmon.cli.demo import _describe
    from stabmon.events import InterventionRecord

    skipped = InterventionRecord("d", 160, "scale_layer_lr", {}, {}, not_applied="not applicable: no layer is flagged")
    done = InterventionRecord("d", 160, "set_clip", {"clip": 1.0}, {"clip": 0.5})
    assert _describe(skipped) == "skipped    step 160   scale_layer_lr: not applicable: no layer is flagged"
    assert _describe(done) == "applied    step 160   set_clip {'clip': 1.0} -> {'clip': 0.5}"
