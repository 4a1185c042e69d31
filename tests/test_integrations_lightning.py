"""StabmonCallback in a real Lightning ``Trainer.fit()`` on a tiny model (CPU)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

L = pytest.importorskip("lightning.pytorch")

import torch  # noqa: E402
from store_support import metrics_by_step  # noqa: E402
from sync_support import SyncCounter, count_alarm_reads, without_landed  # noqa: E402

from stabmon.checkpoints import STOP_EXIT_CODE  # noqa: E402
from stabmon.integrations.lightning import StabmonCallback  # noqa: E402
from stabmon.monitor import MonitorConfig  # noqa: E402


class Tiny(L.LightningModule):
    def __init__(self, lr: float = 0.1, opt: str = "sgd") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.lr, self.opt = lr, opt

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        if self.opt == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(n: int = 64, seed: int = 0) -> Any:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = 10 * x.sum(1, keepdim=True)  # large targets: large gradients, so clipping always bites
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def trainer(tmp_path: Path, callbacks: list[Any], **kw: Any) -> Any:
    base = dict(max_steps=20, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    base.update(kw)
    return L.Trainer(callbacks=callbacks, **base)


class Probe(L.Callback):
    """Test helper, placed before StabmonCallback: the true pre-clip norm and the update of each step."""

    def __init__(self, at: int | None = None, action: Any = None) -> None:
        self.at, self.action = at, action
        self.norms: list[float] = []
        self.deltas: list[float] = []
        self._before: torch.Tensor | None = None

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self._before = torch.cat([p.detach().flatten().clone() for p in module.parameters()])
        if self.at is not None and trainer.global_step == self.at:
            self.action()

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        grads = [p.grad.flatten() for p in module.parameters() if p.grad is not None]
        self.norms.append(float(torch.cat(grads).norm()))

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        after = torch.cat([p.detach().flatten() for p in module.parameters()])
        self.deltas.append(float((after - self._before).norm()))


def test_fit_records_every_step_and_clips_once(tmp_path: Path, sqlite_url: str, monkeypatch: Any) -> None:
    from lightning.pytorch.plugins.precision import Precision

    lightning_clips: list[float] = []
    original = Precision.clip_grad_by_norm

    def spy(self: Any, optimizer: Any, clip_val: float) -> None:
        lightning_clips.append(clip_val)
        original(self, optimizer, clip_val)

    monkeypatch.setattr(Precision, "clip_grad_by_norm", spy)
    clip = 0.05
    probe, cb = Probe(), StabmonCallback(store=sqlite_url, config=MonitorConfig(flush_every=5))
    t = trainer(tmp_path, [probe, cb], gradient_clip_val=clip)
    t.fit(Tiny(), loader())

    assert t.gradient_clip_val == clip  # given back after fit
    assert lightning_clips == []  # Lightning did not clip: the monitor did
    by_step = metrics_by_step(sqlite_url, cb.monitor.run_id)
    assert sorted(by_step) == list(range(20))
    assert len(probe.norms) == len(probe.deltas) == 20
    for step, m in by_step.items():
        assert {"loss", "grad_norm", "lr", "clip"} <= set(m), step
        assert m["clip"] == pytest.approx(clip)
        # this step's gradients (not the previous step's: Lightning runs backward inside optimizer.step)
        assert m["grad_norm"] == pytest.approx(probe.norms[step], rel=1e-4)
        assert m["grad_norm"] > clip
        assert probe.deltas[step] == pytest.approx(m["lr"] * clip, rel=1e-3)  # clipped, once, at clip
        assert math.isfinite(m["loss"]) and m["loss"] > 0
    assert by_step[7]["lr"] == pytest.approx(0.05)  # the step scheduler's halving shows in the record
    assert [r.batch_index for r in cb.monitor.records] == list(range(8)) * 2 + list(range(4))
    assert cb.exit_code == 0 and not cb.stop_requested


class LoggedTiny(Tiny):
    """Tiny that logs its loss and gradient norm through Lightning's own logging, every step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True)
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.parameters()]))
        self.log("lightning_grad_norm", norm, on_step=True)


