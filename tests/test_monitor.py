"""The live Monitor in plain loops: collected signals, clipping, overrides, skip guard, scaler, state, bad
input."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from stabmon.collect.config import ActivationConfig, DiagnoseConfig, EmbeddingConfig, GradConfig, MonitorConfig
from stabmon.events import Metric, StepRecord
from stabmon.monitor import Monitor


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.ff = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.ln(x))


class Tiny(nn.Module):
    def __init__(self, vocab: int = 13, d: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def batches(n: int, vocab: int = 13) -> list[torch.Tensor]:
    return [torch.randint(0, vocab, (4, 6), generator=torch.Generator().manual_seed(i)) for i in range(n)]


def loss_of(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())


def train(
    mon: Monitor,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: list[Any],
    sched: Any = None,
    **steps_kw: Any,
) -> list[int]:
    seen = []
    for _, idx in mon.steps(data, **steps_kw):
        seen.append(mon.buffer._current.batch_index)  # type: ignore[union-attr]
        loss = loss_of(model, idx)
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
    return seen


def make(seed: int = 0, lr: float = 0.1, **kw: Any) -> tuple[Tiny, torch.optim.Optimizer, Monitor]:
    torch.manual_seed(seed)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    kw.setdefault("store", None)
    kw.setdefault("detectors", False)
    return model, opt, Monitor(model, opt, **kw)


# -- collected signals ----------------------------------------------------------------------------------
def test_clipping_and_norms_match_clip_grad_norm() -> None:
    data = batches(12)
    torch.manual_seed(0)
    ref = Tiny()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.01)
    ref_norms = []
    for idx in data:
        loss_of(ref, idx).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, foreach=True)))
        ref_opt.step()
        ref_opt.zero_grad()
    model, opt, mon = make(config=MonitorConfig(clip=0.5))
    for _, idx in mon.steps(data):
        loss = loss_of(model, idx)
        loss.backward()
        mon.observe(loss=loss, tokens=idx.numel())
        opt.step()
        opt.zero_grad()
    mon.close()
    got = [r.metrics[Metric.GRAD_NORM] for r in mon.records]
    assert got == pytest.approx(ref_norms, rel=1e-5)
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    rec = mon.records[3]
    layers = [v for k, v in rec.metrics.items() if k.startswith(Metric.GRAD_NORM_PREFIX)]
    assert {k for k in rec.metrics if k.startswith("grad_norm/")} == {
        "grad_norm/wte",
        "grad_norm/blocks.0",
        "grad_norm/blocks.1",
        "grad_norm/head",
    }
    assert math.sqrt(sum(v * v for v in layers)) == pytest.approx(rec.metrics[Metric.GRAD_NORM], rel=1e-5)
    assert rec.metrics[Metric.CLIP] == 0.5 and rec.metrics[Metric.NONFINITE] == 0.0
    assert rec.metrics[Metric.LR] == 0.1 and rec.metrics[Metric.BETA2] == 0.999
    assert rec.metrics[Metric.WEIGHT_DECAY] == 0.01 and rec.metrics[Metric.STEP_TIME] > 0
    assert rec.metrics[Metric.TOKENS_PER_SEC] == pytest.approx(24 / rec.metrics[Metric.STEP_TIME])
    assert [r.batch_index for r in mon.records] == list(range(12))


def test_layer_patterns_and_sampling_cadence() -> None:
    cfg = MonitorConfig(
        grads=GradConfig(layers=(r"blocks\.\d+",)),
        flush_every=4,
        activations=ActivationConfig(every=3, modules=("blocks\\.1", "head")),
        embeddings=EmbeddingConfig(every=5),
    )
    model, opt, mon = make(config=cfg)
    train(mon, model, opt, batches(11))
    mon.close()
    recs = list(mon.records)
    layers = {k for k in recs[0].metrics if k.startswith("grad_norm/")}
    assert layers == {"grad_norm/blocks.0", "grad_norm/blocks.1"}
    assert [r.step for r in recs if "act_rms/head" in r.metrics] == [0, 3, 6, 9]
    assert [r.step for r in recs if "emb_drift/wte" in r.metrics] == [0, 5, 10]
    assert "act_rms/blocks.0" not in recs[0].metrics
    assert recs[5].metrics["emb_drift/wte"] > recs[0].metrics["emb_drift/wte"] > 0


def test_embedding_update_ratio_is_one_step() -> None:
    model, opt, mon = make(config=MonitorConfig(embeddings=EmbeddingConfig(every=2)))
    snapshots = {}
    data = batches(4)
    w0 = model.wte.weight.detach().clone()
    for step, idx in mon.steps(data):
        before = model.wte.weight.detach().clone()
        loss = loss_of(model, idx)
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
        snapshots[step] = (before, model.wte.weight.detach().clone())
    mon.close()
    before, after = snapshots[2]
    rec = mon.records[2]
    ratio = float((after - before).norm() / after.norm())
    assert rec.metrics["emb_update/wte"] == pytest.approx(ratio, rel=1e-4)
    assert rec.metrics["emb_drift/wte"] == pytest.approx(float((after - w0).norm() / w0.norm()), rel=1e-4)


def test_nan_loss_and_grads_never_crash() -> None:
    model, opt, mon = make(config=MonitorConfig(clip=1.0, flush_every=2))
    for step, idx in mon.steps(batches(5)):
        loss = loss_of(model, idx)
        if step == 2:
            loss = loss * float("nan")
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
    mon.close()
    rec = mon.records[2]
    assert math.isnan(rec.metrics["loss"]) and math.isnan(rec.metrics[Metric.GRAD_NORM])
    assert rec.metrics[Metric.NONFINITE] == len(list(model.parameters()))
    assert mon.records[1].metrics[Metric.NONFINITE] == 0


# -- overrides and the skip guard -------------------------------------------------------------------------
def test_overrides_survive_the_scheduler() -> None:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    cfg = MonitorConfig(flush_every=1)
    mon = Monitor(model, opt, scheduler=sched, store=None, detectors=False, config=cfg)
    expected = [0.1 * (1 + math.cos(math.pi * s / 10)) / 2 for s in range(8)]
    for step, idx in mon.steps(batches(8)):
        if step == 3:
            mon.overrides.lr_scale, mon.overrides.beta2, mon.overrides.weight_decay = 0.5, 0.95, 0.0
        if step == 6:
            mon.overrides.lr_scale, mon.overrides.beta2, mon.overrides.weight_decay = 1.0, None, None
        loss = loss_of(model, idx)
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        scheduled = expected[step + 1] if step < 7 else sched.get_last_lr()[0]
        assert opt.param_groups[0]["lr"] == pytest.approx(scheduled)
        assert opt.param_groups[0]["betas"][1] == 0.999 and opt.param_groups[0]["weight_decay"] == 0.01
    mon.close()
    lrs = [r.metrics[Metric.LR] for r in mon.records]
    scale = [1, 1, 1, 0.5, 0.5, 0.5, 1, 1]
    assert lrs == pytest.approx([e * s for e, s in zip(expected, scale, strict=True)])
    assert [r.metrics[Metric.BETA2] for r in mon.records][2:5] == [0.999, 0.95, 0.95]
    assert [r.metrics[Metric.WEIGHT_DECAY] for r in mon.records][2:4] == [0.01, 0.0]


def test_skip_guard_flags_only_the_spike_and_keeps_learning() -> None:
    model, opt, mon = make(config=MonitorConfig(flush_every=1))
    mon.overrides.skip_factor = 3.0
    for step, idx in mon.steps(batches(8)):
        loss = loss_of(model, idx) * (100.0 if step == 6 else 1.0)
        loss.backward()
        mon.observe(loss=loss)
        before = model.head.weight.detach().clone()
        opt.step()
        opt.zero_grad()
        moved = not torch.equal(before, model.head.weight.detach())
        assert moved == (step != 6)
    mon.close()
    assert [r.metrics[Metric.SKIPPED] for r in mon.records] == [0, 0, 0, 0, 0, 0, 1, 0]
    grad = [r.metrics[Metric.GRAD_NORM] for r in mon.records]
    assert grad[6] > 3 * grad[5]


def test_skip_guard_restores_parameters_and_moments() -> None:
    model, opt, mon = make(config=MonitorConfig(flush_every=1))
    mon.overrides.skip_factor = 3.0
    for step, idx in mon.steps(batches(7)):
        loss = loss_of(model, idx) * (100.0 if step == 6 else 1.0)
        loss.backward()
        mon.observe(loss=loss)
        if step == 6:
            params = [p.detach().clone() for p in model.parameters()]
            moments = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    mon.close()
    assert mon.records[6].metrics[Metric.SKIPPED] == 1.0
    for p, old, m_old in zip(model.parameters(), params, moments, strict=True):
        torch.testing.assert_close(p.detach(), old, rtol=0, atol=0)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], m_old, rtol=0, atol=0)


def test_grad_scaler_overflow_is_recorded() -> None:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    mon = Monitor(
        model, opt, scaler=scaler, scheduler=sched, store=None, detectors=False, config=MonitorConfig(clip=1.0)
    )
    for step, idx in mon.steps(batches(5)):
        loss = loss_of(model, idx)
        scaler.scale(loss * (float("inf") if step == 2 else 1.0)).backward()
        mon.observe(loss=loss)
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    mon.close()
    recs = list(mon.records)
    assert [r.metrics[Metric.LR] for r in recs] == pytest.approx([0.1 / (1 + s) for s in range(5)])
    assert [r.metrics[Metric.OVERFLOW] for r in recs] == [0, 0, 1, 0, 0]
    assert [r.metrics[Metric.LOSS_SCALE] for r in recs] == [1024.0, 1024.0, 1024.0, 512.0, 512.0]
    assert Metric.GRAD_NORM not in recs[2].metrics
    # norms are of unscaled gradients: clipping at 1.0 would be meaningless otherwise
    assert recs[0].metrics[Metric.GRAD_NORM] < 100


# -- data position, state, stop ---------------------------------------------------------------------------
def test_state_dict_round_trip_and_resume_data_position() -> None:
    data = batches(10)
    model, opt, mon = make()
    mon.cursor.skip_range(3, 2)
    mon.overrides.max_norm = 0.7
    seen = train(mon, model, opt, data, max_steps=4)
    state = mon.state_dict()
    mon.close()
    assert seen == [0, 1, 2, 5]
    model2, opt2, mon2 = make()
    mon2.load_state_dict(state)
    assert mon2.state_dict()["data"] == state["data"] and mon2.step == 4 and mon2.overrides.max_norm == 0.7
    assert mon2.state_dict()["overrides"] == state["overrides"]
    seen2 = train(mon2, model2, opt2, data)
    mon2.close()
    assert seen2 == [6, 7, 8, 9]
    # the state held steps 0-3, taken before their flush: the resumed monitor's detectors see them first (with no
    # store to say the first monitor flushed them, they are not known to be stored)
    assert [r.step for r in mon2.records] == [0, 1, 2, 3, 4, 5, 6, 7]


def test_resume_from_a_checkpoint_continues_exactly(tmp_path: Any) -> None:
    data = batches(12)

    def run(until: int, ckpt: Any, resume: bool = False) -> tuple[Tiny, Monitor]:
        torch.manual_seed(0)
        model = Tiny()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        cfg = MonitorConfig(clip=0.5, checkpoint_every=6, hang_timeout=None)
        mon = Monitor(model, opt, scheduler=sched, store=None, detectors=False, config=cfg, checkpoint_dir=str(ckpt))
        if resume:
            _, state = mon.checkpoints.last_known_good()
            mon.load_training_state(state)
        for step, idx in mon.steps(data, max_steps=until):
            if step == 3:
                mon.overrides.lr_scale = 0.5
            loss = loss_of(model, idx)
            loss.backward()
            mon.observe(loss=loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        mon.close()
        return model, mon

    straight, _ = run(12, tmp_path / "a")
    run(8, tmp_path / "b")  # checkpoint at step 6, then the process "dies" at step 8
    resumed, mon = run(12, tmp_path / "b", resume=True)
    assert mon.overrides.lr_scale == 0.5  # set before the checkpoint, restored from it
    # the checkpoint of step 6 held steps 0-5, written before their flush: the resume flushes them first
    assert [r.step for r in mon.records] == list(range(12))
    assert [r.batch_index for r in mon.records] == list(range(12))
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_leaving_the_loop_early_records_only_real_steps() -> None:
    model, opt, mon = make(config=MonitorConfig(flush_every=3))
    for step, idx in mon.steps(batches(10)):
        if step == 4:
            break  # before training on this batch: not a step
        loss = loss_of(model, idx)
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
    for step, idx in mon.steps(batches(10)[5:]):
        loss = loss_of(model, idx)
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
        if step == 6:
            break  # after the update: step 6 happened
    mon.close()
    assert [r.step for r in mon.records] == list(range(7))
    assert all("loss" in r.metrics and "grad_norm" in r.metrics for r in mon.records)


def test_epochs_continue_the_index_and_never_yield_skipped() -> None:
    model, opt, mon = make()
    mon.cursor.skip_range(4, 3)
    seen = train(mon, model, opt, batches(5), epochs=2)
    mon.close()
    assert seen == [0, 1, 2, 3, 7, 8, 9]


def test_checkpoint_and_stop_and_kill_switch(tmp_path: Any) -> None:
    from stabmon.checkpoints import STOP_EXIT_CODE

    switch = tmp_path / "STOP"
    model, opt, mon = make(
        config=MonitorConfig(flush_every=2, kill_switch=str(switch)), checkpoint_dir=str(tmp_path / "ckpt")
    )
    for step, idx in mon.steps(batches(20)):
        if step == 5:
            switch.write_text("maintenance")
        loss = loss_of(model, idx)
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
    mon.close()
    assert mon.should_stop and mon.exit_code == STOP_EXIT_CODE and mon.step == 6
    assert "maintenance" in (mon.stop_reason or "")
    assert [c.step for c in mon.checkpoints.checkpoints] == [0, 6]  # the initial state (default cadence), the stop


def test_rollback_restores_last_known_good_and_skips_batches(tmp_path: Any) -> None:
    data = batches(30)
    model, opt, mon = make(config=MonitorConfig(checkpoint_every=5), checkpoint_dir=str(tmp_path))
    weights_at = {}
    seen = []
    result = None
    for step, idx in mon.steps(data):
        seen.append((step, mon.buffer._current.batch_index))  # type: ignore[union-attr]
        weights_at.setdefault(step, model.head.weight.detach().clone())
        loss = loss_of(model, idx)
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
        if step == 13 and result is None:
            mon.end_step()  # as the monitor does before a flush-time decision
            result = mon.rollback(onset_step=12, lookback=2, skip_batches=3)
            torch.testing.assert_close(model.head.weight.detach(), weights_at[10])
        if mon.step >= 16 and result is not None:
            break
    mon.close()
    assert result is not None
    assert result["checkpoint_step"] == 10 and result["restored_step"] == 10 and result["skipped"] == [10, 13]
    after = [s for s in seen if s[0] >= 10][4:]
    assert after[:3] == [(10, 13), (11, 14), (12, 15)]
    assert 10 not in {b for _, b in seen[14:]}


def test_rollback_in_a_hand_written_loop_skips_nothing_and_says_so(tmp_path: Any) -> None:
    # a loop that samples its own batches (nanoGPT's get_batch) never draws through monitor.steps():
    # a skip would name batch indices that mean nothing to it
    data = batches(30)
    model, opt, mon = make(config=MonitorConfig(checkpoint_every=5), checkpoint_dir=str(tmp_path))
    for i in range(14):
        mon.begin_step()
        loss = loss_of(model, data[i])
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
        mon.end_step()
    result = mon.rollback(onset_step=12, lookback=2, skip_batches=3)
    mon.close()
    assert result["checkpoint_step"] == 10 and result["skipped"][0] == result["skipped"][1]
    assert result["skip_not_applied"] == "the loop does not draw its batches through monitor.steps()"
    assert not result["rewound_data"]


# -- sinks and pipeline -----------------------------------------------------------------------------------
class MemorySink:
    """Test double of stabmon.sinks.Sink that keeps everything in lists (optionally failing)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.steps: list[StepRecord] = []
        self.events: list[Any] = []
        self.ended: list[str] = []
        self.answers: list[tuple[str, bool]] = []
        self.skipped: list[tuple[int, list[int]]] = []

    def start_run(
        self,
        *,
        name: str,
        kind: str = "live",
        config: Any = None,
        environment: Any = None,
        resume_run_id: str | None = None,
    ) -> str:
        return "run-1"

    def write_steps(self, *, run_id: str, records: Any) -> None:
        if self.fail:
            raise OSError("database went away")
        self.steps.extend(records)

    def write_events(self, *, run_id: str, events: Any) -> None:
        self.events.extend(events)

    def write_checkpoint(self, **kw: Any) -> None:
        pass

    def write_skipped_batches(self, *, run_id: str, step: int, batch_indices: Any) -> None:
        self.skipped.append((step, list(batch_indices)))

    def poll_answers(self, *, run_id: str) -> list[tuple[str, bool]]:
        out, self.answers = self.answers, []
        return out

    def end_run(self, *, run_id: str, status: str) -> None:
        self.ended.append(status)

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        pass


