"""The monitor on a GPT-2-sized model: step-time ratios, host syncs, peak memory and compile graph breaks.

One script for a developer with a CUDA GPU (under 5 minutes on one H100/H200-class device) that also runs a tiny
version on CPU (``--tiny``), which the test suite runs so that it cannot rot.

Model: nanoGPT's GPT-2 124M (12 layers, 12 heads, 768 wide, vocabulary 50304, context 1024), batch 16, fused
AdamW (lr 6e-4, weight decay 0.1), clip 1.0, autocast. ``--tiny``: 2 layers, 2 heads, 32 wide, vocabulary 64,
context 16, batch 2. Each arm runs in its own process and compares the unmonitored loop (A: clips with
``clip_grad_norm_(foreach=True)``, after ``scaler.unscale_`` under fp16) with the loop of the README's quick
start (B: the monitor clips in its optimizer hook):

  bf16-defaults      bf16 autocast, monitor defaults, store=None
  bf16-sqlite        the same with a real SQLite store (background writer)
  bf16-every-signal  activation and embedding sampling every step
  bf16-skip-guard    defaults + the skip_step guard on (factor 5)
  bf16-lead-signals  defaults + the signals with lead (second-moment ratio, attention logits, output-logit scale)
                     sampled every 10 steps
  fp16-scaler        fp16 autocast + GradScaler, defaults
  bf16-compile       torch.compile'd model (inductor on CUDA, ``--compile-backend``), defaults

For each arm: the median over ``--rounds`` of B/A step time (wall; on CPU also process CPU time, which other
load on a shared machine disturbs less) in interleaved blocks of ``--block`` steps
(A B, B A, ...; a device synchronize around each block); host syncs during B's timed steps outside its flushes,
counted with ``torch.cuda.set_sync_debug_mode("warn")`` (and A's for reference); peak device memory of A alone
and of B alone (each measured before the other is built, peak stats reset); what the monitor keeps on the device
per signal (:meth:`stabmon.monitor.Monitor.device_memory`) against the parameter + gradient + optimizer-state
bytes; for the compile arm, the graph breaks and graphs dynamo reported. It prints a table and writes JSON::

    python benchmarks/gpu.py                       # CUDA, GPT-2 124M, all arms
    python benchmarks/gpu.py --tiny                # CPU smoke run (seconds per arm)
    python benchmarks/gpu.py --arms bf16-skip-guard fp16-scaler --rounds 9
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class Preset:
    n_layer: int
    n_head: int
    n_embd: int
    vocab: int
    block_size: int
    batch: int


PRESETS = {
    "gpt2": Preset(n_layer=12, n_head=12, n_embd=768, vocab=50304, block_size=1024, batch=16),
    "tiny": Preset(n_layer=2, n_head=2, n_embd=32, vocab=64, block_size=16, batch=2),
}


@dataclass(frozen=True)
class Arm:
    dtype: str = "bf16"
    store: bool = False
    every_signal: bool = False
    skip_factor: float | None = None
    compile: bool = False
    lead_signals: bool = False
    snapshots: int = 0
    """MonitorConfig.snapshots every this many steps (2 kept): the host-memory snapshot tier's cost."""


ARMS = {
    "bf16-defaults": Arm(),
    "bf16-sqlite": Arm(store=True),
    "bf16-every-signal": Arm(every_signal=True),
    "bf16-skip-guard": Arm(skip_factor=5.0),
    "bf16-lead-signals": Arm(lead_signals=True),
    "fp16-scaler": Arm(dtype="fp16"),
    "bf16-compile": Arm(compile=True),
    "bf16-snapshots": Arm(snapshots=10),
}