@pytest.mark.parametrize("seed", [0, 1])
def test_each_metric_is_stored_at_the_step_lightning_logs_it(tmp_path: Path, sqlite_url: str, seed: int) -> None:
    """Lightning's own logger (CSVLogger, every step) and the store agree step for step: the loss and the
    gradient norm Lightning logs at trainer.global_step N are the monitor's values at step N."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    cb = StabmonCallback(store=sqlite_url, config=MonitorConfig(flush_every=5))
    t = trainer(tmp_path, [cb], max_steps=12, logger=CSVLogger(str(tmp_path / "logs")), log_every_n_steps=1)
    t.fit(LoggedTiny(), loader(seed=seed))
    with open(next((tmp_path / "logs").rglob("metrics.csv"))) as fh:
        logged = {int(row["step"]): row for row in csv.DictReader(fh)}
    by_step = metrics_by_step(sqlite_url, cb.monitor.run_id)
    assert sorted(logged) == sorted(by_step) == list(range(12))  # Lightning numbers from 0, as global_step
    for step, row in logged.items():
        assert by_step[step]["loss"] == pytest.approx(float(row["train_loss"]), rel=1e-5), step
        assert by_step[step]["grad_norm"] == pytest.approx(float(row["lightning_grad_norm"]), rel=1e-4), step
    losses = [float(logged[s]["train_loss"]) for s in range(12)]  # neighbours differ: the check can fail
    assert min(abs(a - b) / b for a, b in zip(losses, losses[1:], strict=False)) > 1e-3


def test_gradient_accumulation_gives_one_record_per_optimizer_step(tmp_path: Path) -> None:
    cb = StabmonCallback(store=None, config=MonitorConfig(flush_every=3))
    t = trainer(tmp_path, [cb], max_steps=6, accumulate_grad_batches=2)
    t.fit(Tiny(opt="adamw", lr=1e-2), loader())
    records = list(cb.monitor.records)
    assert [r.step for r in records] == list(range(6))
    assert [r.batch_index for r in records] == [0, 2, 4, 6, 0, 2]
    assert all(r.get("grad_norm") is not None and r.get("loss") is not None for r in records)


def test_forced_checkpoint_and_stop_stops_fit(tmp_path: Path, sqlite_url: str) -> None:
    switch = tmp_path / "STOP"
    cb = StabmonCallback(store=sqlite_url, config=MonitorConfig(flush_every=4, kill_switch=str(switch)))
    probe = Probe(at=5, action=lambda: switch.write_text("operator stop"))
    t = trainer(tmp_path, [probe, cb], max_steps=40)
    t.fit(Tiny(), loader())

    assert t.global_step == 8  # the first flush after the switch appeared
    assert cb.stop_requested and cb.exit_code == STOP_EXIT_CODE
    assert "operator stop" in (cb.monitor.stop_reason or "")
    assert cb.stop_checkpoint == str(tmp_path / "stabmon-stop-step=8.ckpt")
    ckpt = torch.load(cb.stop_checkpoint, weights_only=True)  # monitor state is bytes: still safe to load
    assert ckpt["global_step"] == 8


def test_monitor_state_survives_save_and_resume(tmp_path: Path, sqlite_url: str) -> None:
    def set_override() -> None:
        first.monitor.overrides.lr_scale = 0.5

    first = StabmonCallback(store=sqlite_url, config=MonitorConfig(flush_every=5))
    t1 = trainer(tmp_path, [Probe(at=3, action=set_override), first], max_steps=12)
    t1.fit(Tiny(), loader())
    path = tmp_path / "resume.ckpt"
    t1.save_checkpoint(path)

    second = StabmonCallback(store=sqlite_url, config=MonitorConfig(flush_every=5))
    t2 = trainer(tmp_path, [second], max_steps=20)
    t2.fit(Tiny(), loader(), ckpt_path=str(path))

    mon = second.monitor
    assert mon.run_id == first.monitor.run_id  # the same run continues in the store
    assert mon.step == 20 and mon.overrides.lr_scale == 0.5
    assert [r.step for r in mon.records] == list(range(12, 20))
    for r in mon.records:  # restored scheduler (StepLR 7, 0.5) under the restored override (x0.5)
        assert r.get("lr") == pytest.approx(0.5 * 0.1 * 0.5 ** (r.step // 7)), r.step
    assert sorted(metrics_by_step(sqlite_url, mon.run_id)) == list(range(20))


def test_fp16_grad_scaler_overflow_steps_are_recorded_and_overrides_do_not_compound(tmp_path: Path) -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=8192.0, growth_interval=1000)  # overflows at first
    cb = StabmonCallback(store=None, config=MonitorConfig(flush_every=3))
    fp32 = StabmonCallback(store=None, config=MonitorConfig(flush_every=3))

    def halve_lr() -> None:
        cb.monitor.overrides.lr_scale = 0.5

    t = trainer(tmp_path, [Probe(at=0, action=halve_lr), cb], max_steps=6,
                plugins=[MixedPrecision(precision="16-mixed", device="cpu", scaler=scaler)])
    t.fit(Tiny(opt="adamw", lr=1e-2), loader())
    trainer(tmp_path, [fp32], max_steps=1).fit(Tiny(opt="adamw", lr=1e-2), loader())

    records = list(cb.monitor.records)
    overflow = [r.get("overflow") for r in records]
    assert overflow[0] == 1.0 and overflow[-1] == 0.0  # the scaler's search for a scale, then clean steps
    assert [r.get("loss_scale") for r in records][:2] == [8192.0, 4096.0]
    # the loss is unscaled (Lightning hands on_before_backward the scaled one)
    assert records[0].get("loss") == pytest.approx(fp32.monitor.records[0].get("loss"), rel=1e-2)
    # lr x 0.5 on every step, skipped or not, and the param group is back to the scheduler's value
    assert all(r.get("lr") == pytest.approx(0.005) for r in records)
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01)
    clean = [r for r in records if r.get("overflow") == 0.0]
    assert clean and all(math.isfinite(r.get("grad_norm")) for r in clean)


def test_callback_adds_one_host_read_per_flush_and_none_per_step(tmp_path: Path) -> None:
    """The same fit with the callback reads tensors back exactly one more time per monitor flush (the closer
    flushes of a watch window included)."""

    counters: list[SyncCounter] = []

    def run(callbacks: list[Any]) -> dict[str, int]:
        t = trainer(tmp_path, callbacks, max_steps=20, gradient_clip_val=1.0)
        counters.append(SyncCounter())
        with counters[-1] as counter:
            t.fit(Tiny(opt="adamw", lr=1e-2), loader())
        return without_landed(counter)

    cb = StabmonCallback(store=None, config=MonitorConfig(flush_every=6, hang_timeout=None))
    flushes = []

    class CountFlushes(L.Callback):
        def on_fit_start(self, *a: Any) -> None:
            real = cb.monitor.flush
            cb.monitor.flush = lambda: (flushes.append(1), real())[1]
            count_alarm_reads(cb.monitor, counters[-1])

    plain = run([])
    monitored = run([cb, CountFlushes()])
    assert len(flushes) >= 4  # steps 6, 12, 18 and the rest at fit end, and closer ones after an early warning
    expected = dict(plain)
    expected["tolist"] = expected.get("tolist", 0) + len(flushes)
    assert monitored == expected
    assert counters[-1].landed == ["__float__"] * 20  # the loss alarm: each step's loss, from its host slot


def test_a_crash_in_training_ends_the_run_as_failed(tmp_path: Path, sqlite_url: str) -> None:
    class Crashes(Tiny):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.trainer.global_step == 3:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    cb = StabmonCallback(store=sqlite_url, config=MonitorConfig(flush_every=10))
    t = trainer(tmp_path, [cb], max_steps=10, gradient_clip_val=0.5)
    with pytest.raises(RuntimeError, match="boom"):
        t.fit(Crashes(), loader())
    assert t.gradient_clip_val == 0.5
    from stabmon.store import open_store
    from stabmon.store.repo import list_runs

    store = open_store(sqlite_url)
    try:
        with store.session() as session:
            runs = list_runs(session=session)
    finally:
        store.close()
    assert [(r.status, r.steps) for r in runs] == [("failed", 3)]  # the steps before the crash are kept


def test_bad_store_url_fails_before_fit() -> None:
    with pytest.raises(ValueError, match=r"^store: cannot open") as info:
        StabmonCallback(store="nosuchdialect://nowhere/db")
    assert "\n" not in str(info.value)


def test_bad_runbook_name_fails_before_fit() -> None:
    with pytest.raises(ValueError, match=r"^runbook: ") as info:
        StabmonCallback(store=None, runbook="no-such-runbook")
    assert "\n" not in str(info.value)


def test_two_optimizers_are_refused_at_fit_start(tmp_path: Path) -> None:
    class Two(Tiny):
        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                    torch.optim.SGD(self.net[2].parameters(), lr=0.1)]

        def training_step(self, batch: Any, batch_idx: int) -> None:
            return None

    module = Two()
    module.automatic_optimization = False
    cb = StabmonCallback(store=None)
    with pytest.raises(ValueError, match="exactly one optimizer"):
        trainer(tmp_path, [cb], max_steps=2).fit(module, loader())


def load_example(name: str) -> Any:
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_script_runs_monitored_into_sqlite(tmp_path: Path, sqlite_url: str, capsys: Any) -> None:
    ex = load_example("lightning_loop")
    code = ex.main(["--steps", "20", "--db", sqlite_url, "--out", str(tmp_path)])
    assert code == 0
    assert "20 steps" in capsys.readouterr().out
    from stabmon.store import open_store
    from stabmon.store.repo import list_runs

    store = open_store(sqlite_url)
    try:
        with store.session() as session:
            runs = list_runs(session=session)
    finally:
        store.close()
    assert [(r.name, r.status, r.steps) for r in runs] == [("lightning-example", "finished", 20)]
    by_step = metrics_by_step(sqlite_url, runs[0].id)
    assert sorted(by_step) == list(range(20))
    assert by_step[19]["loss"] < by_step[0]["loss"] - 0.5  # it learns
    assert all(m["clip"] == 1.0 for m in by_step.values())  # Lightning's gradient_clip_val, in the monitor


@pytest.mark.slow
def test_example_unstable_setting_learns_then_diverges(tmp_path: Path) -> None:
    ex = load_example("lightning_loop")
    cb = ex.train(steps=100, unstable=True, out=str(tmp_path))
    recs = list(cb.monitor.records)
    loss = [r.get("loss") for r in recs]
    norm = [r.get("grad_norm") for r in recs]
    best = min(loss[:55])
    assert best < 1.6  # it learned first (uniform is 3.47)
    assert sum(loss[-10:]) / 10 > 1.8 * best  # then diverged and stayed there
    calm = sorted(norm[10:50])[20]  # median grad norm while learning
    first_norm_jump = next(i for i, n in enumerate(norm) if i >= 50 and n > 1.5 * calm)
    first_loss_jump = next(i for i, v in enumerate(loss) if i >= 50 and v > 1.5 * best)
    assert first_norm_jump <= first_loss_jump  # the gradient norm moves first


def test_the_loggers_get_the_lr_in_force(tmp_path: Path) -> None:
    """Lightning's LearningRateMonitor logs the param groups' value, which between steps is the schedule's: the
    callback logs ``stabmon/lr``, the LR in force with the monitor's overrides, to the same loggers."""
    import csv

    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    cb = StabmonCallback(store=None, config=MonitorConfig(flush_every=2))

    def halve_lr() -> None:
        cb.monitor.overrides.lr_scale = 0.5

    t = trainer(tmp_path, [Probe(at=2, action=halve_lr), cb, LearningRateMonitor(logging_interval="step")],
                max_steps=6, logger=CSVLogger(str(tmp_path), name="logs"), log_every_n_steps=1)
    t.fit(Tiny(lr=0.1), loader())
    with open(Path(t.logger.log_dir) / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    in_force = {int(r["step"]): float(r["stabmon/lr"]) for r in rows if r.get("stabmon/lr")}
    schedule = {int(r["step"]): float(r["lr-SGD"]) for r in rows if r.get("lr-SGD")}
    assert in_force[0] == pytest.approx(0.1) and in_force[5] == pytest.approx(0.05)  # halved from step 2 on
    assert schedule[5] == pytest.approx(0.1)  # what LearningRateMonitor shows: the schedule's value
    assert [r.get("lr") for r in cb.monitor.records][-1] == pytest.approx(in_force[5])


class ValidatingTiny(Tiny):
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)


class DeadlineProbe(L.Callback):
    """Test helper, after StabmonCallback: the hang watchdog's deadline during validation."""

    def __init__(self, callback: Any) -> None:
        self.callback, self.in_validation = callback, []

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        if self.callback.monitor is not None:
            self.in_validation.append(self.callback.monitor._watchdog.deadline())


def test_validation_is_outside_the_steps_for_the_hang_watchdog(tmp_path: Path) -> None:
    from stabmon.collect.config import HangConfig

    config = MonitorConfig(hang_timeout=600.0, hang=HangConfig(floor=0.5, warmup=0, learn_after=2))
    cb = StabmonCallback(store=None, detectors=False, config=config)
    probe = DeadlineProbe(cb)
    fit = trainer(tmp_path, [cb, probe], val_check_interval=5, num_sanity_val_steps=0, limit_val_batches=2)
    fit.fit(ValidatingTiny(), loader(), loader(16))
    assert probe.in_validation and set(probe.in_validation) == {600.0}
    assert cb.monitor._watchdog.deadline() < 600.0 or cb.monitor._closed  # learned between the validations