def test_sink_receives_every_step_and_failures_never_reach_training() -> None:
    sink = MemorySink()
    model, opt, mon = make(store=sink, config=MonitorConfig(flush_every=4))
    train(mon, model, opt, batches(10))
    mon.close()
    assert [r.step for r in sink.steps] == list(range(10)) and sink.ended == ["finished"]
    bad = MemorySink(fail=True)
    model, opt, mon = make(store=bad, config=MonitorConfig(flush_every=4))
    train(mon, model, opt, batches(10))
    mon.close()
    assert mon.errors["store"] == 3 and mon.step == 10


class SpikeDetectors:
    """Test double: flags every loss above 1e3, finds nothing else."""

    def __init__(self) -> None:
        self.graces = 0

    def update(self, record: StepRecord) -> list[Any]:
        from stabmon.events import Anomaly, Severity

        v = record.get("loss")
        if v is None or v < 1e3:
            return []
        return [
            Anomaly(
                kind="spike",
                metric="loss",
                step=record.step,
                score=v,
                severity=Severity.ERROR,
                detector="test",
            )
        ]

    def enter_grace(self, steps: int | None = None) -> None:
        self.graces += 1

    def state_dict(self) -> dict[str, Any]:
        return {"graces": self.graces}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.graces = state["graces"]


