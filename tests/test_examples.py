"""Every example runs, and the tiny GPT's documented settings behave as documented."""

from __future__ import annotations

import importlib.util
import statistics
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


@pytest.mark.slow
def test_unstable_setting_spikes_in_grad_norm_before_the_loss_blows_up(tg: ModuleType) -> None:
    from stabmon.monitor import Monitor, MonitorConfig

    config = tg.unstable(tg.TrainConfig())

    def factory(model, opt, sched):  # noqa: ANN001, ANN202
        return Monitor(model, opt, scheduler=sched, store=None, config=MonitorConfig(clip=config.clip))

    result = tg.train(config, monitor=factory)  # observe only: the default detectors, no runbook
    assert result.diverged
    recs = list(result.monitor.records)
    grad = [r.metrics["grad_norm"] for r in recs]
    loss = [r.metrics["loss"] for r in recs]
    smooth = [statistics.fmean(loss[i - 9 : i + 1]) for i in range(9, len(loss))]
    best = smooth.index(min(smooth)) + 9
    blowup = next(i + 9 for i, v in enumerate(smooth) if i + 9 > best and v > min(smooth) + 0.3)
    baseline = statistics.median(grad[max(0, best - 50) : best])
    first_spike = next(i for i in range(best, len(grad)) if grad[i] > 2.5 * baseline)
    assert first_spike < blowup
    # the default detectors flag the gradient norm first, before the loss blows up
    flagged = {m: min((a.step for a in result.monitor.anomalies if a.kind == "spike" and a.metric == m),
                      default=None) for m in ("grad_norm", "loss")}
    assert flagged["grad_norm"] is not None and flagged["grad_norm"] < blowup, (flagged, blowup)
    assert flagged["loss"] is None or flagged["grad_norm"] <= flagged["loss"], flagged
    # reproducible with the seed
    again = tg.train(config)
    assert again.losses[:blowup] == result.losses[:blowup]


@pytest.mark.slow
def test_bad_data_setting_is_rolled_back_past_the_corrupted_batches(tg: ModuleType, tmp_path: Path) -> None:
    import dataclasses

    from stabmon.events import InterventionRecord
    from stabmon.monitor import Monitor, MonitorConfig

    config = dataclasses.replace(tg.TrainConfig(steps=450), **tg.BAD_DATA)

    cfg = MonitorConfig(clip=config.clip, checkpoint_every=50, checkpoint_keep=6, hang_timeout=None)

    def factory(model, opt, sched):  # noqa: ANN001, ANN202
        return Monitor(model, opt, scheduler=sched, store=None, runbook="palm-rollback", mode="apply", config=cfg,
                       checkpoint_dir=str(tmp_path))

    result = tg.train(config, monitor=factory)
    mon = result.monitor
    start, stop = config.bad_batches
    spikes = [a.step for a in mon.anomalies if a.kind == "spike" and a.metric == "loss"]
    assert spikes and start <= min(spikes) < stop  # the corrupted batches are seen as loss spikes
    rollbacks = [e for e in mon.events if isinstance(e, InterventionRecord) and e.action == "rollback"]
    assert rollbacks and "error" not in rollbacks[0].after
    skipped = range(*rollbacks[0].after["skipped"])
    assert start in skipped and stop - 1 in skipped
    assert mon.step == 450 and not result.diverged


def test_config_errors_name_the_field(tg: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"^config\.n_embd must be divisible by config\.n_head"):
        tg.train(tg.TrainConfig(n_embd=30, n_head=4, steps=1))
    with pytest.raises(ValueError, match=r"^config\.norm must be 'pre' or 'post'"):
        tg.build(tg.TrainConfig(norm="mid"))


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
    result = CliRunner().invoke(app, ["demo", "--db", f"sqlite:///{db}", "--steps", "25"])
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
def test_stabmon_demo_unstable_scenario_prints_the_grad_norm_spike_and_the_recovery(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from stabmon.cli import app

    result = CliRunner().invoke(app, ["demo", "--db", f"sqlite:///{tmp_path / 'demo.db'}", "--scenario", "unstable"])
    assert result.exit_code == 0, result.output
    assert "runbook opt175b" in result.output
    anomalies = [line.split() for line in result.output.splitlines() if line.strip().startswith("anomaly spike")]
    first = {words[2]: int(words[-1]) for words in anomalies}
    assert "grad_norm" in first and first["grad_norm"] <= first.get("loss", first["grad_norm"]), result.output
    assert "rollback" in result.output and "resolved" in result.output

