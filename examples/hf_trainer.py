"""A tiny GPT-2 trained with the Hugging Face ``Trainer``, monitored by stabmon through one callback.

The model is built from a ``GPT2Config`` with random weights (nothing is downloaded); the data is generated
here from a seed: sequences ``s, s+k, s+2k, ...`` (mod the vocabulary) for random starts ``s`` and strides
``k``, a pattern the model learns within a few dozen steps.

Stable setting (the default): AdamW at lr 3e-3 with warm-up, ``max_grad_norm=1.0`` (which the callback moves
into the monitor so gradients are clipped once); the loss falls from 3.35 (uniform over 32 tokens) to about 1.7
in 60 steps. ``--unstable``: the learning rate is warmed up over 150 steps towards 1.0, with no clipping and no
weight decay. The model learns normally (loss ~1.3 by step 40) until the learning rate passes about 0.4
(step ~65): the gradient norm jumps first (to 2-3x its level), the loss follows a few steps later (to 10+)
and never recovers. With ``--runbook default --mode apply`` the monitor's runbook acts on it (``--mode
propose`` only proposes). After a checkpoint-and-stop the script exits with the monitor's stop code (86).

Run it::

    python examples/hf_trainer.py --db sqlite:///hf.db
    python examples/hf_trainer.py --unstable --db sqlite:///hf.db --runbook default --mode apply
    stabmon metrics <run> --db sqlite:///hf.db
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

import torch

VOCAB, SEQ = 32, 24


def make_model(seed: int = 0) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))


def make_data(n: int = 512, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (n, 1), generator=g)
    strides = torch.randint(1, 4, (n, 1), generator=g)
    ids = (starts + strides * torch.arange(SEQ)) % VOCAB
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def train(
    *,
    steps: int = 60,
    unstable: bool = False,
    db: str | None = None,
    runbook: str | None = None,
    mode: str = "propose",
    out: str | None = None,
    flush_every: int = 10,
) -> Any:
    """Train and return the :class:`~stabmon.integrations.hf.StabmonCallback` (its ``monitor`` holds the
    records, its ``exit_code`` what to exit with)."""
    from transformers import Trainer, TrainingArguments

    from stabmon.integrations.hf import StabmonCallback
    from stabmon.monitor import MonitorConfig

    callback = StabmonCallback(
        store=db, runbook=runbook, mode=mode, run_name="hf-trainer-example",
        config=MonitorConfig(flush_every=flush_every, hang_timeout=None),
    )
    args = TrainingArguments(
        output_dir=out or tempfile.mkdtemp(prefix="stabmon-hf-"),
        max_steps=steps,
        per_device_train_batch_size=16,
        learning_rate=1.0 if unstable else 3e-3,
        warmup_steps=150 if unstable else 10,
        lr_scheduler_type="constant_with_warmup" if unstable else "linear",
        max_grad_norm=0.0 if unstable else 1.0,
        weight_decay=0.0 if unstable else 0.01,
        logging_steps=max(steps // 5, 1),
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=make_model(), args=args, train_dataset=make_data(), callbacks=[callback])
    trainer.train()
    return callback


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="default: 60, or 100 with --unstable")
    p.add_argument("--unstable", action="store_true")
    p.add_argument("--db", default=None, help="store URL (default: no store, records kept in memory)")
    p.add_argument("--runbook", default=None, help="runbook name or path (default: watch only)")
    p.add_argument("--mode", default="propose", choices=["propose", "apply", "observe"])
    p.add_argument("--out", default=None, help="Trainer output_dir (default: a temporary directory)")
    a = p.parse_args(argv)
    steps = a.steps if a.steps is not None else (100 if a.unstable else 60)
    cb = train(steps=steps, unstable=a.unstable, db=a.db, runbook=a.runbook, mode=a.mode, out=a.out)
    recs = list(cb.monitor.records)
    first, last = recs[0], recs[-1]
    print(f"run {cb.monitor.run_id}: {len(recs)} steps, loss {first.get('loss'):.3f} -> {last.get('loss'):.3f}, "
          f"max grad_norm {max(r.get('grad_norm') or 0.0 for r in recs):.2f}, "
          f"{len(cb.monitor.anomalies)} anomalies")
    return cb.exit_code


if __name__ == "__main__":
    sys.exit(main())