class ClipEngine:
    """Test double of the runbook engine: answers each anomaly with one set_clip decision."""

    def __init__(self, status: Any) -> None:
        self.status = status
        self.applied_records: list[Any] = []
        self.anomaly_id: str | None = None

    def process(self, record: StepRecord, anomalies: Any) -> list[Any]:
        from stabmon.events import Decision

        if anomalies:
            self.anomaly_id = anomalies[0].id
        return [
            Decision(
                step=record.step,
                action="set_clip",
                params={"max_norm": 0.25},
                status=self.status,
                runbook="test",
                rule="spike",
                rung=0,
                reason="spike",
                anomaly_id=a.id,
                id="d1",
            )
            for a in anomalies
        ]

    def answer(self, decision_id: str, approved: bool, step: int) -> list[Any]:
        from stabmon.events import Decision, DecisionStatus

        ok = DecisionStatus.APPROVED
        return [
            Decision(
                step=step,
                action="set_clip",
                params={"max_norm": 0.25},
                status=ok,
                runbook="test",
                rule="spike",
                rung=0,
                reason="approved",
                anomaly_id=self.anomaly_id,  # the same decision, answered: one id names one event
                id=decision_id,
            )
        ]

    def applied(self, decision: Any, record: Any) -> None:
        self.applied_records.append(record)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class FakeNotifier:
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def handle(self, *, run_id: str, run_name: str, events: Any) -> None:
        self.seen.extend(events)

    def close(self, timeout: float | None = None) -> None:
        pass


