"""Where fp16 + GradScaler costs the monitor more than bf16: the passes over the gradients per step, profiled.

On a GPU the monitor's cost is the extra device work per step; the part that grows with the model is every pass
over all gradients (or parameters). This script profiles ``--steps`` steps of a small GPT (the model of
``benchmarks/gpu.py``, fp32 compute so the CPU profile is not dominated by slow low-precision matmuls: the
scaler's and the monitor's work does not depend on the autocast dtype) with ``torch.profiler`` and counts, per
step, the calls of every operator that touches all gradients or parameters, for four loops:

  no scaler (as bf16): unmonitored (``clip_grad_norm_`` + ``opt.step()``) and monitored (the README loop);
  GradScaler (fp16):   unmonitored (``scaler.unscale_`` + ``clip_grad_norm_`` + ``scaler.step``) and monitored.

It prints the per-step counts side by side and the profiled CPU time of the whole step. Run it against an older
checkout to see what changed (``PYTHONPATH=old-checkout python benchmarks/amp.py``)::

    python benchmarks/amp.py --optimizer fused
    python benchmarks/amp.py --optimizer foreach
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

WATCHED = (
    "aten::_amp_foreach_non_finite_check_and_unscale_",
    "aten::_foreach_norm",
    "aten::_foreach_mul_",
    "aten::_fused_adamw_",
    "aten::_foreach_add_",
    "aten::_foreach_lerp_",
    "aten::_foreach_copy_",
    "aten::clone",
    "aten::where",
)
"""Operators that run over all gradients, parameters or optimizer state (foreach / fused), or one tensor at a
time (clone, where)."""


def load_gpu_benchmark() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_benchmark", Path(__file__).with_name("gpu.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_benchmark"] = module
    spec.loader.exec_module(module)
    return module


class Loop:
    def __init__(self, gpu: Any, preset: Any, *, optimizer: str, scaler: bool, monitored: bool) -> None:
        from stabmon.monitor import Monitor, MonitorConfig

        torch.manual_seed(0)
        self.model = gpu.GPT(preset)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=6e-4, weight_decay=0.1, **{optimizer: True})
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None
        self.mon = None
        if monitored:
            config = MonitorConfig(clip=1.0, hang_timeout=None)
            self.mon = Monitor(self.model, self.opt, scaler=self.scaler, store=None, config=config)
        g = torch.Generator().manual_seed(0)
        self.batch = [torch.randint(0, preset.vocab, (preset.batch, preset.block_size), generator=g) for _ in "xy"]

    def step(self) -> None:
        mon, opt, scaler = self.mon, self.opt, self.scaler
        if mon is not None:
            mon.begin_step()
        loss = self.model(*self.batch)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if mon is not None:
            mon.observe(loss=loss)
        else:
            if scaler is not None:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if mon is not None:
            mon.end_step()


def profile_loop(loop: Loop, steps: int) -> tuple[dict[str, float], float]:
    for _ in range(12):  # past the optimizer state's creation and a sampled step
        loop.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            loop.step()
    events = prof.key_averages()
    counts = {name: 0.0 for name in WATCHED}
    for e in events:
        if e.key in counts:
            counts[e.key] = e.count / steps
    total_us = sum(e.self_cpu_time_total for e in events) / steps
    return counts, total_us


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="passes over the gradients per step, fp16+GradScaler vs bf16")
    ap.add_argument("--optimizer", choices=("fused", "foreach"), default="fused")
    ap.add_argument("--steps", type=int, default=20, help="profiled steps per loop (10 = one sampled step)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    gpu = load_gpu_benchmark()
    preset = gpu.Preset(n_layer=4, n_head=4, n_embd=128, vocab=512, block_size=64, batch=4)
    columns = [
        ("no scaler, unmonitored", False, False),
        ("no scaler, monitored", False, True),
        ("GradScaler, unmonitored", True, False),
        ("GradScaler, monitored", True, True),
    ]
    results = []
    for _, scaler, monitored in columns:
        loop = Loop(gpu, preset, optimizer=args.optimizer, scaler=scaler, monitored=monitored)
        results.append(profile_loop(loop, args.steps))
        if loop.mon is not None:
            loop.mon.close()
    print(f"torch {torch.__version__}, {args.optimizer} AdamW, clip 1.0, {args.steps} profiled steps; calls per step")
    print(f"{'operator':<52}" + "".join(f"{c[0]:>26}" for c in columns))
    for name in WATCHED:
        if any(r[0][name] for r in results):
            print(f"{name:<52}" + "".join(f"{r[0][name]:>26.2f}" for r in results))
    print(f"{'profiled CPU time per step (ms)':<52}" + "".join(f"{r[1] / 1e3:>26.2f}" for r in results))
    print(
        f"monitored/unmonitored (profiled CPU time): no scaler {results[1][1] / results[0][1]:.3f}, "
        f"GradScaler {results[3][1] / results[2][1]:.3f}"
    )


if __name__ == "__main__":
    main()
