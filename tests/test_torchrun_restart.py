"""The restart recipe of docs/distributed.md, for real: a 2-rank DDP job under ``torchrun --max-restarts 1``
(c10d rendezvous, gloo, CPU) in which rank 1 hangs once. The watchdogs end the first attempt with exit code 87,
the elastic agent restarts both workers, each resumes from its newest checkpoint into the same run in the
store, and the job finishes with exit code 0."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from dist_support import free_port

REPO = Path(__file__).resolve().parent.parent
HANG_AT, STEPS = 12, 30

JOB = r'''
import os, sys, time
import torch
import torch.distributed as dist
from torch import nn
from stabmon.checkpoints import CheckpointManager
from stabmon.collect.config import HANG_EXIT_CODE, HangConfig
from stabmon.collect.cluster.restarts import init_process_group
from stabmon.monitor import Monitor, MonitorConfig

root, db, hang_at, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
import faulthandler
faulthandler.dump_traceback_later(150, exit=True)  # a worker stuck anywhere (rendezvous included) shows where
init_process_group("gloo")  # stabmon's: each restart's rendezvous keys apart from the last one's
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ckpt = os.path.join(root, f"ckpt-rank{rank}")
state = None
if os.path.exists(os.path.join(ckpt, "registry.json")):  # a restart: this rank's newest valid checkpoint
    info, state = CheckpointManager(ckpt).last_known_good()
# rank 0 (stuck in DDP's all-reduce, which rank 1 never joins) gives up first: its exit ends the attempt
hang = HangConfig(factor=5.0, floor=2.0 + 3.0 * rank, learn_after=5, exit_code=HANG_EXIT_CODE)
mon = Monitor(model, opt, store=db, run_name="torchrun-restart", checkpoint_dir=ckpt,
              resume_run_id=state["monitor"]["run_id"] if state else None,
              config=MonitorConfig(flush_every=5, checkpoint_every=5, hang_timeout=60.0, hang=hang))
if state is not None:
    mon.load_training_state(state)
print(f"rank {rank} attempt {attempt} starts at step {mon.step}", flush=True)
g = torch.Generator().manual_seed(rank)
data = [torch.randn(8, 4, generator=g) for _ in range(steps)]
for step, x in mon.steps(data):
    time.sleep(0.02)
    if attempt == 0 and rank == 1 and step == hang_at:
        while True:  # a dead-locked data loader, once
            time.sleep(0.01)
    loss = model(x).pow(2).mean()
    loss.backward()
    mon.observe(loss=loss)
    opt.step()
    opt.zero_grad()
mon.close()
dist.destroy_process_group()
sys.exit(mon.exit_code)
'''


@pytest.mark.slow
def test_a_hung_job_exits_87_restarts_and_resumes_the_same_run(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(JOB)
    db = tmp_path / "stabmon.db"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=stabmon-restart-test",
           "--monitor-interval=0.5", "job.py", str(tmp_path), f"sqlite:///{db}", str(HANG_AT), str(STEPS)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=420, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "rank 0 attempt 1 starts at step 10" in out and "rank 1 attempt 1 starts at step 10" in out, out[-6000:]
    assert "(exitcode: 87)" in out, out[-6000:]  # the agent's record of the first attempt
    with sqlite3.connect(db) as conn:
        runs = conn.execute("select id, status from runs").fetchall()
        steps = [s for (s,) in conn.execute("select step from steps order by seq")]
        hangs = conn.execute("select step, substr(message, 1, 6) from anomalies where kind = 'hang'").fetchall()
    assert len(runs) == 1 and runs[0][1] == "finished", runs  # the restart continued the same run
    # both ranks' stacks stored before the agent stopped the group, each at the last step it completed
    assert sorted(hangs) == [(HANG_AT - 1, "rank 0"), (HANG_AT - 1, "rank 1")], hangs
    # the first attempt's steps, then the second's from the checkpoint at step 10 to the end
    assert sorted(set(steps)) == list(range(STEPS)) and steps[-(STEPS - 10):] == list(range(10, STEPS))