@pytest.mark.parametrize("mode", ["apply", "propose"])
def test_decisions_flow_through_executor_store_and_notifier(mode: str) -> None:
    from stabmon.events import Anomaly, Decision, DecisionStatus, InterventionRecord

    status = DecisionStatus.APPLY if mode == "apply" else DecisionStatus.PROPOSED
    sink, notifier, engine = MemorySink(), FakeNotifier(), ClipEngine(status)
    model, opt, mon = make(
        store=sink,
        notifier=notifier,
        detectors=SpikeDetectors(),
        runbook=engine,
        mode=mode,
        config=MonitorConfig(flush_every=2),
    )
    for step, idx in mon.steps(batches(8)):
        loss = loss_of(model, idx) * (1e6 if step == 2 else 1.0)
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
        if mode == "propose" and step == 4:
            sink.answers.append(("d1", True))
    mon.close()
    assert [type(e) for e in sink.events][:2] == [Anomaly, Decision]
    assert any(isinstance(e, InterventionRecord) for e in sink.events)
    assert mon.overrides.max_norm == 0.25 and mon.records[-1].metrics[Metric.CLIP] == 0.25
    assert len(mon.anomalies) == 1 and notifier.seen == sink.events
    first_clipped = 4 if mode == "apply" else 6
    assert [r.metrics[Metric.CLIP] for r in mon.records].index(0.25) == first_clipped


