"""Monitoring overhead on the tiny GPT example (CPU): monitored vs unmonitored step time.

Both loops train the same model from the same seed on the same pre-built batches and clip at the same max_norm
(the unmonitored loop with ``torch.nn.utils.clip_grad_norm_(foreach=True)``, the monitored one through the
monitor's optimizer hooks, which reuse their one fused norm). Blocks of ``--block`` steps alternate A, B, A,
B... so machine-load drifts hit both; each round's ratio is B/A and the median over rounds is printed for

  (a) the monitor's defaults (activation norms, embedding drift and, with Adam/AdamW, the per-layer update ratios
      recomputed from the optimizer state sampled every 20 steps, default detectors, no
      runbook; isolated, also with the default runbook and a checkpoint directory, where its diagnose rung keeps a
      batch log: each step's batch reference and RNG state; no checkpoint is saved in the timed steps),
  (b) every signal every step (activation and embedding sampling every step),
  (c) the defaults with the real SQLite store (background writer) instead of no store,
  (d) the defaults plus the signals with lead (second-moment ratio, attention logits, output-logit scale), each
      sampled every 10 steps (they are off by default),
  (e) the defaults as they run in a watch window (``MonitorConfig.watch``: after a warning, and during an
      incident, a flush every 4 steps instead of 20): its cost for the steps it lasts.

Then the same two settings are measured "isolated": the monitor's own CPU time per step, timed inside its entry
points, against the CPU time of the clip_grad_norm_ call it replaces, timed inside the unmonitored loop. That
figure does not depend on two loops seeing the same machine load, so it is the precise one on a shared machine.

For the A/B rounds two ratios are printed: process CPU time (what the monitor costs; insensitive to other
processes competing for the cores, and it includes the store's writer thread) and wall time (what a user waits;
noisy on a shared machine). Targets: (a) <= 1.01, (b) <= 1.05. Figures are from one run; run it on a quiet machine::

    python benchmarks/overhead.py --rounds 15 --block 20
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from stabmon.collect.config import AttentionConfig, LogitConfig, MomentConfig, UpdateConfig
from stabmon.monitor import ActivationConfig, EmbeddingConfig, Monitor, MonitorConfig

ROOT = Path(__file__).resolve().parent.parent


def load_tiny_gpt() -> Any:
    spec = importlib.util.spec_from_file_location("tiny_gpt", ROOT / "examples" / "tiny_gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["tiny_gpt"] = module
    spec.loader.exec_module(module)
    return module


class Loop:
    """One training loop (model, optimizer, scheduler) that runs blocks of steps and times them."""

    def __init__(
        self,
        tg: Any,
        config: Any,
        batches: list[Any],
        monitor_config: MonitorConfig | None,
        store: Any = None,
        checkpoint_dir: str | None = None,
        runbook: str | None = None,
    ) -> None:
        self.model, self.opt, self.sched, _ = tg.build(config)
        self.batches, self.clip, self.i = batches, config.clip, 0
        self.mon = None
        if monitor_config is not None:
            self.mon = Monitor(
                self.model,
                self.opt,
                scheduler=self.sched,
                store=store,
                checkpoint_dir=checkpoint_dir,
                runbook=runbook,
                config=monitor_config,
                run_name="overhead-benchmark",
            )

    def block(self, n: int) -> tuple[float, float]:
        """(wall seconds, process CPU seconds) for ``n`` steps."""
        model, opt, sched, mon = self.model, self.opt, self.sched, self.mon
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            x, y = self.batches[self.i % len(self.batches)]
            self.i += 1
            if mon is not None:  # the batch, as monitor.steps(loader) hands it (kept where a runbook diagnoses)
                mon.begin_step(batch_index=self.i, batch=(x, y))
            loss = model(x, y)
            loss.backward()
            if mon is not None:
                mon.observe(loss=loss)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip, foreach=True)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if mon is not None:
                mon.end_step()
        return time.perf_counter() - t0, time.process_time() - c0

    def close(self) -> None:
        if self.mon is not None:
            self.mon.close()


def measure(
    tg: Any, label: str, monitor_config: MonitorConfig, *, rounds: int, block: int, store: Any = None
) -> float:
    config = tg.TrainConfig(steps=rounds * block + block)
    batches = list(tg.Batches(tg.make_corpus(config.corpus_chars, config.seed), config))
    a = Loop(tg, config, batches, None)
    b = Loop(tg, config, batches, monitor_config, store=store)
    a.block(block)  # warm-up, untimed
    b.block(block)
    wall, cpu, ta, tb = [], [], [], []
    for r in range(rounds):
        first, second = (a, b) if r % 2 == 0 else (b, a)
        t1, t2 = first.block(block), second.block(block)
        t_a, t_b = (t1, t2) if first is a else (t2, t1)
        ta.append(t_a[0] / block)
        tb.append(t_b[0] / block)
        wall.append(t_b[0] / t_a[0])
        cpu.append(t_b[1] / t_a[1])
    a.close()
    b.close()
    ratio = statistics.median(cpu)
    print(
        f"{label:<40} median ratio: CPU {ratio:.4f} (IQR {_iqr(cpu)}), wall {statistics.median(wall):.4f} "
        f"(IQR {_iqr(wall)}); unmonitored {statistics.median(ta) * 1e3:.2f} ms/step, "
        f"monitored {statistics.median(tb) * 1e3:.2f} ms/step"
    )
    return ratio


def _iqr(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return f"{q[0]:.3f}-{q[2]:.3f}"


class _Timer:
    """Accumulates this thread's CPU time spent in wrapped calls (outermost calls only)."""

    def __init__(self) -> None:
        self.ns = 0
        self.depth = 0

    def wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            t0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns += time.thread_time_ns() - t0
                self.depth -= 1

        return timed


