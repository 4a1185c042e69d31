"""Runs wrecked where the spike detectors cannot see, and healthy runs that must stay quiet.

- A learning rate far past the edge with no warm-up (the tiny char-level GPT of examples/tiny_gpt.py at LR 1e-1,
  warm-up 0, the scenarios' BASE otherwise): the loss blows up within the first 1-4 steps, inside every spike
  detector's grace period, then settles on a plateau the damaged run never leaves. The sweep (300 steps, 1
  thread, unmonitored; held-out loss; peak of the first 5 losses over the first):

  ====  ===========  ========  =====  ====  ===========  ========  =====
  seed  healthy val  1e-1 val  peak   seed  healthy val  1e-1 val  peak
  ====  ===========  ========  =====  ====  ===========  ========  =====
  1     1.612        1.952     1.70x  22    -            2.029     1.37x
  2     1.628        2.256     1.52x  23    -            2.154     1.79x
  3     1.626        2.109     1.59x  24    -            2.176     2.01x
  4     1.610        2.240     1.60x  25    -            2.163     1.37x
  5     1.624        2.273     2.06x  26    -            2.232     1.56x
  6     1.607        2.271     1.84x  27-29 -            2.08-2.15 1.54-1.70x
  ====  ===========  ========  =====  ====  ===========  ========  =====

  Every seed ends 20-40% worse than a healthy run (1.61-1.63), and every seed's loss passes 1.37x its first
  value within 4 steps, past the ``no_progress`` ceiling (1.2x): an ``error`` incident opens at once.
- A Hugging Face ``Trainer`` on a tiny GPT-2 at LR 1e-1: wrecked in its first steps, it still learns the
  character frequencies (28% below the untrained loss) and sits there with a dead gradient; on 3 of 12 seeds
  its blow-up stays under the ceiling. ``no_progress``'s stall judgement reports all 12 at step 29-44 (the
  sweep is in docs/detectors.md); its LR 1e-3 twin stays quiet.
- A loss logged every 10 steps that jumps 1.5x and stays there after a steep early learning curve: the curve
  inflates the spread the spike detectors measure, so the regression detector (counted in records and steps)
  reports it within 7 records.
"""

from __future__ import annotations

import math
import os
import random
from functools import cache
from types import ModuleType
from typing import Any

import pytest

from stabmon.cli.demo import load_example
from stabmon.detect import DetectorSuite
from stabmon.events import Metric, Severity, StepRecord

FIRST = int(os.environ.get("STABMON_TEST_SEED", "21"))
THREADS = int(os.environ.get("STABMON_TEST_THREADS", "1"))
# a shared CPU's step time measures the machine, not the run: left out of what must stay quiet here
QUIET = ["step_time.enabled=false"]


@cache
def scenarios() -> ModuleType:
    return load_example("scenarios")


class Events:
    """Sink double: keeps the anomalies a live monitor reports."""

    def __init__(self) -> None:
        self.anomalies: list[Any] = []

    def handle(self, *, run_id: str, run_name: str, events: Any) -> None:
        self.anomalies += [e for e in events if type(e).__name__ == "Anomaly"]

    def close(self, timeout: float | None = None) -> None:
        pass


def _train(seed: int, **changes: Any) -> tuple[Any, list[Any]]:
    from stabmon import Monitor

    sc = scenarios()
    events = Events()

    def factory(model: Any, opt: Any, sched: Any, scaler: Any = None) -> Monitor:
        return Monitor(model, opt, scheduler=sched, scaler=scaler, store=None, runbook=None, mode="observe",
                       notifier=events, detectors={"step_time": {"enabled": False}})

    config = sc.tiny_gpt.TrainConfig(**{**sc.BASE, **changes}, seed=seed, threads=THREADS)
    return sc.tiny_gpt.train(config, monitor=factory), events.anomalies


