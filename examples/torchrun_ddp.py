"""A 2-rank DDP job under torchrun, monitored, that survives a killed or frozen rank.

Runs on CPU with gloo (pass ``--backend nccl`` on GPUs)::

    torchrun --nproc-per-node 2 --max-restarts 1 examples/torchrun_ddp.py
    torchrun --nproc-per-node 2 --max-restarts 1 examples/torchrun_ddp.py --kill-rank 1 --kill-at 25
    torchrun --nproc-per-node 2 --max-restarts 1 examples/torchrun_ddp.py --freeze-rank 1 --freeze-at 30 --step-time 1
    stabmon trace                     # the newest run: the kill or the hang, the restart, the resume

What it shows: ``stabmon.init_process_group`` (each restart attempt's rendezvous keys apart from the last one's),
checkpoints every 10 steps per rank, ``stabmon.resume_checkpoint`` (the newest step every rank holds, on every
rank) and a resumed run that continues the same run in the store, data drawn through ``monitor.steps`` (so a resume
starts at the checkpoint's batch: no step lost or trained twice), and the hang watchdog with its default deadline
(learned from the step times, at least 40 s) ending a hung attempt with exit code 87 so that torchrun restarts it.
``--kill-rank R --kill-at S`` kills rank R at step S once (SIGKILL, the first attempt only); ``--freeze-rank R
--freeze-at S`` stops it (SIGSTOP: a frozen process, which reports nothing itself; rank 0 names it). Rank 0 prints
the final weights' SHA-256: a run that was killed and resumed prints the same one as a run that was not.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import stabmon
from stabmon import HANG_EXIT_CODE, HangConfig, MonitorConfig


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-time", type=float, default=0.0, help="seconds of simulated work per step")
    p.add_argument("--out-dir", default="out-torchrun-ddp")
    p.add_argument("--db", default="sqlite:///stabmon.db", help="the monitor's store URL (rank 0 writes it)")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--kill-rank", type=int, default=None)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--freeze-rank", type=int, default=None)
    p.add_argument("--freeze-at", type=int, default=None)
    return p.parse_args()


def batch(index: int, rank: int) -> torch.Tensor:
    """Batch ``index`` of this rank: the same tensor whenever it is drawn (a resume redraws the same data)."""
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * rank + index))


def main() -> int:
    args = parse()
    stabmon.init_process_group(args.backend)
    rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    checkpoints = os.path.join(args.out_dir, f"rank{rank}")
    resumed = stabmon.resume_checkpoint(checkpoints)  # None on a first attempt
    state = resumed[1] if resumed is not None else None
    monitor = stabmon.Monitor(
        model, optimizer, store=args.db, run_name="torchrun-ddp", checkpoint_dir=checkpoints,
        resume_run_id=state["monitor"]["run_id"] if state is not None else None,
        config=MonitorConfig(flush_every=5, checkpoint_every=10, hang=HangConfig(exit_code=HANG_EXIT_CODE)),
    )
    if state is not None:
        monitor.load_training_state(state)
    print(f"rank {rank} attempt {attempt} starts at step {monitor.step}", flush=True)
    data = [batch(i, rank) for i in range(args.steps)]
    for step, x in monitor.steps(data):
        if attempt == 0 and rank == args.kill_rank and step == args.kill_at:
            print(f"rank {rank} killed at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if attempt == 0 and rank == args.freeze_rank and step == args.freeze_at:
            print(f"rank {rank} frozen at step {step} (pid {os.getpid()})", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(args.step_time)
        loss = model(x).pow(2).mean()
        loss.backward()
        monitor.observe(loss=loss)
        optimizer.step()  # no clipping here: the monitor clips by the global norm when config.clip is set
        optimizer.zero_grad()
    monitor.close()
    if rank == 0:
        weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        print(f"final step {monitor.step} weights {hashlib.sha256(weights).hexdigest()[:16]}", flush=True)
    dist.destroy_process_group()
    return monitor.exit_code


if __name__ == "__main__":
    sys.exit(main())