def isolated(tg: Any, label: str, monitor_config: MonitorConfig, *, steps: int,
             checkpoint_dir: str | None = None, runbook: str | None = None) -> None:
    """The monitor's own CPU time per step, measured inside its entry points (begin/observe/end_step, the
    optimizer hooks, the activation hooks), next to the clip_grad_norm_ call it replaces, timed inside the
    unmonitored loop (both in situ: the gradients are as warm or cold in the cache as in training)."""
    config = tg.TrainConfig(steps=steps + 20)
    batches = list(tg.Batches(tg.make_corpus(config.corpus_chars, config.seed), config))
    loop = Loop(tg, config, batches, monitor_config, checkpoint_dir=checkpoint_dir, runbook=runbook)
    mon, timer = loop.mon, _Timer()
    assert mon is not None
    hooks = mon.signals.hooks
    hooks.remove()
    hooks._pre, hooks._post = timer.wrap(hooks._pre), timer.wrap(hooks._post)  # type: ignore[method-assign]
    hooks.install()
    for name in ("begin_step", "observe", "end_step"):
        setattr(mon, name, timer.wrap(getattr(mon, name)))
    if mon.signals.activations is not None:
        make_hook = mon.signals.activations._hook
        mon.signals.activations._hook = lambda i: timer.wrap(make_hook(i))  # type: ignore[method-assign]
    attention = mon.signals.attention
    if attention is not None:  # its hooks; the calls its capture mode sees inside the forward are not timed here
        pre, post = attention._pre, attention._post
        attention._pre = lambda i: timer.wrap(pre(i))  # type: ignore[method-assign]
        attention._post = lambda i: timer.wrap(post(i))  # type: ignore[method-assign]
    if mon.signals.logits is not None:
        mon.signals.logits._hook = timer.wrap(mon.signals.logits._hook)  # type: ignore[method-assign]
    loop.block(20)
    timer.ns = 0
    c0 = time.thread_time_ns()
    loop.block(steps)
    step_ns = (time.thread_time_ns() - c0) / steps
    mon_ns = timer.ns / steps
    loop.close()
    ref, clip_timer = Loop(tg, config, batches, None), _Timer()
    real_clip = torch.nn.utils.clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = clip_timer.wrap(real_clip)  # timed where the loop calls it
    try:
        ref.block(20)
        clip_timer.ns = 0
        ref.block(steps)
    finally:
        torch.nn.utils.clip_grad_norm_ = real_clip
    clip_ns = clip_timer.ns / steps
    print(
        f"{label:<40} monitor CPU {mon_ns / 1e3:.0f} us/step, replaces clip_grad_norm_ {clip_ns / 1e3:.0f} us/step; "
        f"net {(mon_ns - clip_ns) / 1e3:+.0f} us = {(mon_ns - clip_ns) / (step_ns - mon_ns + clip_ns) * 100:+.2f}% "
        f"of an unmonitored step ({(step_ns - mon_ns + clip_ns) / 1e6:.2f} ms CPU)"
    )