# -- bad input --------------------------------------------------------------------------------------------
def test_bad_input_is_one_line_naming_the_argument(tmp_path: Any) -> None:
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cases = [
        (dict(config=MonitorConfig(grads=GradConfig(layers=("nope\\.\\d+",)))), "config.grads.layers"),
        (
            dict(config=MonitorConfig(activations=ActivationConfig(modules=("blocks\\.9",)))),
            "config.activations.modules",
        ),
        (dict(mode="yolo"), "mode:"),
        (dict(store=f"sqlite:///{blocker}/x.db"), "store:"),
        (dict(store="nosuchdb://x"), "store:"),
        (dict(store=3.5), "store:"),
        (dict(notifier=object()), "notifier:"),
        (dict(detectors=42), "detectors:"),
    ]
    for kwargs, needle in cases:
        kwargs.setdefault("store", None)
        with pytest.raises(ValueError) as err:
            Monitor(model, opt, **kwargs)
        assert needle in str(err.value) and "\n" not in str(err.value), (kwargs, str(err.value))
    with pytest.raises(ValueError, match="^model: has no parameters"):
        Monitor(nn.ReLU(), opt, store=None)
    with pytest.raises(ValueError, match="^optimizer: holds none of the model's parameters"):
        Monitor(Tiny(), opt, store=None)
    mon = Monitor(model, opt, store=None, detectors=False)
    with pytest.raises(ValueError, match="^observe: loss must hold exactly one value"):
        mon.observe(loss=torch.ones(3))
    mon.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(flush_every=0), "config.flush_every must be >= 1, got 0"),
        (dict(clip=-1.0), "config.clip must be > 0 or None, got -1.0"),
        (dict(grads=GradConfig(skip_ema=1.0)), "config.grads.skip_ema must be in (0, 1), got 1.0"),
        (dict(activations=ActivationConfig(every=-1)), "config.activations.every must be >= 0, got -1"),
        (dict(embeddings=EmbeddingConfig(every=-2)), "config.embeddings.every must be >= 0, got -2"),
        (dict(checkpoint_every=-1), "config.checkpoint_every must be >= 0, got -1"),
        (dict(exit_code=300), "config.exit_code must be in [0, 255], got 300"),
        (dict(checkpoint_keep=0), "config.checkpoint_keep must be >= 1, got 0"),
        (dict(hang_timeout=0.0), "config.hang_timeout must be > 0 or None, got 0.0"),
        (dict(history=-1), "config.history must be >= 0, got -1"),
        (dict(diagnose=DiagnoseConfig(timeout=0)), "config.diagnose.timeout must be > 0 seconds, got 0"),
        (dict(diagnose=DiagnoseConfig(max_bytes=0)),
         "config.diagnose.max_bytes must be >= 1 (or None: no bound), got 0"),
    ],
)
def test_config_errors_name_the_dotted_path(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as err:
        MonitorConfig(**kwargs)
    assert str(err.value) == message


def test_config_round_trips_through_a_dict() -> None:
    cfg = MonitorConfig(clip=2.0, grads=GradConfig(layers=("a",)), activations=ActivationConfig(every=3))
    assert MonitorConfig.from_dict(cfg.to_dict()) == cfg


def test_hang_watchdog_publishes_at_once() -> None:
    import time

    sink = MemorySink()
    model, opt, mon = make(store=sink, config=MonitorConfig(hang_timeout=0.5))

    def hung_after_last_step() -> bool:
        return any(a.kind == "hang" and a.step == 1 for a in mon.anomalies)

    for step, idx in mon.steps(batches(3)):
        if step == 2:  # training "hangs" inside its third step: no step arrives (after the loop, none would be one)
            deadline = time.monotonic() + 20
            while not hung_after_last_step() and time.monotonic() < deadline:
                time.sleep(0.05)
            break
        loss_of(model, idx).backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    assert hung_after_last_step()  # (a slow step on a loaded machine may add an earlier one)
    assert any(getattr(e, "kind", None) == "hang" and e.step == 1 for e in sink.events)


# -- what training frameworks call ------------------------------------------------------------------------
def test_the_optimizer_step_driven_by_public_calls_matches_the_hooks() -> None:
    """A framework that runs backward inside optimizer.step(closure) takes the hooks off and calls
    before_optimizer_step / after_optimizer_step itself: same clipping, overrides and records."""
    runs = []
    for manual in (False, True):
        model, opt, mon = make(config=MonitorConfig(clip=0.5, flush_every=4))
        mon.overrides.lr_scale = 0.5
        if manual:
            mon.remove_optimizer_hooks()
        for _, idx in mon.steps(batches(8)):
            loss = loss_of(model, idx)
            loss.backward()
            mon.observe(loss=loss)
            if manual:
                mon.before_optimizer_step()
            opt.step()
            if manual:
                mon.after_optimizer_step()
            opt.zero_grad()
        mon.close()
        assert opt.param_groups[0]["lr"] == 0.1  # the override never leaks into what a scheduler sees
        from stabmon.diff import TIMING

        clock = set(TIMING)  # times: they differ run to run
        timeless = [{k: v for k, v in r.metrics.items() if k not in clock} for r in mon.records]
        runs.append((timeless, [p.detach().clone() for p in model.parameters()]))
    (hooked, hooked_params), (manual, manual_params) = runs
    assert manual == hooked and all(torch.equal(a, b) for a, b in zip(hooked_params, manual_params, strict=True))
    assert hooked[0][Metric.GRAD_NORM] > 0.5 and hooked[0]["lr"] == 0.05


def test_an_optimizer_step_skipped_after_the_pre_step_work_records_an_overflow() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    model, opt, mon = make(scaler=scaler)
    mon.remove_optimizer_hooks()
    before = [p.detach().clone() for p in model.parameters()]
    for _, idx in mon.steps(batches(1)):
        scaler.scale(loss_of(model, idx)).backward()
        mon.before_optimizer_step()
        mon.after_optimizer_step(skipped=True)  # the update never happened (as a GradScaler overflow)
        opt.zero_grad()
    mon.close()
    assert mon.records[0].metrics[Metric.OVERFLOW] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_sync_step_follows_the_framework_and_refuses_bad_steps() -> None:
    model, opt, mon = make()
    mon.sync_step(7)
    train(mon, model, opt, batches(2))
    for bad, message in ((-1, "got -1"), (2.5, "got float"), ("3", "got str")):
        with pytest.raises(ValueError, match=rf"^sync_step: step must be an integer >= 0, {message}$"):
            mon.sync_step(bad)  # type: ignore[arg-type]
    mon.close()
    assert mon.step == 9 and [r.step for r in mon.records] == [7, 8]
