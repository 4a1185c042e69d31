"""StabmonCallback in a real ``transformers.Trainer.train()`` on a tiny GPT-2 (random init, CPU)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from store_support import metrics_by_step  # noqa: E402
from sync_support import SyncCounter, count_alarm_reads, without_landed  # noqa: E402

from stabmon.checkpoints import STOP_EXIT_CODE  # noqa: E402
from stabmon.integrations.hf import STATE_FILE, StabmonCallback  # noqa: E402
from stabmon.monitor import MonitorConfig  # noqa: E402

VOCAB, SEQ = 32, 16


def tiny_model(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(cfg)


def dataset(n: int = 256, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        start = int(torch.randint(0, VOCAB, (1,), generator=g))
        ids = (torch.arange(SEQ) * 3 + start) % VOCAB  # a learnable pattern
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def make_args(out: Path, **kw: Any) -> Any:
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=8,
        learning_rate=5e-3,
        max_steps=24,
        logging_steps=1000,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


class Recorder(transformers.TrainerCallback):
    """Test helper: parameter snapshots around each step, and an optional action at one step."""

    def __init__(self, at: int | None = None, action: Any = None) -> None:
        self.at, self.action = at, action
        self.deltas: list[float] = []
        self._before: torch.Tensor | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self._before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        if self.at is not None and state.global_step == self.at:
            self.action()

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
        self.deltas.append(float((after - self._before).norm()))


@pytest.mark.slow
def test_trainer_records_every_step_and_clips_once(tmp_path: Path, sqlite_url: str, monkeypatch: Any) -> None:
    import accelerate

    trainer_clips: list[float] = []
    original = accelerate.Accelerator.clip_grad_norm_

    def spy(self: Any, parameters: Any, max_norm: float, *a: Any, **k: Any) -> Any:
        trainer_clips.append(float(max_norm))
        return original(self, parameters, max_norm, *a, **k)

    monkeypatch.setattr(accelerate.Accelerator, "clip_grad_norm_", spy)
    clip = 0.05  # far below this model's gradient norm: every step is clipped
    cb = StabmonCallback(store=sqlite_url, config=MonitorConfig(flush_every=5))
    rec = Recorder()
    args = make_args(tmp_path / "out", max_grad_norm=clip, optim="sgd", learning_rate=0.1, weight_decay=0.0)
    trainer = transformers.Trainer(model=tiny_model(), args=args, train_dataset=dataset(),
                                   callbacks=[cb, rec])
    trainer.train()

    assert args.max_grad_norm == clip  # given back after training
    # the Trainer (5.x) still measures a norm for its logs each step, but with max_norm=inf: it never clips
    assert len(trainer_clips) == 24 and all(math.isinf(v) for v in trainer_clips)
    by_step = metrics_by_step(sqlite_url, cb.monitor.run_id)
    assert sorted(by_step) == list(range(1, 25))  # numbered as the Trainer numbers its steps
    for step, m in by_step.items():
        assert {"loss", "grad_norm", "lr", "clip"} <= set(m), step
        assert m["clip"] == pytest.approx(clip)
        assert math.isfinite(m["loss"]) and m["loss"] > 0
    assert by_step[1]["loss"] == pytest.approx(math.log(VOCAB), rel=0.1)  # random init: ~uniform
    # the monitor saw pre-clip norms, and the update is lr x clip: clipped exactly as configured
    assert len(rec.deltas) == 24
    for step, delta in enumerate(rec.deltas, 1):
        m = by_step[step]
        assert m["grad_norm"] > clip
        assert delta == pytest.approx(m["lr"] * clip, rel=1e-3)
    assert cb.exit_code == 0 and not cb.stop_requested


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "accumulate"), [(0, 1), (1, 2)])
def test_each_metric_is_stored_at_the_step_the_trainer_logs_it(
    tmp_path: Path, sqlite_url: str, seed: int, accumulate: int
) -> None:
    """The Trainer's own log (logging every step) and the store agree step for step: its grad_norm and loss
    logged at step N are the monitor's values at step N."""
    cb = StabmonCallback(store=sqlite_url, config=MonitorConfig(flush_every=5))
    args = make_args(tmp_path / "out", max_steps=16, logging_steps=1, max_grad_norm=1.0, seed=seed,
                     gradient_accumulation_steps=accumulate, per_device_train_batch_size=8 // accumulate)
    trainer = transformers.Trainer(model=tiny_model(seed), args=args, train_dataset=dataset(seed=seed),
                                   callbacks=[cb])
    trainer.train()
    logged = {e["step"]: e for e in trainer.state.log_history if "grad_norm" in e}
    by_step = metrics_by_step(sqlite_url, cb.monitor.run_id)
    assert sorted(logged) == sorted(by_step) == list(range(1, 17))
    for step, entry in logged.items():
        assert by_step[step]["grad_norm"] == pytest.approx(entry["grad_norm"], rel=1e-4), step
        assert by_step[step]["loss"] == pytest.approx(entry["loss"], abs=1e-4), step
    # the check can tell neighbours apart: consecutive steps' norms differ far more than the tolerance
    norms = [logged[s]["grad_norm"] for s in range(1, 17)]
    assert min(abs(a - b) / b for a, b in zip(norms, norms[1:], strict=False)) > 1e-3


@pytest.mark.slow
def test_forced_checkpoint_and_stop_stops_the_trainer(tmp_path: Path, sqlite_url: str) -> None:
    switch = tmp_path / "STOP"
    cb = StabmonCallback(store=sqlite_url, config=MonitorConfig(flush_every=4, kill_switch=str(switch)))
    rec = Recorder(at=5, action=lambda: switch.write_text("operator stop"))
    out = tmp_path / "out"
    trainer = transformers.Trainer(model=tiny_model(), args=make_args(out, max_steps=40),
                                   train_dataset=dataset(), callbacks=[cb, rec])
    trainer.train()

    assert trainer.state.global_step == 8  # the first flush after the switch appeared
    assert cb.stop_requested and cb.exit_code == STOP_EXIT_CODE
    assert "operator stop" in (cb.monitor.stop_reason or "")
    saved = torch.load(out / "checkpoint-8" / STATE_FILE, weights_only=False)
    assert saved["step"] == 9 and saved["run_id"] == cb.monitor.run_id  # the next step it would record


@pytest.mark.slow
def test_monitor_state_survives_save_and_resume(tmp_path: Path, sqlite_url: str) -> None:
    out = tmp_path / "out"

    def set_override() -> None:
        first.monitor.overrides.lr_scale = 0.5

    first = StabmonCallback(store=sqlite_url, config=MonitorConfig(flush_every=5))
    args = make_args(out, max_steps=20, save_strategy="steps", save_steps=10)
    t1 = transformers.Trainer(model=tiny_model(), args=args, train_dataset=dataset(),
                              callbacks=[first, Recorder(at=3, action=set_override)])
    t1.train()
    saved = torch.load(out / "checkpoint-20" / STATE_FILE, weights_only=False)
    assert saved["step"] == 21 and saved["overrides"]["lr_scale"] == 0.5

    second = StabmonCallback(store=sqlite_url, config=MonitorConfig(flush_every=5))
    t2 = transformers.Trainer(model=tiny_model(), args=make_args(out, max_steps=30), train_dataset=dataset(),
                              callbacks=[second])
    t2.train(resume_from_checkpoint=True)

    mon = second.monitor
    assert mon.run_id == first.monitor.run_id  # the same run continues in the store
    assert mon.step == 31 and mon.overrides.lr_scale == 0.5
    assert mon.state_dict()["hooks"] == {"ema_host": pytest.approx(
        _continue_ema(saved["hooks"]["ema_host"], [r.get("grad_norm") for r in mon.records]))}
    steps = sorted(metrics_by_step(sqlite_url, mon.run_id))
    assert steps == list(range(1, 31))


def _continue_ema(start: float, norms: list[float | None], decay: float = 0.98) -> float:
    ema = start
    for n in norms:
        if n is not None and math.isfinite(n):
            ema = decay * ema + (1 - decay) * n
    return ema


@pytest.mark.slow
def test_gradient_accumulation_gives_one_record_per_optimizer_step(tmp_path: Path) -> None:
    cb = StabmonCallback(store=None, config=MonitorConfig(flush_every=3))
    args = make_args(tmp_path / "out", max_steps=6, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    transformers.Trainer(model=tiny_model(), args=args, train_dataset=dataset(), callbacks=[cb]).train()
    records = list(cb.monitor.records)
    assert [r.step for r in records] == list(range(1, 7))
    assert [r.batch_index for r in records] == [0, 2, 4, 6, 8, 10]
    # the loss of the whole accumulated batch: neither the sum of micro-batch means nor half of it
    assert records[0].get("loss") == pytest.approx(math.log(VOCAB), rel=0.1)
    assert all(r.get("grad_norm") is not None for r in records)


@pytest.mark.slow
def test_callback_adds_one_host_read_per_flush_and_none_per_step(tmp_path: Path) -> None:
    """The Trainer reads tensors back itself (its NaN filter); the same run with the callback reads back
    exactly one more time per monitor flush and never on the steps in between."""

    counters: list[SyncCounter] = []

    def run(callbacks: list[Any]) -> dict[str, int]:
        args = make_args(tmp_path / f"out{len(callbacks)}", max_steps=24, max_grad_norm=1.0)
        trainer = transformers.Trainer(model=tiny_model(), args=args, train_dataset=dataset(), callbacks=callbacks)
        counters.append(SyncCounter())
        with counters[-1] as counter:
            trainer.train()
        return without_landed(counter)

    cb = StabmonCallback(store=None, config=MonitorConfig(flush_every=5, hang_timeout=None))
    flushes = []

    class CountFlushes(transformers.TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            real = cb.monitor.flush
            cb.monitor.flush = lambda: (flushes.append(1), real())[1]
            count_alarm_reads(cb.monitor, counters[-1])

    plain = run([])
    monitored = run([cb, CountFlushes()])
    assert len(flushes) == 5  # steps 5, 10, 15, 20 and the rest at train end
    expected = dict(plain)
    expected["tolist"] = expected.get("tolist", 0) + len(flushes)
    assert monitored == expected
    assert counters[-1].landed == ["__float__"] * 24  # the loss alarm: each step's loss, from its host slot


@pytest.mark.slow
def test_a_crashed_train_is_closed_as_failed_by_the_next_one(tmp_path: Path, sqlite_url: str) -> None:
    def boom() -> None:
        raise RuntimeError("boom")

    cb = StabmonCallback(store=sqlite_url, config=MonitorConfig(flush_every=5))
    args = make_args(tmp_path / "out", max_steps=6, max_grad_norm=0.5)
    crashing = transformers.Trainer(model=tiny_model(), args=args, train_dataset=dataset(),
                                    callbacks=[cb, Recorder(at=3, action=boom)])
    with pytest.raises(RuntimeError, match="boom"):
        crashing.train()
    first = cb.monitor.run_id
    transformers.Trainer(model=tiny_model(), args=args, train_dataset=dataset(), callbacks=[cb]).train()
    assert args.max_grad_norm == 0.5 and cb.monitor.config.clip == 0.5

    from stabmon.store import open_store
    from stabmon.store.repo import list_runs

    store = open_store(sqlite_url)
    try:
        with store.session() as session:
            runs = {r.id: (r.status, r.steps) for r in list_runs(session=session)}
    finally:
        store.close()
    assert runs == {first: ("failed", 3), cb.monitor.run_id: ("finished", 6)}


def test_bad_store_url_fails_before_training() -> None:
    with pytest.raises(ValueError, match=r"^store: cannot open") as info:
        StabmonCallback(store="nosuchdialect://nowhere/db")
    assert "\n" not in str(info.value)


def test_bad_runbook_name_fails_before_training() -> None:
    with pytest.raises(ValueError, match=r"^runbook: ") as info:
        StabmonCallback(store=None, runbook="no-such-runbook")
    assert "\n" not in str(info.value)


def test_bad_mode_and_config_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"^mode: "):
        StabmonCallback(store=None, mode="sometimes")
    with pytest.raises(ValueError, match=r"^config: expected a MonitorConfig"):
        StabmonCallback(store=None, config={"clip": 1.0})  # type: ignore[arg-type]


def load_example(name: str) -> Any:
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_script_runs_monitored_into_sqlite(tmp_path: Path, sqlite_url: str, capsys: Any) -> None:
    ex = load_example("hf_trainer")
    code = ex.main(["--steps", "20", "--db", sqlite_url, "--out", str(tmp_path / "out")])
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
    assert [(r.name, r.status, r.steps) for r in runs] == [("hf-trainer-example", "finished", 20)]
    by_step = metrics_by_step(sqlite_url, runs[0].id)
    assert sorted(by_step) == list(range(1, 21))
    assert by_step[20]["loss"] < by_step[1]["loss"] - 0.5  # it learns
    assert all(m["clip"] == 1.0 for m in by_step.values())  # the Trainer's max_grad_norm, in the monitor


@pytest.mark.slow
def test_example_unstable_setting_learns_then_blows_up(tmp_path: Path, sqlite_url: str) -> None:
    ex = load_example("hf_trainer")
    cb = ex.train(steps=100, unstable=True, db=sqlite_url, out=str(tmp_path / "out"))
    recs = list(cb.monitor.records)
    loss = [r.get("loss") for r in recs]
    norm = [r.get("grad_norm") for r in recs]
    best = min(loss[:60])
    assert best < 2.0  # it learned first (uniform is 3.47)
    assert max(loss[60:]) > 4 * best  # then blew up
    calm = sorted(norm[10:50])[20]  # median grad norm while learning
    first_norm_jump = next(i for i, n in enumerate(norm) if i >= 50 and n > 2 * calm)
    first_loss_jump = next(i for i, v in enumerate(loss) if i >= 50 and v > 2 * best)
    assert first_norm_jump <= first_loss_jump  # the gradient norm moves first
    assert cb.monitor.anomalies  # and the monitor noticed


STOP_RUNBOOK = """\
name: stop-on-spike
description: Stop for a human at the first recurring spike, or a loss that climbed and stays up.
mode: apply
rules:
  - name: spike
    description: Recurring loss or gradient-norm spikes.
    when: {kind: spike, metric: "*", severity: warning, persistence: {seen: 3, of: 50}}
    ladder:
      - action: checkpoint_and_stop
        params: {reason: "recurring spikes: stopped for a human"}
        observe: 1
  - name: regression
    description: A loss that climbs steadily is no spike to a baseline that follows it; it is a regression.
    when: {kind: regression, metric: "*", severity: error}
    ladder:
      - action: checkpoint_and_stop
        params: {reason: "recurring spikes: stopped for a human"}
        observe: 1
"""


@pytest.mark.slow
def test_runbook_checkpoint_and_stop_ends_the_unstable_example(tmp_path: Path) -> None:
    runbook = tmp_path / "stop.yaml"
    runbook.write_text(STOP_RUNBOOK)
    ex = load_example("hf_trainer")
    out = tmp_path / "out"
    cb = ex.train(steps=100, unstable=True, runbook=str(runbook), mode="apply", out=str(out))
    stopped_at = cb.monitor.step - 1  # the last step recorded: the Trainer's global_step at the stop
    assert cb.exit_code == STOP_EXIT_CODE and stopped_at < 100
    assert cb.monitor.stop_reason == "recurring spikes: stopped for a human"
    decisions = [e for e in cb.monitor.events if type(e).__name__ == "Decision"]
    assert [d.action for d in decisions] == ["checkpoint_and_stop"]
    saved = torch.load(out / f"checkpoint-{stopped_at}" / STATE_FILE, weights_only=False)
    assert saved["step"] == stopped_at + 1  # resumes at the next step


@pytest.mark.slow
def test_the_trainers_logs_show_the_effective_lr(tmp_path: Path) -> None:
    """An LR override (a runbook's scale_lr or LR cap) must show in the Trainer's own ``learning_rate`` log,
    which reads ``lr_scheduler.get_last_lr()``: the schedule's value said 5e-3 while 2.5e-3 was in force."""
    cb = StabmonCallback(store=None, config=MonitorConfig(flush_every=4))

    def halve() -> None:
        cb.monitor.overrides.lr_scale = 0.5

    args = make_args(tmp_path / "out", max_steps=8, logging_steps=2, lr_scheduler_type="constant",
                     save_strategy="steps", save_steps=3)  # saves at steps that log and steps that do not
    trainer = transformers.Trainer(model=tiny_model(), args=args, train_dataset=dataset(),
                                   callbacks=[cb, Recorder(at=4, action=halve)])
    trainer.train()
    logged = {h["step"]: h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h}
    assert logged[2] == pytest.approx(5e-3) and logged[8] == pytest.approx(2.5e-3)
    recorded = [r.get("lr") for r in cb.monitor.records]
    assert recorded[-1] == pytest.approx(logged[8])  # the Trainer's log and stabmon's record agree
    scheduler = trainer.lr_scheduler
    assert "get_last_lr" not in vars(scheduler) and scheduler.get_last_lr()[0] == pytest.approx(5e-3)


class DeadlineProbe(transformers.TrainerCallback):
    """Test helper, after StabmonCallback: the hang watchdog's deadline during the Trainer's evaluation, and at
    the start of each step."""

    def __init__(self, callback: Any) -> None:
        self.callback = callback
        self.in_eval: list[float] = []
        self.at_steps: list[float] = []

    def _deadline(self) -> float:
        return self.callback.monitor._watchdog.deadline()

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.in_eval.append(self._deadline())

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.at_steps.append(self._deadline())


def test_the_trainers_evaluation_is_outside_the_steps_for_the_hang_watchdog(tmp_path: Path) -> None:
    from stabmon.collect.config import HangConfig

    config = MonitorConfig(hang_timeout=600.0, hang=HangConfig(floor=0.5, warmup=0, learn_after=2))
    cb = StabmonCallback(store=None, detectors=False, config=config)
    probe = DeadlineProbe(cb)
    args = make_args(tmp_path / "out", max_steps=12, eval_strategy="steps", eval_steps=5,
                     per_device_eval_batch_size=8)
    trainer = transformers.Trainer(model=tiny_model(), args=args, train_dataset=dataset(), eval_dataset=dataset(16),
                                   callbacks=[cb, probe])
    trainer.train()
    assert probe.in_eval and set(probe.in_eval) == {600.0}  # the cap while the Trainer evaluates
    learned = probe.at_steps[4:]  # after the warm-up, at the start of each step: the learned deadline
    assert learned and all(d < 600.0 for d in learned)