def batch_log(tg: Any, *, steps: int) -> None:
    """The batch log's own work per step (what a diagnosing runbook adds to ``begin_step``), timed alone: each
    step's batch reference, its size and the CPU RNG state, kept for the last 256 steps."""
    from stabmon.collect.batches import BatchLog

    config = tg.TrainConfig(steps=steps)
    batches = list(tg.Batches(tg.make_corpus(config.corpus_chars, config.seed), config))
    log = BatchLog(256, max_bytes=1 << 30)
    for i in range(300):  # fill it: the timed steps also drop the oldest entry
        log.remember(step=i, batch_index=i, batch=batches[i % len(batches)])
    t0 = time.thread_time_ns()
    for i in range(300, 300 + steps):
        log.remember(step=i, batch_index=i, batch=batches[i % len(batches)])
    print(f"{'batch log (runbook default)':<40} {(time.thread_time_ns() - t0) / steps / 1e3:.1f} us/step, "
          f"{log.bytes / 2**20:.2f} MiB of batches kept")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="monitored vs unmonitored step time on the tiny GPT")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--block", type=int, default=20, help="steps per timed block (one flush per block)")
    args = p.parse_args(argv)
    tg = load_tiny_gpt()
    torch.set_num_threads(tg.TrainConfig.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), tiny GPT stable setting, clip 1.0, "
        f"{args.rounds} interleaved rounds x {args.block} steps; CPU = process time (robust to other load), "
        f"wall = perf_counter"
    )
    defaults = MonitorConfig(clip=1.0, hang_timeout=None)
    everything = MonitorConfig(
        clip=1.0,
        hang_timeout=None,
        activations=ActivationConfig(every=1),
        embeddings=EmbeddingConfig(every=1),
    )
    lead = MonitorConfig(clip=1.0, hang_timeout=None, moments=MomentConfig(every=10),
                         attention=AttentionConfig(every=10), logits=LogitConfig(every=10))
    a = measure(tg, "(a) defaults, store=None", defaults, rounds=args.rounds, block=args.block)
    b = measure(
        tg, "(b) every signal every step, store=None", everything, rounds=args.rounds, block=args.block
    )
    with tempfile.TemporaryDirectory() as tmp:
        measure(
            tg,
            "(c) defaults, SQLite store",
            defaults,
            rounds=args.rounds,
            block=args.block,
            store=f"sqlite:///{tmp}/overhead.db",
        )
    measure(tg, "(d) defaults + signals with lead every 10 steps", lead, rounds=args.rounds, block=args.block)
    watching = dataclasses.replace(defaults, flush_every=defaults.watch.flush_every)
    measure(tg, "(e) defaults in a watch window (a flush every 4 steps)", watching, rounds=args.rounds,
            block=args.block)
    print(
        f"targets: (a) <= 1.01 {'met' if a <= 1.01 else 'NOT met'}; "
        f"(b) <= 1.05 {'met' if b <= 1.05 else 'NOT met'}"
    )
    print("isolated (the monitor's own work, timed inside it; insensitive to A/B drift):")
    isolated(tg, "(a) defaults", defaults, steps=args.rounds * args.block)
    isolated(tg, "(a) defaults without the per-layer update ratios (updates.every=0)",
             dataclasses.replace(defaults, updates=UpdateConfig(every=0)), steps=args.rounds * args.block)
    with tempfile.TemporaryDirectory() as tmp:  # checkpoints to diagnose from (none saved): the batch log is kept
        isolated(tg, "(a) + runbook default's batch log", dataclasses.replace(defaults, checkpoint_every=0),
                 steps=args.rounds * args.block, checkpoint_dir=tmp, runbook="default")
    batch_log(tg, steps=args.rounds * args.block)
    isolated(tg, "(b) every signal every step", everything, steps=args.rounds * args.block)
    isolated(tg, "(d) defaults + signals with lead every 10 steps", lead, steps=args.rounds * args.block)
    isolated(tg, "(e) defaults in a watch window (a flush every 4 steps)", watching, steps=args.rounds * args.block)


if __name__ == "__main__":
    main()
