"""A tiny causal transformer trained with PyTorch Lightning, monitored by stabmon through one callback.

The model (token + position embeddings, two ``nn.TransformerEncoderLayer`` blocks with a causal mask, a linear
head) is defined here with random weights; the data is generated here from a seed: sequences
``s, s+k, s+2k, ...`` (mod the vocabulary), the same task as ``examples/hf_trainer.py``.

Stable setting (the default): AdamW at lr 3e-3 after a short warm-up, ``gradient_clip_val=1.0`` (which the
callback moves into the monitor so gradients are clipped once). The loss falls from 3.6 to
about 0.9 in 60 steps. ``--unstable``: post-LayerNorm blocks, the learning rate warmed up over 150 steps
towards ``--peak-lr`` (default 0.3), no clipping, no weight decay. The model learns first (loss ~1.2 by step
45); once the learning rate passes about 0.1 (step ~55) the gradient norm jumps to about twice its level and the
loss climbs over the next 20 steps back to ~3.0 (near uniform over 32 tokens) and stays there: a slow
divergence rather than one spike. With ``--runbook default --mode apply`` the monitor's runbook acts on what
the detectors flag. After a checkpoint-and-stop the script
exits with the monitor's stop code (86).

Run it::

    python examples/lightning_loop.py --db sqlite:///pl.db
    python examples/lightning_loop.py --unstable --db sqlite:///pl.db --runbook default --mode apply
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, SEQ = 32, 24

try:
    import lightning.pytorch as L
except ImportError:  # pragma: no cover - the example needs the ``lightning`` extra
    L = None  # type: ignore[assignment]


def make_loader(n: int = 512, seed: int = 0, batch_size: int = 16) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (n, 1), generator=g)
    strides = torch.randint(1, 4, (n, 1), generator=g)
    ids = (starts + strides * torch.arange(SEQ)) % VOCAB
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=batch_size, shuffle=True,
                                       generator=torch.Generator().manual_seed(seed))


class TinyLM(L.LightningModule if L is not None else nn.Module):  # type: ignore[misc]
    """Two causal transformer blocks over a 32-token vocabulary."""

    def __init__(self, *, lr: float = 3e-3, warmup: int = 10, post_norm: bool = False,
                 weight_decay: float = 0.01, d: int = 32) -> None:
        super().__init__()
        self.lr, self.warmup, self.weight_decay = lr, warmup, weight_decay
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding(SEQ, d)
        layer = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=4 * d, dropout=0.0, batch_first=True,
                                           norm_first=not post_norm)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        n = ids.shape[1]
        return self.head(self.blocks(x, mask=self.mask[:n, :n], is_causal=True))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        warm = max(self.warmup, 1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def train(
    *,
    steps: int = 60,
    unstable: bool = False,
    peak_lr: float = 0.3,
    db: str | None = None,
    runbook: str | None = None,
    mode: str = "propose",
    out: str | None = None,
    flush_every: int = 10,
) -> Any:
    """Train and return the :class:`~stabmon.integrations.lightning.StabmonCallback` (its ``monitor`` holds
    the records, its ``exit_code`` what to exit with)."""
    if L is None:
        raise ImportError("examples/lightning_loop.py needs lightning: pip install 'stabmon[lightning]'")
    from stabmon.integrations.lightning import StabmonCallback
    from stabmon.monitor import MonitorConfig

    torch.manual_seed(0)
    if unstable:
        module = TinyLM(lr=peak_lr, warmup=150, post_norm=True, weight_decay=0.0)
    else:
        module = TinyLM()
    callback = StabmonCallback(
        store=db, runbook=runbook, mode=mode, run_name="lightning-example",
        config=MonitorConfig(flush_every=flush_every, hang_timeout=None),
    )
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, callbacks=[callback],
        gradient_clip_val=None if unstable else 1.0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=out or tempfile.mkdtemp(prefix="stabmon-pl-"),
    )
    trainer.fit(module, make_loader())
    return callback


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="default: 60, or 100 with --unstable")
    p.add_argument("--unstable", action="store_true")
    p.add_argument("--peak-lr", type=float, default=0.3)
    p.add_argument("--db", default=None, help="store URL (default: no store, records kept in memory)")
    p.add_argument("--runbook", default=None, help="runbook name or path (default: watch only)")
    p.add_argument("--mode", default="propose", choices=["propose", "apply", "observe"])
    p.add_argument("--out", default=None, help="Trainer default_root_dir (default: a temporary directory)")
    a = p.parse_args(argv)
    steps = a.steps if a.steps is not None else (100 if a.unstable else 60)
    cb = train(steps=steps, unstable=a.unstable, peak_lr=a.peak_lr, db=a.db, runbook=a.runbook, mode=a.mode,
               out=a.out)
    recs = list(cb.monitor.records)
    print(f"run {cb.monitor.run_id}: {len(recs)} steps, loss {recs[0].get('loss'):.3f} -> "
          f"{recs[-1].get('loss'):.3f}, max grad_norm {max(r.get('grad_norm') or 0.0 for r in recs):.2f}, "
          f"{len(cb.monitor.anomalies)} anomalies")
    return cb.exit_code


if __name__ == "__main__":
    sys.exit(main())