# -- the model (nanoGPT) ---------------------------------------------------------------------------------
class SelfAttention(nn.Module):
    def __init__(self, p: Preset) -> None:
        super().__init__()
        self.n_head = p.n_head
        self.c_attn = nn.Linear(p.n_embd, 3 * p.n_embd)
        self.c_proj = nn.Linear(p.n_embd, p.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, p: Preset) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(p.n_embd), SelfAttention(p)
        self.ln_2 = nn.LayerNorm(p.n_embd)
        self.mlp = nn.Sequential(nn.Linear(p.n_embd, 4 * p.n_embd), nn.GELU(), nn.Linear(4 * p.n_embd, p.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, p: Preset) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(p.vocab, p.n_embd), nn.Embedding(p.block_size, p.n_embd)
        self.h = nn.ModuleList([Block(p) for _ in range(p.n_layer)])
        self.ln_f = nn.LayerNorm(p.n_embd)
        self.lm_head = nn.Linear(p.n_embd, p.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as nanoGPT
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# -- one training loop -----------------------------------------------------------------------------------
@dataclass
class Settings:
    preset: Preset
    device: str
    rounds: int
    block: int
    warmup: int
    compile_backend: str
    store_dir: str = ""


class Loop:
    """One model + fused AdamW (+ GradScaler), unmonitored or monitored, stepping over fixed batches."""

    def __init__(self, arm: Arm, s: Settings, *, monitored: bool, batches: list[tuple[torch.Tensor, ...]]) -> None:
        from stabmon.collect.config import AttentionConfig, LogitConfig, MomentConfig, SnapshotConfig
        from stabmon.monitor import ActivationConfig, EmbeddingConfig, Monitor, MonitorConfig

        torch.manual_seed(0)
        self.device, self.batches, self.i = s.device, batches, 0
        self.model = GPT(s.preset).to(s.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=6e-4, weight_decay=0.1, fused=True)
        self.dtype = torch.float16 if arm.dtype == "fp16" else torch.bfloat16
        self.scaler = torch.amp.GradScaler(s.device) if arm.dtype == "fp16" else None
        self.forward: Callable[..., torch.Tensor] = self.model
        if arm.compile:
            self.forward = torch.compile(self.model, backend=s.compile_backend)  # type: ignore[assignment]
        self.mon: Any = None
        if monitored:
            every = 1 if arm.every_signal else 10
            config = MonitorConfig(
                clip=1.0,
                hang_timeout=None,
                activations=ActivationConfig(every=every),
                embeddings=EmbeddingConfig(every=every),
                **({"moments": MomentConfig(every=10), "attention": AttentionConfig(every=10),
                    "logits": LogitConfig(every=10)} if arm.lead_signals else {}),
            )
            store = f"sqlite:///{s.store_dir}/gpu-benchmark.db" if arm.store else None
            tier: dict[str, Any] = {}
            if arm.snapshots:  # snapshots sit in front of a checkpoint store (none saved to disk while timed)
                config.snapshots = SnapshotConfig(every=arm.snapshots, keep=2)
                config.checkpoint_every = 0
                tier["checkpoint_dir"] = tempfile.mkdtemp(dir=s.store_dir)
            self.mon = Monitor(
                self.model, self.opt, scaler=self.scaler, store=store, config=config, run_name="gpu-benchmark",
                **tier,
            )
            self.mon.overrides.skip_factor = arm.skip_factor

    def step(self) -> None:
        mon, opt, scaler = self.mon, self.opt, self.scaler
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        if mon is not None:
            mon.begin_step(batch_index=self.i)
        with torch.autocast(self.device, dtype=self.dtype):
            loss = self.forward(x, y)
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

    def close(self) -> None:
        if self.mon is not None:
            self.mon.close()


# -- measurements ----------------------------------------------------------------------------------------
def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@dataclass
class SyncCount:
    """Host syncs reported by ``set_sync_debug_mode("warn")`` while counting (CUDA only)."""

    device: str
    count: int = 0
    _paused: bool = field(default=False, repr=False)

    @contextmanager
    def counting(self) -> Iterator[None]:
        if self.device != "cuda":
            yield
            return
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(0)
        self.count += sum("synchroniz" in str(w.message) for w in seen)

    def exclude_flushes(self, mon: Any) -> None:
        """Flushes sync by design (one copy per flush): switch the debug mode off around them."""
        flush = mon.flush

        def quiet_flush() -> Any:
            torch.cuda.set_sync_debug_mode(0)
            try:
                return flush()
            finally:
                torch.cuda.set_sync_debug_mode("warn")

        if self.device == "cuda":
            mon.flush = quiet_flush


def timed_block(loop: Loop, n: int, syncs: SyncCount) -> tuple[float, float]:
    """(wall, process CPU) seconds per step over ``n`` steps."""
    synchronize(loop.device)
    t0, c0 = time.perf_counter(), time.process_time()
    with syncs.counting():
        for _ in range(n):
            loop.step()
    synchronize(loop.device)
    return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


def peak_alone(arm: Arm, s: Settings, batches: list[Any], *, monitored: bool) -> dict[str, Any]:
    """Peak device memory of one loop built and run alone; the monitor's own device bytes per signal."""
    if s.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if s.device == "cuda" else 0
    loop = Loop(arm, s, monitored=monitored, batches=batches)
    for _ in range(max(s.warmup, 11)):  # past the first sampled step and the optimizer state's creation
        loop.step()
    synchronize(s.device)
    out: dict[str, Any] = {"peak_bytes": torch.cuda.max_memory_allocated() - base if s.device == "cuda" else None}
    params = list(loop.model.parameters())
    state = [v for st in loop.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    out["model_optimizer_bytes"] = sum(p.numel() * p.element_size() * 2 for p in params) + sum(
        t.numel() * t.element_size() for t in state
    )  # parameters, gradients, optimizer state
    if loop.mon is not None:
        out["monitor_device"] = asdict(loop.mon.device_memory())
        held = loop.mon.snapshots.candidates() if loop.mon.snapshots is not None else []
        out["snapshot_host_bytes"] = sum(c.nbytes for c in held) if held else None
    loop.close()
    del loop
    return out


def compile_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
    }


def run_arm(name: str, s: Settings) -> dict[str, Any]:
    arm = ARMS[name]
    p = s.preset
    g = torch.Generator().manual_seed(0)
    batches = [
        tuple(torch.randint(0, p.vocab, (p.batch, p.block_size), generator=g).to(s.device) for _ in range(2))
        for _ in range(4)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        s.store_dir = tmp
        mem_a = peak_alone(arm, s, batches, monitored=False)
        mem_b = peak_alone(arm, s, batches, monitored=True)
        if arm.compile:
            torch._dynamo.reset()
        a = Loop(arm, s, monitored=False, batches=batches)
        b = Loop(arm, s, monitored=True, batches=batches)
        sync_a, sync_b = SyncCount(s.device), SyncCount(s.device)
        sync_b.exclude_flushes(b.mon)
        for loop in (a, b):
            for _ in range(s.warmup):
                loop.step()
        ratios, cpu_ratios, ms_a, ms_b = [], [], [], []
        for r in range(s.rounds):
            order = (a, b) if r % 2 == 0 else (b, a)
            times = {id(loop): timed_block(loop, s.block, sync_a if loop is a else sync_b) for loop in order}
            (wall_a, cpu_a), (wall_b, cpu_b) = times[id(a)], times[id(b)]
            ms_a.append(wall_a * 1e3)
            ms_b.append(wall_b * 1e3)
            ratios.append(wall_b / wall_a)
            cpu_ratios.append(cpu_b / cpu_a)
        errors = dict(b.mon.errors)
        a.close()
        b.close()
    out: dict[str, Any] = {
        "arm": name,
        "ms_unmonitored": statistics.median(ms_a),
        "ms_monitored": statistics.median(ms_b),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "cpu_ratio": statistics.median(cpu_ratios),
        "syncs_monitored": sync_b.count if s.device == "cuda" else None,
        "syncs_unmonitored": sync_a.count if s.device == "cuda" else None,
        "peak_bytes_unmonitored": mem_a["peak_bytes"],
        "peak_bytes_monitored": mem_b["peak_bytes"],
        "model_optimizer_bytes": mem_a["model_optimizer_bytes"],
        "monitor_device": mem_b["monitor_device"],
        "snapshot_host_bytes": mem_b.get("snapshot_host_bytes"),
        "monitor_errors": errors,
    }
    if arm.compile:
        out.update(compile_counters())
    return out


# -- driver ----------------------------------------------------------------------------------------------
def spawn(name: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--arm", name, "--device", args.device]
    cmd += ["--preset", args.preset, "--rounds", str(args.rounds), "--block", str(args.block)]
    cmd += ["--warmup", str(args.warmup), "--compile-backend", args.compile_backend]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        return {"arm": name, "error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.0f}"


def _ratio(r: dict[str, Any]) -> str:
    if r["syncs_monitored"] is not None:
        return f"{r['ratio']:.3f}"
    return f"{r['ratio']:.3f} (CPU time {r['cpu_ratio']:.3f})"


def table(results: list[dict[str, Any]], header: str) -> str:
    lines = [
        header,
        "| arm | ms/step unmonitored | ms/step monitored | ratio | syncs outside flushes (unmonitored) "
        "| peak MiB unmonitored / monitored | monitor on device (share of model+optimizer) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['arm']} | failed: {r['error']} | | | | | |")
            continue
        dev = r["monitor_device"]
        total = sum(dev.values())
        share = total / r["model_optimizer_bytes"] * 100
        syncs = "n/a (CPU)" if r["syncs_monitored"] is None else f"{r['syncs_monitored']} ({r['syncs_unmonitored']})"
        extra = f"; {r['graph_breaks']} graph breaks, {r['unique_graphs']} graphs" if "graph_breaks" in r else ""
        if r.get("snapshot_host_bytes"):
            extra += (f"; snapshots hold {_mib(r['snapshot_host_bytes'])} MiB of host memory "
                      f"({r['snapshot_host_bytes'] / r['model_optimizer_bytes']:.2f}x model+optimizer)")
        lines.append(
            f"| {r['arm']}{extra} | {r['ms_unmonitored']:.2f} | {r['ms_monitored']:.2f} | {_ratio(r)} | "
            f"{syncs} | {_mib(r['peak_bytes_unmonitored'])} / {_mib(r['peak_bytes_monitored'])} | "
            f"{total / 2**20:.2f} MiB ({share:.2f}%): " + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in dev.items())
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="monitor overhead, syncs and memory on a GPT-2-sized model")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny preset, 2 rounds of 2 steps")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    ap.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=list(ARMS))
    ap.add_argument("--rounds", type=int, default=None, help="interleaved A/B rounds (default 6; tiny 2)")
    ap.add_argument("--block", type=int, default=None, help="steps per timed block (default 20; tiny 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per loop (default 10; tiny 2)")
    ap.add_argument("--compile-backend", default=None, help="inductor on CUDA, eager on CPU by default")
    ap.add_argument("--json", type=Path, default=Path("gpu-benchmark.json"))
    ap.add_argument("--arm", choices=sorted(ARMS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    args.preset = args.preset or ("tiny" if args.tiny or args.device == "cpu" else "gpt2")
    small = args.preset == "tiny"
    args.rounds = args.rounds or (2 if small else 6)
    args.block = args.block or (2 if small else 20)
    args.warmup = args.warmup if args.warmup is not None else (2 if small else 10)
    args.compile_backend = args.compile_backend or ("inductor" if args.device == "cuda" else "eager")
    if args.arm is not None:
        if args.device == "cpu":
            torch.set_num_threads(1)  # a CPU smoke run: no oversubscription on a shared machine
        settings = Settings(
            PRESETS[args.preset], args.device, args.rounds, args.block, args.warmup, args.compile_backend
        )
        print(json.dumps(run_arm(args.arm, settings)))
        return
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    header = (
        f"torch {torch.__version__} on {device_name}; preset {args.preset} {asdict(PRESETS[args.preset])}; "
        f"fused AdamW, clip 1.0; {args.rounds} interleaved rounds x {args.block} steps; one process per arm"
    )
    results = [spawn(name, args) for name in args.arms]
    print(table(results, header))
    args.json.write_text(json.dumps({"header": header, "arms": results}, indent=1, default=_json_default))
    print(f"wrote {args.json}")


def _json_default(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else str(value)


if __name__ == "__main__":
    main()
