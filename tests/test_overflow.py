"""fp16 overflow steps are routine: a grad norm logged as inf/nan on a step the loss scaler skipped raises
nothing that is sent (warning or above), in imported logs (CSV / W&B / TensorBoard, where the step is found by
its overflow column or by the loss-scale backoff) and live (a real GradScaler, accelerate's optimizer wrapper
under the HF callback, a framework reporting the skip). A non-finite loss, a non-finite grad norm no backoff
explains, and a scale collapsing to its floor still fire."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from stabmon.events import Anomaly, Metric, Severity
from stabmon.monitor import Monitor, MonitorConfig
from stabmon.replay.eval import STABMON, evaluate
from stabmon.replay.importers.sniff import import_file
from stabmon.replay.replay import replay

STEPS, EVERY = 3000, 400  # a scale that halves every 400 steps: 7 routine overflows in 3000 steps
HEADER = "_step,train/loss,train/grad_norm,train/loss_scale"


def fp16_log(path: Path, *, seed: int = 0, in_force: bool = False, nan_loss_at: int | None = None,
             collapse_from: int | None = None, stray_inf_at: int | None = None, flag: bool = False) -> Path:
    """A W&B-style export of a healthy fp16 run: a falling loss, a log-normal grad norm, ``inf`` grad norm on
    each overflow step, and the loss scale halving there. ``in_force``: the scale logged is the one in force
    for the step (it drops at the next record), else the one after ``scaler.update()``. ``collapse_from``:
    from that step every step overflows until the scale is at 1. ``flag``: an ``overflow`` column too."""
    rng = random.Random(seed)
    scale, rows = 65536.0, [HEADER + (",overflow" if flag else "")]
    for s in range(STEPS):
        overflow = (s > 0 and s % EVERY == 0) or (collapse_from is not None and s >= collapse_from and scale > 1)
        if overflow and not in_force:
            scale /= 2
        loss = math.nan if s == nan_loss_at else 2.0 + 3.0 * math.exp(-s / 150) + rng.gauss(0, 0.02)
        norm = math.inf if overflow or s == stray_inf_at else math.exp(rng.gauss(math.log(0.5), 0.1))
        rows.append(f"{s},{loss},{norm},{scale}" + (f",{'true' if overflow else 'false'}" if flag else ""))
        if overflow and in_force:
            scale /= 2
    path.write_text("\n".join(rows) + "\n")
    return path


def anomalies(path: Path) -> list[Anomaly]:
    return replay(import_file(path).records).anomalies


def sent(found: list[Anomaly]) -> list[tuple[str, str, int, str]]:
    """What the default routing sends (Slack: warning and above; PagerDuty: error and above)."""
    return [(a.kind, a.metric, a.step, a.severity.value) for a in found if a.severity >= Severity.WARNING]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("in_force", [False, True], ids=["scale-after-update", "scale-in-force"])
def test_routine_overflows_in_a_wandb_export_send_nothing(tmp_path: Path, seed: int, in_force: bool) -> None:
    path = fp16_log(tmp_path / "fp16_abcd1234.csv", seed=seed, in_force=in_force)
    records = import_file(path).records
    overflowed = [r.step for r in records if r.get(Metric.OVERFLOW) == 1.0]
    assert len(overflowed) == 7
    assert all(not math.isfinite(records[s].metrics[Metric.GRAD_NORM]) for s in overflowed)
    assert sent(anomalies(path)) == []


def test_routine_overflows_send_nothing_through_replay_and_eval(tmp_path: Path) -> None:
    from stabmon.cli import app

    fp16_log(tmp_path / "fp16.csv")
    res = CliRunner().invoke(app, ["replay", str(tmp_path / "fp16.csv"), "--no-store", "--json"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.output.splitlines() if line.startswith("{")]
    summary = next(r for r in rows if r["type"] == "summary")
    assert summary["steps"] == STEPS and summary["decisions"] == 0
    assert [r for r in rows if r.get("severity") not in (None, "info")] == []
    (tmp_path / "LABELS.csv").write_text("file,step_start,step_end,kind,label_source,note\n"
                                         "fp16.csv,0,2999,benign_overflow,observed_by_us,routine backoffs\n")
    report = evaluate(tmp_path / "LABELS.csv", peers=False)
    row = next(r for r in report.files if r["method"] == STABMON)
    assert row["error"] is None and row["false_alarms"] == 0


def test_an_overflow_column_is_read_as_the_overflow_flag(tmp_path: Path) -> None:
    path = fp16_log(tmp_path / "flagged.csv", flag=True)
    records = import_file(path).records
    assert [r.step for r in records if r.get(Metric.OVERFLOW) == 1.0] == list(range(EVERY, STEPS, EVERY))
    assert sum(r.get(Metric.OVERFLOW) == 0.0 for r in records) == STEPS - 7
    assert sent(anomalies(path)) == []


def test_a_nan_loss_on_the_same_run_is_critical(tmp_path: Path) -> None:
    found = sent(anomalies(fp16_log(tmp_path / "nan.csv", nan_loss_at=1500)))
    assert ("nonfinite", "loss", 1500, "warning") in found  # one NaN loss: sent; critical once it persists


def test_an_inf_grad_norm_no_backoff_explains_is_critical(tmp_path: Path) -> None:
    found = sent(anomalies(fp16_log(tmp_path / "stray.csv", stray_inf_at=1234)))
    assert found == [("nonfinite", "grad_norm", 1234, "warning")]  # no backoff explains it: sent


def test_a_scale_collapsing_to_its_floor_fires_the_collapse_detector(tmp_path: Path) -> None:
    found = sent(anomalies(fp16_log(tmp_path / "collapse.csv", collapse_from=2000)))
    kinds = {(kind, severity) for kind, _, _, severity in found}
    assert ("loss_scale_collapse", "critical") in kinds and ("loss_scale_collapse", "error") in kinds
    assert all(kind == "loss_scale_collapse" for kind, *_ in found)  # the overflows themselves stay benign


def test_tensorboard_scalars_get_their_overflow_steps(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    rows = [line.split(",") for line in fp16_log(tmp_path / "x.csv").read_text().splitlines()[1:]]
    with SummaryWriter(str(tmp_path / "tb")) as writer:
        for step, loss, norm, scale in rows:
            for tag, value in (("train/loss", loss), ("train/grad_norm", norm), ("train/loss_scale", scale)):
                writer.add_scalar(tag, float(value), int(step))
    records = import_file(tmp_path / "tb").records
    assert [r.step for r in records if r.get(Metric.OVERFLOW) == 1.0] == list(range(EVERY, STEPS, EVERY))
    assert sent(replay(records).anomalies) == []


# -- live ---------------------------------------------------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        out = self.body(x)
        return {"loss": torch.nn.functional.mse_loss(out, y)} if y is not None else out


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed batch (full-batch training falls smoothly to its noise floor: a healthy run by construction)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.5 + 0.1 * torch.randn(64, 1, generator=g)


def poison(model: torch.nn.Module) -> None:
    """An overflow by construction: one gradient entry is inf, as an fp16 backward that overflowed leaves it."""
    next(model.parameters()).grad.view(-1)[0] = math.inf


OVERFLOW_AT = (60, 120, 180, 240)
QUIET_CLOCK = {"step_time": {"enabled": False}}  # step times of a sub-millisecond loop follow the machine's load


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adamw"])
@pytest.mark.parametrize("threads", [1, 2])
def test_live_grad_scaler_overflows_send_nothing(fused: bool, threads: int) -> None:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(threads)
        model = Net()
        opt = (torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True) if fused
               else torch.optim.SGD(model.parameters(), lr=0.05))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=10_000)
        mon = Monitor(model, opt, scaler=scaler, store=None, detectors=QUIET_CLOCK,
                      config=MonitorConfig(clip=1.0, history=400))
        for step, _ in mon.steps(range(300)):
            x, y = data(step)
            loss = model(x, y)["loss"]
            scaler.scale(loss).backward()
            if step in OVERFLOW_AT:
                poison(model)
            mon.observe(loss=loss)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        mon.close()
    finally:
        torch.set_num_threads(old)
    records = list(mon.records)
    assert [r.step for r in records if r.get(Metric.OVERFLOW) == 1.0] == list(OVERFLOW_AT)
    assert scaler.get_scale() == 2.0**16 / 2 ** len(OVERFLOW_AT)
    if fused:  # the fused kernel is reached on the overflow step: the monitor measured its inf grad norm
        assert all(not math.isfinite(records[s].metrics[Metric.GRAD_NORM]) for s in OVERFLOW_AT)
    assert sent(mon.anomalies) == []


def test_live_nan_loss_under_a_grad_scaler_is_critical() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    mon = Monitor(model, opt, scaler=scaler, store=None, detectors=QUIET_CLOCK)
    for step, _ in mon.steps(range(40)):
        x, y = data(step)
        loss = model(x, y)["loss"] * (math.nan if step == 30 else 1.0)
        scaler.scale(loss).backward()
        mon.observe(loss=loss)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    mon.close()
    assert ("nonfinite", "loss", 30, "warning") in sent(mon.anomalies)  # one step: sent, not yet critical


def test_a_skip_reported_by_the_framework_is_an_overflow_without_a_grad_scaler() -> None:
    """A framework whose engine does its own loss scaling measures the grad norm (inf), then reports the skip:
    the monitor holds no GradScaler, yet records the overflow, and the inf grad norm is not sent."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = Monitor(model, opt, store=None, detectors=QUIET_CLOCK)
    mon.remove_optimizer_hooks()
    for step, _ in mon.steps(range(100)):
        x, y = data(step)
        model(x, y)["loss"].backward()
        overflow = step in (50, 80)
        if overflow:
            poison(model)
        mon.before_optimizer_step()
        if not overflow:
            opt.step()
        mon.after_optimizer_step(skipped=overflow)
        opt.zero_grad()
    mon.close()
    records = list(mon.records)
    assert [r.step for r in records if r.get(Metric.OVERFLOW) == 1.0] == [50, 80]
    assert not math.isfinite(records[50].metrics[Metric.GRAD_NORM])
    assert sent(mon.anomalies) == []