@pytest.mark.slow
@pytest.mark.parametrize("seed", [FIRST, FIRST + 1])
def test_lr_far_too_high_without_warmup_opens_an_error_within_50_steps(seed: int) -> None:
    result, anomalies = _train(seed, lr=0.1, warmup=0)
    healthy, quiet = _train(seed)
    assert result.val_loss > 1.1 * healthy.val_loss  # damaged, as on every seed of the sweep
    errors = [a for a in anomalies if a.severity >= Severity.ERROR]
    assert errors and errors[0].step <= 50 and errors[0].kind == "no_progress", anomalies
    # the healthy twin: nothing anyone would be sent (info anomalies are allowed: they are for the trace)
    assert not [a for a in quiet if a.severity >= Severity.WARNING], quiet


@pytest.mark.slow
@pytest.mark.parametrize("seed", [FIRST, FIRST + 1])
def test_lr_far_too_high_after_a_warmup_is_judged_at_step_50_when_the_weights_thrash(seed: int) -> None:
    """lr-too-high (a 30-step warm-up to 100x the stable peak): the loss never goes below the frequency baseline
    and the weights move 3-6% of their norm a step (the update ratios the monitor samples by default with AdamW,
    every 20 steps). Not learning while thrashing is judged at step 50, not only at 100; the healthy twin moves
    0.3-0.5% a step and is never judged."""
    sc = scenarios()
    wrecked, anomalies = _train(seed, **sc.scenario("lr-too-high").changes)
    healthy, quiet = _train(seed)
    assert wrecked.val_loss > 1.1 * healthy.val_loss
    errors = [a for a in anomalies if a.severity >= Severity.ERROR and a.kind == "no_progress"]
    assert errors and 50 <= errors[0].step <= 60 and "of their norm per step" in errors[0].message, errors
    assert len(errors) == 1, errors  # judged once: not again at step 100
    assert not [a for a in quiet if a.kind == "no_progress" and a.severity >= Severity.WARNING], quiet


