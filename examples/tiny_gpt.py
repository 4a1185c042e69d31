"""A tiny character-level GPT (in the spirit of nanoGPT's train.py) that trains on text it writes itself.

The corpus is generated from a seed: lines of two-digit additions such as ``37+45=82;``. The model has two
transformer blocks (d=64, 4 heads, block 64) and trains with AdamW under linear warm-up then cosine decay, on
one CPU thread (about 30-40 ms a step on a laptop core).

Stable setting (the default): pre-LayerNorm blocks, peak lr 3e-3 after a 50-step warm-up, weight decay 0.1,
gradient clipping at 1.0. The loss falls from 2.6 to about 1.6 in 600 steps and stays there.

The ways it goes wrong live in ``scenarios.py`` beside this file: a learning rate far too high, a corrupted
data shard, an fp16 loss-scale collapse, a silently corrupted weight, a frozen positional embedding, a slow
drift into divergence, each failing for every seed when nobody intervenes (by an injected fault, :data:`FAULTS`,
or by a setting far past the edge of stability). ``benchmarks/recovery.py`` measures what the runbooks rescue.

Run it::

    python examples/tiny_gpt.py                                   # stable, unmonitored
    python examples/tiny_gpt.py --scenario lr-too-high            # a scenario, unmonitored: it fails
    python examples/tiny_gpt.py --scenario bad-shard --db sqlite:///tiny.db --runbook default --mode apply \
        --checkpoint-dir tiny-ckpt
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = "0123456789+=;"


@dataclass
class TrainConfig:
    """Everything the example trains with (the scenarios of ``scenarios.py`` change some fields)."""

    steps: int = 600
    batch_size: int = 16
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 50
    beta2: float = 0.95
    weight_decay: float = 0.1
    clip: float | None = 1.0
    norm: str = "pre"
    """Where the blocks' LayerNorms sit: "pre" (GPT-2, stable) or "post" (the original Transformer)."""
    seed: int = 1337
    threads: int = 1
    corpus_chars: int = 200_000
    log_every: int = 50
    bad_batches: tuple[int, int] | None = None
    """Batch indices ``[start, stop)`` whose text is replaced by random characters (a corrupted data shard)."""
    amp: str | None = None
    """"fp16": the output head (final LayerNorm and logits) under ``torch.autocast`` in float16, gradients
    through a ``GradScaler`` (None: float32 throughout)."""
    fault: str | None = None
    """A fault injected at ``fault_step`` (see :data:`FAULTS`); None: no fault."""
    fault_step: int = 0
    """Step at which a one-time fault strikes (the first time the run reaches it; a rollback does not repeat
    it, as a transient hardware fault would not); a sustained fault starts there and keeps striking."""
    fault_every: int = 4
    """A sustained fault (``flaky_overflow``) strikes on every ``fault_every``-th step from ``fault_step``."""
    eval_batches: int = 4
    """Held-out batches (text drawn with another seed) whose mean loss is :attr:`TrainResult.val_loss`."""
    head_lr: float = 1.0
    """Learning-rate multiplier of the output layer (``lm_head``, its own param group): a large one drives the
    output logits apart (output-logit divergence; there is no z-loss)."""

    def validate(self) -> None:
        for name in ("steps", "batch_size", "block_size", "n_layer", "n_head", "n_embd", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"config.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"config.n_embd must be divisible by config.n_head, got {self.n_embd}/{self.n_head}"
            )
        if self.norm not in ("pre", "post"):
            raise ValueError(f"config.norm must be 'pre' or 'post', got {self.norm!r}")
        if not self.lr > 0:
            raise ValueError(f"config.lr must be > 0, got {self.lr}")
        if not self.head_lr > 0:
            raise ValueError(f"config.head_lr must be > 0, got {self.head_lr}")
        if self.amp not in (None, "fp16"):
            raise ValueError(f"config.amp must be None or 'fp16', got {self.amp!r}")
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"config.fault must be one of {', '.join(FAULTS)} or None, got {self.fault!r}")
        if self.fault in ("overflow_state", "flaky_overflow") and self.amp != "fp16":
            raise ValueError(f"config.fault {self.fault!r} needs config.amp = 'fp16'")
        if self.fault_every < 1:
            raise ValueError(f"config.fault_every must be >= 1, got {self.fault_every}")