class _EngineWrapped:
    """An optimizer wrapper whose engine does its own loss scaling (as accelerate's DeepSpeed wrapper): no
    GradScaler to see, only ``step_was_skipped``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer, self.scaler, self.step_was_skipped = optimizer, None, False

    def step(self, grads_finite: bool) -> None:
        self.step_was_skipped = not grads_finite
        if grads_finite:
            self.optimizer.step()


@pytest.mark.parametrize("wrapper", ["accelerate-gradscaler", "engine-scaling"])
def test_hf_callback_records_skipped_steps_as_overflows(tmp_path: Path, wrapper: str) -> None:
    """The callback's events in the order ``Trainer`` calls them (fp16 Trainer runs need a GPU), around a real
    accelerate optimizer wrapper with a CPU GradScaler, or a wrapper whose engine scales the loss itself."""
    transformers = pytest.importorskip("transformers")
    accelerate = pytest.importorskip("accelerate")
    from accelerate.optimizer import AcceleratedOptimizer

    from stabmon.integrations.hf import StabmonCallback

    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_grad_norm=1.0, report_to=[],
                                          use_cpu=True, save_strategy="no")
    accelerate.Accelerator(cpu=True)  # after TrainingArguments, which resets accelerate's state
    torch.manual_seed(0)
    model = Net()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16) if wrapper == "accelerate-gradscaler" else None
    optimizer: Any = (AcceleratedOptimizer(inner, device_placement=False, scaler=scaler) if scaler is not None
                      else _EngineWrapped(inner))
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    cb = StabmonCallback(store=None, detectors=QUIET_CLOCK, config=MonitorConfig(history=200))
    cb.on_train_begin(args, state, control, model=model, optimizer=optimizer)
    for step in range(120):
        cb.on_step_begin(args, state, control, model=model, optimizer=optimizer)
        x, y = data(step)
        loss = model(x, y)["loss"]
        (scaler.scale(loss) if scaler is not None else loss).backward()
        overflow = step in (40, 90)
        if overflow:
            poison(model)
        cb.on_pre_optimizer_step(args, state, control, model=model, optimizer=optimizer)
        optimizer.step() if scaler is not None else optimizer.step(grads_finite=not overflow)
        optimizer.optimizer.zero_grad()
        state.global_step += 1
        cb.on_step_end(args, state, control, model=model, optimizer=optimizer)
    monitor = cb.monitor
    cb.on_train_end(args, state, control, model=model, optimizer=optimizer)
    records = list(monitor.records)
    # stored under the Trainer's own step number: global_step after the step (loop step 40 is Trainer step 41)
    assert [r.step for r in records if r.get(Metric.OVERFLOW) == 1.0] == [41, 91]
    assert all(math.isfinite(r.metrics[Metric.LOSS]) for r in records)
    assert sent(monitor.anomalies) == []
