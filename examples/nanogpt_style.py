"""A training loop shaped like nanoGPT's ``train.py``, monitored by stabmon in the lines marked ``# stabmon``.

What it keeps from nanoGPT: a global ``iter_num``, its own cosine learning-rate schedule with linear warm-up
written into the param groups each iteration, gradient accumulation over micro-batches, an evaluation every
``eval_interval`` iterations under ``model.eval()`` and ``torch.no_grad()``, and its own checkpoint dict
(``model``, ``optimizer``, ``iter_num``, ``best_val_loss``, ``config``) saved with ``torch.save`` and read back
with ``torch.load`` for ``--init-from resume``. The model is the tiny char-level GPT of ``tiny_gpt.py`` trained
on ``a+b=c;`` lines it writes itself (one CPU thread, about 40 ms an iteration).

What stabmon adds (count the ``# stabmon`` lines: ``tests/test_nanogpt_style.py`` holds them to 15): the monitor,
one ``observe`` per micro-batch, ``begin_step``/``end_step`` around the update, ``iter_num`` read back from the
monitor (a rollback rewinds it), the monitor's state inside the checkpoint dict, and the loop's own checkpoint
function handed to the monitor (``stabmon.UserCheckpoints``): rollback, Ctrl-C and resume all go through the
loop's own files. The loop's own ``clip_grad_norm_`` is gone: the monitor clips at ``grad_clip``.

Run it::

    python examples/nanogpt_style.py --out-dir out                                  # monitored, healthy
    python examples/nanogpt_style.py --out-dir out --lr-jump-at 150                 # a 1000x LR jump, rescued
    python examples/nanogpt_style.py --out-dir out --lr-jump-at 150 --no-monitor    # the same jump: it fails
    python examples/nanogpt_style.py --out-dir out --init-from resume               # after Ctrl-C: continue

``--lr-jump-at N`` multiplies the schedule's learning rate by 1000 for ``--lr-jump-iters`` (5) iterations the
first time the loop reaches iteration N (a transient mistake: a rollback past it does not repeat it). Unmonitored,
every seed tried ends far above the healthy loss (``tests/test_nanogpt_style.py`` sweeps seeds; see
docs/attach.md). ``--no-monitor`` runs the identical loop with a stand-in that does what the monitor's lines
must still do without it (count steps, clip, save): ``benchmarks/nanogpt_style.py`` compares the two.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_gpt import GPT, TrainConfig, make_corpus  # noqa: E402

import stabmon  # noqa: E402  # stabmon

LR_JUMP = 1000.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="out-nanogpt-style")
    p.add_argument("--init-from", choices=("scratch", "resume"), default="scratch")
    p.add_argument("--max-iters", type=int, default=300)
    p.add_argument("--eval-interval", type=int, default=25)
    p.add_argument("--eval-iters", type=int, default=4)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--gradient-accumulation-steps", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup-iters", type=int, default=30)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr-jump-at", type=int, default=None, help="iteration of a one-time 1000x LR jump")
    p.add_argument("--lr-jump-iters", type=int, default=5)
    p.add_argument("--lr-jump-factor", type=float, default=LR_JUMP)
    p.add_argument("--lr-jump-in-schedule", action="store_true",
                   help="the jump is part of the schedule: it comes back whenever the loop reaches those iterations")
    p.add_argument("--snapshots", type=int, default=0, help="MonitorConfig.snapshots: a snapshot every N steps")
    p.add_argument("--db", default="sqlite:///stabmon.db", help="the monitor's store URL (stabmon trace reads it)")
    p.add_argument("--runbook", default="default")
    p.add_argument("--mode", default="apply", choices=("apply", "propose", "observe"))
    p.add_argument("--no-monitor", action="store_true", help="the same loop without stabmon")
    p.add_argument("--no-step-time", action="store_true",
                   help="turn the step-time detector off (on a shared machine step times follow its load)")
    return p.parse_args(argv)


class Unmonitored:
    """What the loop's ``# stabmon`` lines need when stabmon is off: a step count, clipping, the save call."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, clip: float, save: Any,
                 every: int) -> None:
        self.step, self._save, self._every = 0, save, every
        def clip_grads(*_: Any) -> None:  # nanoGPT's clip_grad_norm_ line, before optimizer.step()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)

        optimizer.register_step_pre_hook(clip_grads)

    def begin_step(self) -> None: ...
    def observe(self, **metrics: Any) -> None: ...
    def end_step(self) -> None:
        self.step += 1
        if self.step % self._every == 0:
            self._save(self.step)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "run_id": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])

    def close(self) -> None: ...

    def outside_steps(self, what: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir, eval_interval, grad_clip = args.out_dir, args.eval_interval, args.grad_clip
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    config = vars(args)
    cfg = TrainConfig(block_size=64, n_layer=2, n_head=4, n_embd=64, seed=args.seed)
    data = {"train": make_corpus(200_000, args.seed), "val": make_corpus(20_000, args.seed + 7)}
    gen = torch.Generator().manual_seed(args.seed + 1)

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        d = data[split]
        ix = torch.randint(len(d) - cfg.block_size - 1, (args.batch_size,), generator=gen)
        x = torch.stack([d[i : i + cfg.block_size] for i in ix.tolist()])
        y = torch.stack([d[i + 1 : i + 1 + cfg.block_size] for i in ix.tolist()])
        return x, y

    def get_lr(it: int) -> float:  # nanoGPT's schedule: linear warm-up, cosine decay to min_lr
        if it < args.warmup_iters:
            return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
        ratio = min(1.0, (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters))
        return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.learning_rate - args.min_lr)

    jump_spent = False  # the injected fault strikes once: a rollback past it does not repeat it

    def injected(it: int, lr: float) -> float:
        nonlocal jump_spent
        if args.lr_jump_at is None or jump_spent or not args.lr_jump_at <= it < args.lr_jump_at + args.lr_jump_iters:
            return lr
        jump_spent = it == args.lr_jump_at + args.lr_jump_iters - 1 and not args.lr_jump_in_schedule
        return lr * args.lr_jump_factor

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        out = {}
        model.eval()
        for split in ("train", "val"):
            out[split] = sum(model(*get_batch(split)).item() for _ in range(args.eval_iters)) / args.eval_iters
        model.train()
        return out

    def save_checkpoint(step: int) -> str:  # stabmon: nanoGPT's save block as a function the monitor calls
        checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": step,
                      "best_val_loss": best_val_loss, "config": config,
                      "monitor": monitor.state_dict()}  # stabmon
        print(f"saving checkpoint to {out_dir}", flush=True)
        torch.save(checkpoint, path := os.path.join(out_dir, f"ckpt-{step:06d}.pt"))  # stabmon: a file per step
        return path  # stabmon: the monitor registers the file (and validates it before a rollback)

    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    iter_num, best_val_loss, checkpoint = 0, 1e9, None
    checkpoints = stabmon.UserCheckpoints(out_dir, save=save_checkpoint)  # stabmon
    if args.init_from == "resume":
        checkpoint = torch.load(checkpoints.latest().path, weights_only=True)  # stabmon: the newest on the timeline
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
    if args.no_monitor:  # the same loop without stabmon (the benchmark's baseline)
        monitor: Any = Unmonitored(model, optimizer, grad_clip, save_checkpoint, eval_interval)
        if checkpoint is not None:
            monitor.load_state_dict(checkpoint["monitor"])
    else:
        detectors = {"step_time": {"enabled": False}} if args.no_step_time else None  # (the tests' option)
        monitor = stabmon.Monitor(model, optimizer, store=args.db, runbook=args.runbook, mode=args.mode,  # stabmon
                                  config=stabmon.MonitorConfig(
                                      clip=grad_clip, checkpoint_every=eval_interval,
                                      snapshots=stabmon.SnapshotConfig(every=args.snapshots, keep=10)),
                                  resume=checkpoint and checkpoint["monitor"], checkpoints=checkpoints,  # stabmon
                                  detectors=detectors)

    X, Y = get_batch("train")
    t0 = time.time()
    trained = 0
    while True:
        lr = injected(iter_num, get_lr(iter_num))
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % eval_interval == 0:
            with monitor.outside_steps("evaluation"):  # stabmon: judged by hang_timeout, not learned as a step
                losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
            best_val_loss = min(best_val_loss, losses["val"])  # (the monitor saves: checkpoint_every)
        if iter_num >= args.max_iters:
            break
        monitor.begin_step()  # stabmon
        for _micro_step in range(args.gradient_accumulation_steps):
            loss = model(X, Y)
            monitor.observe(loss=loss)  # stabmon: once per micro-batch; the step records their mean
            loss = loss / args.gradient_accumulation_steps
            X, Y = get_batch("train")
            loss.backward()
        optimizer.step()  # the monitor clips at grad_clip (nanoGPT's clip_grad_norm_ line is gone)
        optimizer.zero_grad(set_to_none=True)
        trained += 1  # optimizer steps taken, those a rollback undoes included (the run's cost)
        monitor.end_step()  # stabmon
        iter_num = monitor.step  # stabmon: was iter_num += 1; a rollback rewinds it
        if iter_num % args.log_interval == 0:
            dt, t0 = time.time() - t0, time.time()
            print(f"iter {iter_num}: loss {loss.item() * args.gradient_accumulation_steps:.4f}, "
                  f"time {dt * 1000 / args.log_interval:.1f}ms", flush=True)
    monitor.close()  # stabmon
    losses = estimate_loss()
    print(f"done: {iter_num} iters, val loss {losses['val']:.4f}, {trained} steps trained", flush=True)
    return int(getattr(monitor, "exit_code", 0))


if __name__ == "__main__":
    sys.exit(main())