@pytest.mark.slow
def test_nanogpt_style_loop_at_lr_1e_1_is_flagged_and_at_3e_3_is_quiet() -> None:
    """A hand-written loop in nanoGPT's train.py shape (AdamW, constant LR, clip 1.0, the monitor owning the
    step counter), on the tiny GPT model and its character corpus."""
    import torch

    from stabmon import Monitor

    tg = scenarios().tiny_gpt
    torch.set_num_threads(THREADS)

    def run(lr: float) -> list[Any]:
        config = tg.TrainConfig(**{**scenarios().BASE, "steps": 80}, seed=FIRST + 7, threads=THREADS)
        model, _, _, batches = tg.build(config)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
        events = Events()
        mon = Monitor(model, opt, store=None, runbook=None, mode="observe", notifier=events,
                      detectors={"step_time": {"enabled": False}})
        for _step, (x, y) in mon.steps(batches, max_steps=80):
            loss = model(x, y)
            loss.backward()
            mon.observe(loss=loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
        mon.close()
        return events.anomalies

    wrecked = [a for a in run(0.1) if a.severity >= Severity.ERROR]
    assert wrecked and wrecked[0].step <= 50, wrecked
    assert not [a for a in run(3e-4) if a.severity >= Severity.WARNING]


def _steep_then_jump(seed: int, jump_at: int) -> list[StepRecord]:
    """A loss logged every 10 steps: 6 -> 2 over the first 500 steps, then 1.5x from ``jump_at`` on."""
    rng = random.Random(seed)
    out = []
    for step in range(0, 1500, 10):
        loss = 2.0 + 4.0 * math.exp(-step / 120) + rng.gauss(0.0, 0.02)
        out.append(StepRecord(step, {Metric.LOSS: loss * (1.5 if step >= jump_at else 1.0),
                                     Metric.GRAD_NORM: 1.0 + rng.random() * 0.1}))
    return out


@pytest.mark.parametrize("seed", [FIRST, FIRST + 1, FIRST + 2])
def test_loss_jump_logged_every_10_steps_opens_an_error_within_7_records(seed: int) -> None:
    # windows count records as well as steps: the regression's median of 12 records is up once 6 of them are,
    # and its patience is 6 records; a per-step log would be judged on 20 steps
    suite = DetectorSuite.from_config(overrides=QUIET)
    found = [a for r in _steep_then_jump(seed, 700) for a in suite.update(r)]
    errors = [a for a in found if a.severity >= Severity.ERROR]
    assert errors and 700 <= errors[0].step <= 770, found
    assert not [a for a in found if a.step < 700 and a.severity >= Severity.WARNING]
    # and the same curve without the jump is quiet
    calm = DetectorSuite.from_config(overrides=QUIET)
    assert not [a for r in _steep_then_jump(seed, 10**9) for a in calm.update(r) if a.severity >= Severity.WARNING]


# -- a Hugging Face Trainer at LR 1e-1 ------------------------------------------------------------------------
WORDS = (
    "the of and to a in is it you that he was for on are with as his they be at one have this from or had by not "
    "word but what some we can out other were all there when up use your how said an each she which do their time "
    "if will way about many then them write would like so these her long make thing see him two has look more day "
    "could go come did number sound no most people my over know water than call first who may down side been now"
).split()


def word_corpus(n_chars: int, seed: int) -> str:
    """Sentences of words drawn with Zipf frequencies: about 40 characters whose frequencies alone (the unigram
    entropy, 2.74 nats) take the loss 28% below an untrained model's ln(40); a model that learns words goes far
    below that."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(len(WORDS))]
    parts: list[str] = []
    while sum(map(len, parts)) < n_chars:
        words = " ".join(rng.choices(WORDS, weights, k=rng.randint(4, 12)))
        parts.append(words[0].upper() + words[1:] + rng.choice([". ", ". ", "? ", ", "]))
    return "".join(parts)[:n_chars]


def hf_train(lr: float, seed: int, steps: int = 60, seq: int = 64) -> tuple[list[Any], list[Any]]:
    """A real ``transformers.Trainer`` on a tiny random-init GPT-2 over :func:`word_corpus` (character-level,
    nothing downloaded): AdamW at a constant ``lr`` with no warm-up and the Trainer's default clip 1.0. Returns
    the monitor's records and the anomalies it reported."""
    import tempfile

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from stabmon.integrations.hf import StabmonCallback
    from stabmon.monitor import MonitorConfig

    torch.set_num_threads(THREADS)
    text = word_corpus(100_000, seed)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    starts = torch.randint(0, len(data) - seq, (steps * 16,), generator=torch.Generator().manual_seed(seed))
    rows = [{"input_ids": data[s:s + seq], "labels": data[s:s + seq].clone()} for s in starts.tolist()]
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(chars), n_positions=seq, n_embd=48, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    events = Events()
    callback = StabmonCallback(store=None, runbook=None, mode="observe", notifier=events,
                               detectors={"step_time": {"enabled": False}},
                               config=MonitorConfig(flush_every=10, hang_timeout=None))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=16, learning_rate=lr,
                                 lr_scheduler_type="constant", warmup_steps=0, logging_steps=10**6,
                                 save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=seed,
                                 dataloader_num_workers=0)
        Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback]).train()
    return list(callback.monitor.records), events.anomalies


def _median_loss(records: list[Any], last: int = 10) -> float:
    return sorted(r.get(Metric.LOSS) for r in records[-last:])[last // 2]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [FIRST, FIRST + 1])
def test_hf_trainer_at_lr_1e_1_opens_an_error_within_50_steps_and_its_healthy_twin_is_quiet(seed: int) -> None:
    """Wrecked in its first steps, the run still learns the character frequencies (its loss falls 28%, so
    "not learning by step 100" would pass it) and then sits there with a dead gradient: the ``no_progress``
    stall judgement reports it, whether or not the first steps' blow-up crossed the ceiling."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    records, anomalies = hf_train(0.1, seed)
    healthy, quiet = hf_train(1e-3, seed)
    first = records[0].get(Metric.LOSS)
    assert _median_loss(records) < 0.9 * first  # it learned something: more than no_progress's 10%
    assert _median_loss(records) > 1.1 * _median_loss(healthy)  # and it is damaged
    errors = [a for a in anomalies if a.severity >= Severity.ERROR]
    assert errors and errors[0].step <= 50, anomalies  # the damage is done from step 1
    stalled = [a for a in errors if a.kind == "no_progress" and "stopped falling" in a.message]
    assert stalled and stalled[0].step <= 50 and stalled[0].score >= stalled[0].threshold, errors
    assert not [a for a in quiet if a.severity >= Severity.WARNING], quiet
