"""First, do no harm, on the runs people actually have: fine-tunes logged by the Hugging Face Trainer.

- Real records: every healthy run of ``real-finetunes`` (40 public ``trainer_state.json`` files) and of
  ``real-runs``, replayed through the ``default`` runbook, gets no change to training and no page; the labelled
  incidents are still alerted on.
- A live run: a tiny GPT pre-trained here, then fine-tuned at a low LR (its loss barely moves) and at a
  moderate one, monitored in apply mode with the ``default`` runbook and a real alert channel: nothing changes
  training and nothing is sent.
- A replayed synthetic fp16 run whose loss falls with a 600-step time constant: not "not learning".
"""

from __future__ import annotations

import math
import os
import random
import statistics
from pathlib import Path
from typing import Any

import pytest
from test_alerts_support import Receiver

from stabmon.events import Anomaly, Decision, InterventionRecord, Metric, Severity, StepRecord
from stabmon.replay.eval import evaluate
from stabmon.replay.replay import replay, simulated_pipeline


def _healthy_changes_and_pages(labels: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    report = evaluate(labels, peers=False)
    return report.summary["stabmon"], [r for r in report.files if r["method"] == "stabmon"]


@pytest.mark.slow
@pytest.mark.parametrize("corpus", ["real_finetunes", "real_runs"])
def test_no_healthy_real_run_is_changed_or_paged(corpus: str, request: pytest.FixtureRequest) -> None:
    base: Path = request.getfixturevalue(corpus)
    summary, runs = _healthy_changes_and_pages(base / "LABELS.csv")
    healthy = [r for r in runs if r["healthy"]]
    assert healthy and not [r for r in runs if r["error"]]
    assert summary["healthy_runs_changed"] == 0, [(r["file"], r["intervention_decisions"]) for r in healthy
                                                  if r["intervention_decisions"]]
    assert summary["healthy_sent_pagerduty_per_10k"] == 0.0
    # Slack (warnings) on healthy runs: a guard against the noise coming back (it was 480 episodes per 10k
    # logged steps on real-finetunes before the detectors learned the sampling and the noise of a run)
    assert summary["healthy_sent_slack_per_10k"] < 5.0


@pytest.mark.slow
def test_labelled_fine_tune_incidents_are_still_alerted(real_finetunes: Path) -> None:
    report = evaluate(real_finetunes / "LABELS.csv", peers=True)
    recall = {m: s["recall"] for m, s in report.summary.items()}
    assert recall["stabmon"] >= max(v for m, v in recall.items() if m != "stabmon")


SEED = int(os.environ.get("STABMON_TEST_SEED", "3"))
THREADS = int(os.environ.get("STABMON_TEST_THREADS", "1"))


def _records(n: int, loss: Any, *, every: int = 1, seed: int = 0, fp16: bool = False) -> list[StepRecord]:
    rng = random.Random(seed)
    out = []
    for step in range(0, n, every):
        metrics = {Metric.LOSS: loss(step) * math.exp(rng.gauss(0, 0.02)),
                   Metric.GRAD_NORM: 0.8 * math.exp(rng.gauss(0, 0.1)), Metric.LR: 1e-4}
        if fp16:
            metrics[Metric.LOSS_SCALE] = 65536.0
            metrics[Metric.OVERFLOW] = 0.0
        out.append(StepRecord(step, metrics))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("every", [1, 10])
def test_slow_healthy_fp16_run_is_not_not_learning(seed: int, every: int) -> None:
    # the loss falls with a 600-step time constant: 3% by step 100; per step or logged every 10 steps
    records = _records(1500, lambda s: 2.0 + 1.0 * math.exp(-s / 600), every=every, seed=seed, fp16=True)
    result = replay(records, pipeline=simulated_pipeline(runbook="default")[0])
    loud = [e for e in result.events if isinstance(e, Anomaly) and e.severity >= Severity.WARNING]
    decisions = [e for e in result.events if isinstance(e, Decision)]
    assert not loud and not decisions, (loud[:3], decisions[:3])
    quiet = [e for e in result.events if isinstance(e, Anomaly) and e.kind == "no_progress"]
    assert all(a.severity is Severity.INFO for a in quiet)  # "not learning", but nothing says damage


def _tiny_gpt() -> Any:
    from stabmon.cli.demo import load_example

    return load_example("tiny_gpt")


def _pretrain(tiny: Any, seed: int) -> Any:
    import torch

    config = tiny.TrainConfig(steps=300, block_size=32, n_embd=48, warmup=30, seed=seed, threads=THREADS)
    model, opt, sched, batches = tiny.build(config)
    for step, (x, y) in enumerate(batches):
        if step >= config.steps:
            break
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("lr", [1e-5, 3e-4])
def test_pretrained_model_fine_tuned_live_is_left_alone_and_nobody_is_messaged(lr: float, tmp_path: Path) -> None:
    import torch

    from stabmon import Monitor, MonitorConfig

    tiny = _tiny_gpt()
    model = _pretrain(tiny, seed=SEED)
    # fine-tune on text drawn with another seed: the same language, new examples
    config = tiny.TrainConfig(steps=300, block_size=32, n_embd=48, seed=SEED + 8, lr=lr, warmup=10)
    batches = tiny.Batches(tiny.make_corpus(config.corpus_chars, config.seed), config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, tiny.lr_lambda(config))
    receiver = Receiver()
    losses: list[torch.Tensor] = []
    try:
        with Monitor(model, opt, scheduler=sched, store=f"sqlite:///{tmp_path / 'ft.db'}", runbook="default",
                     mode="apply", alerts=[f"json://{receiver.netloc}/ft"], config=MonitorConfig(clip=1.0),
                     checkpoint_dir=tmp_path / "ckpt", run_name=f"finetune-lr{lr:g}") as monitor:
            for _step, (x, y) in monitor.steps(batches, max_steps=config.steps):
                loss = model(x, y)
                loss.backward()
                monitor.observe(loss=loss)
                losses.append(loss.detach())
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            events = list(monitor.events)
            assert monitor.notifier is not None and monitor.notifier.flush(20)
    finally:
        receiver.close()
    values = torch.stack(losses).tolist()
    first, last = statistics.median(values[:20]), statistics.median(values[-20:])
    if lr == 1e-5:
        assert abs(last / first - 1) < 0.05  # the setting the issue names: the loss barely moves
    changes = [e for e in events if isinstance(e, InterventionRecord) and e.action != "alert_only"]
    decisions = [e for e in events if isinstance(e, Decision)]
    loud = [e for e in events if isinstance(e, Anomaly) and e.severity >= Severity.WARNING
            and e.kind not in {"step_time", "straggler"}]  # timing on a shared CPU is not the model's doing
    assert not changes and not [d for d in decisions if d.action != "alert_only"], decisions[:3]
    assert not loud, loud[:3]
    assert not [r for r in receiver.requests if b"step_time" not in r["body"]], receiver.requests[:2]