# -- data ----------------------------------------------------------------------------------------------------
def make_corpus(n_chars: int, seed: int) -> torch.Tensor:
    """Token ids of ``a+b=c;`` lines drawn with ``seed``."""
    rng = random.Random(seed)
    parts, total = [], 0
    while total < n_chars:
        a, b = rng.randrange(100), rng.randrange(100)
        line = f"{a}+{b}={a + b};"
        parts.append(line)
        total += len(line)
    text = "".join(parts)[:n_chars]
    lookup = {c: i for i, c in enumerate(VOCAB)}
    return torch.tensor([lookup[c] for c in text], dtype=torch.long)


class Batches:
    """Random (x, y) windows of the corpus, the same ones on every pass (seeded): ``4 x steps`` of them, so a
    run that skips batches (rollbacks) still has data for all its steps."""

    def __init__(self, data: torch.Tensor, config: TrainConfig) -> None:
        self.data, self.config = data, config

    def __len__(self) -> int:
        return 4 * self.config.steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        c = self.config
        gen = torch.Generator().manual_seed(c.seed + 1)
        noise = torch.Generator().manual_seed(c.seed + 2)
        for index in range(len(self)):
            ix = torch.randint(len(self.data) - c.block_size - 1, (c.batch_size,), generator=gen)
            x = torch.stack([self.data[i : i + c.block_size] for i in ix.tolist()])
            y = torch.stack([self.data[i + 1 : i + 1 + c.block_size] for i in ix.tolist()])
            if c.bad_batches is not None and c.bad_batches[0] <= index < c.bad_batches[1]:
                garbage = torch.randint(len(VOCAB), (c.batch_size, c.block_size + 1), generator=noise)
                x, y = garbage[:, :-1].contiguous(), garbage[:, 1:].contiguous()
            yield x, y


