"""The data screen on the real ``transformers.Trainer``, with a resume inside its window.

A new user's script: the documented callback, the ``default`` runbook, an ordered dataset (an iterable one: the
Trainer does not shuffle it) whose batches 150-209 are random tokens (a corrupted shard; the other rows follow a
pattern the model learns, so a bad batch's loss is far above a clean one's on every seed). The default runbook
diagnoses the spike as ``data`` and rolls back with a screen: the rest of the shard has its updates discarded on the
device, the clean batches train. The Trainer saves at step 200, inside the screen's window; a second Trainer resumed
from that checkpoint screens the shard's last batches too (the screen is in the monitor's saved state).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402

from stabmon.collect.config import MonitorConfig  # noqa: E402
from stabmon.events import InterventionRecord, Metric  # noqa: E402
from stabmon.integrations.hf import StabmonCallback  # noqa: E402

VOCAB, SEQ, BATCH, STEPS, SAVE = 32, 16, 8, 300, 200
BAD = range(150, 210)  # batch indices of the corrupted shard
SEED = int(os.environ.get("STABMON_TEST_SEED", "0"))
THREADS = int(os.environ.get("STABMON_TEST_THREADS", "0"))


class Rows(torch.utils.data.IterableDataset):
    """Rows in order: batch ``b`` is rows ``b * BATCH`` to ``(b + 1) * BATCH - 1``; the shard's are random tokens."""

    def __init__(self, bad: range) -> None:
        self.bad = bad

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(SEED)
        for i in range(STEPS * BATCH):
            if i // BATCH in self.bad:
                ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
            else:  # a pattern with a fifth of its tokens noise: the loss has a floor a rescued run reaches again
                ids = (torch.arange(SEQ) * 3 + int(torch.randint(0, VOCAB, (1,), generator=g))) % VOCAB
                noise = torch.rand(SEQ, generator=g) < 0.2
                ids = torch.where(noise, torch.randint(0, VOCAB, (SEQ,), generator=g), ids)
            yield {"input_ids": ids, "labels": ids.clone()}


def _trainer(tmp: Path, cb: Any, *, bad: range, resume: bool = False) -> Any:
    if THREADS:
        torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)
    args = transformers.TrainingArguments(
        output_dir=str(tmp / "out"), per_device_train_batch_size=BATCH, learning_rate=3e-3, max_steps=STEPS,
        logging_steps=10, save_strategy="steps", save_steps=SAVE, report_to=[], use_cpu=True, disable_tqdm=True,
        seed=SEED, dataloader_num_workers=0)
    callbacks = [cb] if cb is not None else []
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=args, train_dataset=Rows(bad),
                                   callbacks=callbacks)
    trainer.train(resume_from_checkpoint=str(tmp / "out" / f"checkpoint-{SAVE}") if resume else None)
    return trainer


def _callback(tmp: Path) -> StabmonCallback:
    return StabmonCallback(store=f"sqlite:///{tmp / 'stabmon.db'}", runbook="default", mode="apply",
                           checkpoint_dir=str(tmp / "ckpt"),
                           config=MonitorConfig(checkpoint_every=25, checkpoint_keep=6))


def _last_loss(trainer: Any) -> float:
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return sum(losses[-3:]) / 3


def _discarded(cb: StabmonCallback) -> set[int]:
    kept = {r.step: r for r in cb.monitor.records}
    return {s for s, r in kept.items() if r.get(Metric.SKIPPED) == 1.0}


@pytest.mark.slow
def test_a_trainers_bad_shard_is_screened_and_the_screen_holds_after_a_resume(tmp_path: Path) -> None:
    healthy = _last_loss(_trainer(tmp_path / "healthy", None, bad=range(0)))
    cb = _callback(tmp_path)
    trainer = _trainer(tmp_path, cb, bad=BAD)
    mon = cb.monitor
    assert mon.errors == {}, mon.errors
    rollbacks = [e for e in mon.events if isinstance(e, InterventionRecord) and e.action == "rollback"
                 and not e.reverted]
    assert len(rollbacks) == 1, [(e.action, dict(e.after)) for e in mon.events
                                 if isinstance(e, InterventionRecord)]
    (rollback,) = rollbacks
    (diagnosis,) = [e for e in mon.events if isinstance(e, InterventionRecord) and e.action == "diagnose"]
    assert diagnosis.after["verdict"] == "data", diagnosis.after["summary"]
    # the data is to blame, not the state the diagnosis judged at: the restart lands on that checkpoint
    assert rollback.after["checkpoint_step"] == diagnosis.after["checkpoint_step"]
    start, end = rollback.after["screened"]
    assert end >= start + 200 and rollback.after["screen_bar"] > 0
    # the Trainer's data goes on (it is not rewound): the shard's batches still to come after the rollback are the
    # ones the screen meets; the monitor's step is the Trainer's global step + 1
    still_bad = {b + 1 for b in BAD if b + 1 >= start}
    discarded = _discarded(cb)
    assert len(still_bad) >= 20 and still_bad <= discarded, (sorted(still_bad - discarded), start)
    assert len(discarded - still_bad) <= 3, sorted(discarded - still_bad)  # the clean batches trained
    final = _last_loss(trainer)
    assert math.isfinite(final) and final <= 1.1 * healthy, (final, healthy)

    # a resume from the Trainer's checkpoint at step 200, inside the window: the screen is in force again there
    resumed = _callback(tmp_path)
    _trainer(tmp_path, resumed, bad=BAD, resume=True)
    again = resumed.monitor
    assert again.run_id == mon.run_id
    assert again.overrides.screen_until == end  # the window outlasts the run: still open at its end
    redone = _discarded(resumed)
    assert {b + 1 for b in BAD if b + 1 > SAVE} <= redone, sorted(redone)
    assert len(redone - {b + 1 for b in BAD}) <= 3, sorted(redone)
