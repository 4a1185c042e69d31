"""A new user's script on the real ``transformers.Trainer``: the documented callback with ``checkpoint_dir=``, the
default ``default`` runbook, and the learning rate x100 from step 200 on (far past the edge: the run is ruined
without stabmon, on every seed tried). With the Trainer's default scheduler (the fault a callback's, keyed on the
Trainer's step) and with a custom ``LambdaLR`` (the fault in the schedule itself, so a rollback meets it again):

- stabmon writes its checkpoint at every cadence step (its first step included);
- the rollback lands on the newest checkpoint before the incident's onset, and the run goes on from there while
  the Trainer's step count goes on;
- ``stabmon goodput`` books the rolled-back steps as rollback;
- the final loss is within 5% of the healthy run's.

The task has a floor (a fifth of the tokens are noise), so a rescued run can reach the healthy loss again.
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
from stabmon.integrations.hf import StabmonCallback  # noqa: E402

VOCAB, SEQ, STEPS, FAULT_FROM, EVERY, LR = 32, 16, 600, 200, 50, 3e-3
SEED = int(os.environ.get("STABMON_TEST_SEED", "0"))


def _rows(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(SEED)
    rows = []
    for _ in range(n):
        ids = (torch.arange(SEQ) * 3 + int(torch.randint(0, VOCAB, (1,), generator=g))) % VOCAB
        noise = torch.rand(SEQ, generator=g) < 0.2
        rows.append({"input_ids": (ids := torch.where(noise, torch.randint(0, VOCAB, (SEQ,), generator=g), ids)),
                     "labels": ids.clone()})
    return rows


class LrTimes100(transformers.TrainerCallback):
    """The fault with the Trainer's default scheduler: from step 200 on, the LR the scheduler set x100."""

    def on_step_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
        if state.global_step >= FAULT_FROM:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * 100


def _train(tmp: Path, *, sched: str, fault: bool, monitored: bool, alerts: str | None = None) -> tuple[float, Any]:
    torch.manual_seed(SEED)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    args = transformers.TrainingArguments(
        output_dir=str(tmp / "out"), per_device_train_batch_size=8, learning_rate=LR, max_steps=STEPS,
        logging_steps=10, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=SEED)
    callbacks: list[Any] = []
    optimizers: tuple[Any, Any] = (None, None)
    if sched == "lambda":
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        spike = 100.0 if fault else 1.0
        optimizers = (opt, torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: (spike if s >= FAULT_FROM else 1.0) * max(0.0, 1 - s / STEPS)))
    elif fault:
        callbacks.append(LrTimes100())
    cb = None
    if monitored:  # the documented callback, as docs/integrations.md shows it
        cb = StabmonCallback(store=f"sqlite:///{tmp / 'stabmon.db'}", runbook="default", mode="apply",
                             checkpoint_dir=str(tmp / "ckpt"), config=MonitorConfig(checkpoint_every=EVERY),
                             alerts=[alerts] if alerts else None)
        callbacks.append(cb)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_rows(STEPS * 8 + 64),
                                   callbacks=callbacks, optimizers=optimizers)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return sum(losses[-3:]) / 3, cb


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> float:
    loss, _ = _train(tmp_path_factory.mktemp("healthy"), sched="default", fault=False, monitored=False)
    return loss


@pytest.mark.slow
def test_the_fault_ruins_the_run_unmonitored(tmp_path: Path, healthy: float) -> None:
    ruined, _ = _train(tmp_path, sched="default", fault=True, monitored=False)
    assert ruined > 1.5 * healthy, (ruined, healthy)


@pytest.mark.slow
@pytest.mark.parametrize("sched", ["default", "lambda"])
def test_a_new_users_trainer_is_rescued_from_its_checkpoints(sched: str, tmp_path: Path, healthy: float) -> None:
    from test_alerts_support import Receiver

    from stabmon.events import InterventionRecord
    from stabmon.goodput import compute_ledger, load_input
    from stabmon.store import open_store
    from stabmon.store.repo import list_checkpoints, load_events

    pager = Receiver()  # a paging channel: errors and worse only, as PagerDuty's default
    try:
        final, cb = _train(tmp_path, sched=sched, fault=True, monitored=True,
                           alerts=f"json://{pager.netloc}/page?stabmon_min_severity=error")
    finally:
        pager.close()
    pages = [b["title"] for b in pager.json_bodies()]
    assert cb.monitor.errors == {}, cb.monitor.errors  # no checkpoint failed (each one did, after step 1)
    store = open_store(f"sqlite:///{tmp_path / 'stabmon.db'}")
    try:
        with store.session() as session:
            run_id = cb.monitor.run_id
            saved = {int(c["step"]) for c in list_checkpoints(session=session, run_id=run_id)}
            events = load_events(session=session, run_id=run_id)
            ledger = compute_ledger(load_input(session=session, run_id=run_id))
    finally:
        store.close()
    rollbacks = [e for e in events if isinstance(e, InterventionRecord) and e.action == "rollback" and e.ok]
    assert rollbacks, [(e.action, e.after) for e in events if isinstance(e, InterventionRecord)]
    first = rollbacks[0]
    onset = int(first.before["onset_step"])
    cadence = {s for s in range(EVERY, first.after["from_step"], EVERY)}
    assert cadence <= saved and min(saved) == 1, sorted(saved)  # every cadence step before the rollback, and step 1
    assert first.after["checkpoint_step"] == max(s for s in saved if s <= onset) < FAULT_FROM + 1, first.after
    assert first.after["restored_step"] == first.after["from_step"]  # the Trainer's count goes on
    back = sum(r.after["from_step"] - r.after["checkpoint_step"] for r in rollbacks)
    assert ledger.cause("rollback").steps >= back > 0, (ledger.cause("rollback"), back)
    assert math.isfinite(final) and final <= 1.05 * healthy, (final, healthy)
    changed = [e for e in events if isinstance(e, InterventionRecord) and e.ok and not e.not_applied
               and e.action not in ("diagnose", "alert_only", "release")]
    # the paging channel hears the incident once, each change to training once, and its resolution; never a rung
    # that changed nothing (the skipped layer cut, the diagnosis) nor an escalation to one
    news = [t for t in pages if "RESOLVED" not in t]
    assert 0 < len(news) <= 1 + len(changed), (pages, [c.action for c in changed])
    assert not [t for t in news if "diagnose" in t or "scale_layer_lr" in t or "ESCALATED" in t], pages
    assert len(pages) - len(news) <= 1, pages