# -- model ---------------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, c: TrainConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.post = c.norm == "post"
        self.ln_1 = nn.LayerNorm(c.n_embd)
        self.attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.ln_2 = nn.LayerNorm(c.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(), nn.Linear(4 * c.n_embd, c.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.post:
            x = self.ln_1(x + self._attend(x))
            return self.ln_2(x + self.mlp(x))
        x = x + self._attend(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class GPT(nn.Module):
    def __init__(self, c: TrainConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(len(VOCAB), c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.h = nn.ModuleList([Block(c) for _ in range(c.n_layer)])
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, len(VOCAB), bias=False)
        self.fp16_head = c.amp == "fp16"

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        # fp16: the output head runs under float16 autocast (the loss itself is computed in float32, as
        # autocast does); the blocks stay in float32 because float16 matmuls are slow on a CPU
        with torch.autocast("cpu", dtype=torch.float16, enabled=self.fp16_head and self.training):
            logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


def lr_lambda(c: TrainConfig) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < c.warmup:
            return (step + 1) / c.warmup
        progress = min(1.0, (step - c.warmup) / max(1, c.steps - c.warmup))
        return (c.min_lr + 0.5 * (c.lr - c.min_lr) * (1 + math.cos(math.pi * progress))) / c.lr

    return factor


def build(config: TrainConfig) -> tuple[GPT, torch.optim.Optimizer, Any, Batches]:
    """Model, optimizer, scheduler and batches, all seeded."""
    config.validate()
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    model = GPT(config)
    if config.head_lr == 1.0:
        groups: list[dict[str, Any]] = [{"params": list(model.parameters())}]
    else:  # the output layer in a group of its own, at head_lr x the learning rate
        body = [p for p in model.parameters() if p is not model.lm_head.weight]
        groups = [{"params": body}, {"params": [model.lm_head.weight], "lr": config.lr * config.head_lr}]
    opt = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, config.beta2), weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(config))
    return model, opt, sched, Batches(make_corpus(config.corpus_chars, config.seed), config)


# -- faults --------------------------------------------------------------------------------------------------
FAULTS = {
    "corrupt_weight": "silent data corruption: the top exponent bit of 4 weights of the first block's MLP "
    "flipped (each becomes ~2^128 times larger), once, at fault_step",
    "overflow_state": "fp16 only: the final LayerNorm's gain multiplied by 2^14, once, at fault_step, so the "
    "logits overflow float16 on every later step; every update is skipped and the loss scale collapses",
    "flaky_activation": "a flaky GPU: the first time step fault_step runs, one element of the first block's "
    "output is computed as inf (a forward hook), so the loss and the update are NaN; re-running the same step "
    "from the same state computes it correctly",
    "freeze_wpe": "the positional embedding never receives a gradient (OPT-175B's frozen positional "
    "embeddings): nothing diverges, it just does not learn",
    "grad_spike": "a sudden gradient: at fault_step, once, every gradient is 10^4 times its size (a degenerate "
    "batch, a loss multiplied by mistake). Without clipping, Adam's second moment takes in g^2 10^8 times its "
    "history; with beta2 0.999 it decays by 0.1% a step, so every later update is ~300x too small for thousands "
    "of steps: the run stops learning (SPAM's momentum and second-moment spikes)",
    "flaky_overflow": "fp16 only: from fault_step on, every fault_every-th step one element of the output "
    "head's gradient overflows float16 (a kernel whose intermediate passes 65504); the loss stays finite, the "
    "loss scaler skips the step and backs off. Sustained, not the learning rate's doing, and a rollback does "
    "not cure it: the steps come round again",
}
"""Faults :class:`TrainConfig` can inject (``fault``): each fails the run by construction, for every seed."""
ONE_TIME = ("corrupt_weight", "overflow_state", "flaky_activation", "grad_spike")
"""The faults that strike once, at ``fault_step`` (a rollback to before it does not repeat them); the others
(``freeze_wpe``, ``flaky_overflow``) act on every step, or every ``fault_every``-th one."""


class Fault:
    """Applies ``config.fault`` to the model: one-time state faults at ``fault_step`` (once per process, so a
    rollback to before it does not repeat it), a frozen parameter on every step."""

    def __init__(self, config: TrainConfig, model: GPT) -> None:
        self.kind, self.step, self.model, self.fired = config.fault, config.fault_step, model, False
        self.every = config.fault_every
        self.gen = torch.Generator().manual_seed(config.seed + 3)
        self.armed = False
        if self.kind == "freeze_wpe":
            model.wpe.weight.requires_grad_(False)
        if self.kind == "flaky_activation":
            model.h[0].register_forward_hook(self._flaky)
        if self.kind == "flaky_overflow":
            model.ln_f.weight.register_hook(self._overflow)
        if self.kind == "grad_spike":
            for p in model.parameters():
                p.register_hook(self._spike)

    def _spike(self, grad: torch.Tensor) -> torch.Tensor | None:
        """The sudden gradient: while armed (the one step it strikes), every gradient 10^4 times its size."""
        return grad * 1e4 if self.armed else None

    def _overflow(self, grad: torch.Tensor) -> torch.Tensor | None:
        """The sustained fault: while armed (this step strikes), one gradient element is inf."""
        if not self.armed:
            return None
        self.armed = False
        grad = grad.clone()
        grad.view(-1)[0] = math.inf
        return grad

    def _flaky(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        """The one faulty execution: only while armed by :meth:`before_step` (a re-run is not)."""
        if not self.armed:
            return None
        self.armed = False
        output = output.clone()
        output.view(-1)[0] = math.inf
        return output

    @torch.no_grad()
    def before_step(self, step: int) -> None:
        if self.kind == "flaky_overflow":
            self.armed = step >= self.step and (step - self.step) % self.every == 0
            return
        if self.kind == "grad_spike":
            self.armed = False  # one step only
        if self.fired or step != self.step or self.kind not in ONE_TIME:
            return
        self.fired = True
        if self.kind in ("flaky_activation", "grad_spike"):
            self.armed = True
            return
        if self.kind == "corrupt_weight":  # flip the top exponent bit: |w| < 2 becomes |w| x 2^128
            bits = self.model.h[0].mlp[0].weight.view(-1).view(torch.int32)
            hit = torch.randperm(bits.numel(), generator=self.gen)[:4]
            bits[hit] ^= 1 << 30
        else:
            self.model.ln_f.weight.mul_(2.0**14)


# -- training ------------------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    exit_code: int = 0
    monitor: Any = None
    val_loss: float = float("nan")
    """Mean loss of the final model on held-out batches (inf when it is not finite)."""
    stopped_at: int | None = None
    """The step at which the run was stopped (by the monitor or a peer's response); None: it ran to the end."""

    @property
    def final_loss(self) -> float:
        tail = self.losses[-20:]
        return sum(tail) / len(tail) if tail else float("nan")

    @property
    def diverged(self) -> bool:
        """The last 20 steps' mean loss is non-finite or well above the best loss seen."""
        return (
            not math.isfinite(self.final_loss) or self.final_loss > min(self.losses, default=math.inf) + 0.3
        )


MonitorFactory = Callable[..., Any]
"""``(model, optimizer, scheduler) -> Monitor``; with ``config.amp`` it is also given ``scaler=``."""


class Response(Protocol):
    """What an unmonitored loop does about instability itself (a peer's automatic response): called after
    the gradients are ready (unscaled), it may clip them and answers ``"step"``, ``"skip"`` (drop this update)
    or ``"stop"`` (end the run). Unless it ``clips`` itself, the recipe's own ``config.clip`` applies first."""

    clips: bool

    def on_step(self, step: int, loss: torch.Tensor, model: nn.Module) -> str: ...


def train(config: TrainConfig, monitor: MonitorFactory | None = None, response: Response | None = None) -> TrainResult:
    """Train; with ``monitor`` (see :data:`MonitorFactory`) the loop is monitored and the monitor clips;
    with ``response`` (unmonitored only) a peer's automatic response acts instead of the configured clip.
    Losses are read back every ``log_every`` steps only (the monitor reads nothing)."""
    model, opt, sched, batches = build(config)
    scaler = torch.amp.GradScaler("cpu") if config.amp == "fp16" else None
    mon = None
    if monitor is not None:
        mon = monitor(model, opt, sched, scaler=scaler) if scaler is not None else monitor(model, opt, sched)
    fault = Fault(config, model)
    result, pending = TrainResult(monitor=mon), []
    t0 = time.perf_counter()
    steps = mon.steps(batches, max_steps=config.steps) if mon is not None else enumerate(batches)
    try:
        for step, (x, y) in steps:
            if step >= config.steps:
                break
            fault.before_step(step)
            loss = model(x, y)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            pending.append(loss.detach().float())
            result.steps += 1
            if mon is not None:
                mon.observe(loss=loss, tokens=x.numel())
            elif not _unmonitored_update(config, model, opt, scaler, response, step, loss):
                result.stopped_at = step
                break
            if mon is None or not mon.should_stop:
                _optimizer_step(opt, scaler)
            sched.step()
            opt.zero_grad(set_to_none=True)
            if len(pending) == config.log_every:
                result.losses.extend(torch.stack(pending).tolist())
                pending = []
    finally:
        if pending:
            result.losses.extend(torch.stack(pending).tolist())
        if mon is not None:
            mon.close()
            result.exit_code = mon.exit_code
            if mon.should_stop:
                result.stopped_at = mon.step
    result.seconds = time.perf_counter() - t0
    result.val_loss = evaluate(model, config)
    return result


def _unmonitored_update(
    config: TrainConfig, model: GPT, opt: Any, scaler: Any, response: Response | None, step: int, loss: Any
) -> bool:
    """Clip (or let ``response`` act); False when the response stops the run. A skipped update zeroes the
    gradients, so the optimizer step that follows changes nothing (AdamW skips parameters without one)."""
    if scaler is not None:
        scaler.unscale_(opt)
    if config.clip is not None and not (response is not None and response.clips):
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip, foreach=True)
    if response is None:
        return True
    action = response.on_step(step, loss.detach(), model)
    if action == "stop":
        return False
    if action == "skip":
        opt.zero_grad(set_to_none=True)
    return True


def _optimizer_step(opt: torch.optim.Optimizer, scaler: Any) -> None:
    if scaler is None:
        opt.step()
        return
    if any(p.grad is not None for g in opt.param_groups for p in g["params"]):
        scaler.step(opt)
        scaler.update()
    else:  # a skipped update: nothing to step, and the scaler saw no overflow
        scaler.update()


@torch.no_grad()
def evaluate(model: GPT, config: TrainConfig) -> float:
    """Mean loss on ``config.eval_batches`` held-out batches (text drawn with another seed); inf when the
    model's output is not finite."""
    held_out = dataclasses.replace(config, seed=config.seed + 10_000, bad_batches=None, steps=config.eval_batches)
    data = make_corpus(max(20 * config.block_size * config.batch_size, 20_000), held_out.seed)
    was_training = model.training
    model.eval()
    losses = [model(x, y) for x, y in itertools.islice(Batches(data, held_out), config.eval_batches)]
    model.train(was_training)
    value = float(torch.stack(losses).mean())
    return value if math.isfinite(value) else math.inf


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default=None, help="a scenario of scenarios.py (default: the stable setting)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the setting's own)")
    p.add_argument("--runbook", default=None, help="runbook name or path (default: none, observe only)")
    p.add_argument("--mode", default="propose", choices=["propose", "apply", "observe"])
    p.add_argument("--db", default=None, help="store URL; monitored when given (or with --runbook)")
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--checkpoint-dir", default=None, help="checkpoint every 25 steps here (rollback needs it)")
    args = p.parse_args(argv)
    steps = {} if args.steps is None else {"steps": args.steps}
    if args.scenario is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import scenarios

        try:
            config = scenarios.scenario(args.scenario).config(args.seed, **steps)
        except ValueError as exc:
            p.error(f"--scenario: {exc}")
    else:
        config = TrainConfig(seed=args.seed, **steps)
    factory = None
    if args.db or args.runbook:
        from stabmon.monitor import Monitor, MonitorConfig

        def factory(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, scaler: Any = None) -> Monitor:
            return Monitor(
                model,
                opt,
                scheduler=sched,
                scaler=scaler,
                store=args.db or "default",
                runbook=args.runbook,
                mode=args.mode,
                config=MonitorConfig(
                    clip=config.clip, checkpoint_every=25 if args.checkpoint_dir else 0,
                    checkpoint_keep=40,
                ),
                checkpoint_dir=args.checkpoint_dir,
                run_name="tiny-gpt" + (f"-{args.scenario}" if args.scenario else ""),
            )

    result = train(config, monitor=factory)
    for i in range(0, len(result.losses), config.log_every):
        print(f"step {i:5d}  loss {result.losses[i]:.4f}")
    print(
        f"{result.steps} steps in {result.seconds:.1f}s, final loss {result.final_loss:.4f}, held-out loss "
        f"{result.val_loss:.4f}{' (diverged)' if result.diverged else ''}"
    )
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
