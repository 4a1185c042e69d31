"""A rank killed under ``torchrun --max-restarts 1`` (2 gloo ranks, DDP, CPU): the survivor says in one line that
its peer is gone and prints no stabmon traceback, the agent restarts both, and the run resumes on every rank from
the newest checkpoint step they all hold, each step stored once.

Before, the survivor printed three stabmon tracebacks on its way out (the flush's read-back through the
failsafe's ``log.exception``, the flush's broadcast through the training loop, and ``close()`` at exit), and a
rank killed right after its peer had saved a checkpoint it never reached made the restart fail: each rank
resumed from its own newest checkpoint (rank 0 from step 15, rank 1 from step 10) and their collectives no longer
lined up.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from dist_support import free_port

REPO = Path(__file__).resolve().parent.parent
STEPS = 30

JOB = r'''
import os, signal, sys, time
import torch
import torch.distributed as dist
from torch import nn
import stabmon
from stabmon.collect.config import HANG_EXIT_CODE, HangConfig
from stabmon.monitor import Monitor, MonitorConfig

root, db, where = sys.argv[1], sys.argv[2], sys.argv[5]
victim, kill_at, steps = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[6])
import faulthandler
faulthandler.dump_traceback_later(150, exit=True)  # a worker stuck anywhere shows where
stabmon.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ckpt = os.path.join(root, f"ckpt-rank{rank}")
found = stabmon.resume_checkpoint(ckpt)  # the newest step every rank holds, on every rank
state = found[1] if found is not None else None
hang = HangConfig(factor=5.0, floor=2.0 + 3.0 * rank, learn_after=5, exit_code=HANG_EXIT_CODE)
mon = Monitor(model, opt, store=db, run_name="torchrun-peer-lost", checkpoint_dir=ckpt,
              resume_run_id=state["monitor"]["run_id"] if state else None,
              config=MonitorConfig(flush_every=5, checkpoint_every=5, hang_timeout=60.0, hang=hang))
if state is not None:
    mon.load_training_state(state)
print(f"rank {rank} attempt {attempt} starts at step {mon.step}", flush=True)
g = torch.Generator().manual_seed(rank)
data = [torch.randn(8, 4, generator=g) for _ in range(steps)]
dies = attempt == 0 and rank == victim
for step, x in mon.steps(data):
    time.sleep(0.02)
    if dies and step == kill_at and where == "before_step":  # its peer then waits in DDP's all-reduce
        os.kill(os.getpid(), signal.SIGKILL)
    loss = model(x).pow(2).mean()
    loss.backward()
    mon.observe(loss=loss)
    opt.step()
    opt.zero_grad()
    if dies and step == kill_at and where == "after_step":  # its peer then waits in the monitor's flush
        os.kill(os.getpid(), signal.SIGKILL)
mon.close()
print(f"rank {rank} attempt {attempt} ends at step {mon.step}", flush=True)
dist.destroy_process_group()
sys.exit(mon.exit_code)
'''

STABMON_FRAME = re.compile(r'File "[^"]*/stabmon/')


def _logs(logs: Path) -> dict[tuple[int, int, str], str]:
    """(attempt, rank, "stdout"/"stderr") -> the text torchrun's ``--redirects`` wrote."""
    out = {}
    for path in logs.rglob("*.log"):
        attempt, rank = int(path.parent.parent.name.split("_")[1]), int(path.parent.name)
        out[(attempt, rank, path.stem)] = path.read_text()
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("victim", "kill_at", "where"), [
    (1, 12, "before_step"),  # rank 0 learns of it in DDP's all-reduce (its own traceback, not stabmon's)
    (1, 14, "after_step"),  # rank 0 learns of it in the monitor's flush, after saving step 15 that rank 1 never did
    (0, 14, "after_step"),  # the rank that writes the store dies; rank 1 learns of it in the monitor's flush
])
def test_a_killed_rank_leaves_no_stabmon_traceback_and_the_job_resumes_every_step_once(
    tmp_path: Path, victim: int, kill_at: int, where: str,
) -> None:
    (tmp_path / "job.py").write_text(JOB)
    db = tmp_path / "stabmon.db"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=stabmon-peer-lost",
           "--monitor-interval=0.5", "--redirects=3", f"--log-dir={tmp_path / 'logs'}",
           "job.py", str(tmp_path), f"sqlite:///{db}", str(victim), str(kill_at), where, str(STEPS)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=420, env=env)
    logs = _logs(tmp_path / "logs")
    every = proc.stdout + proc.stderr + "".join(f"\n== {k}\n{v}" for k, v in sorted(logs.items()))
    for key, text in logs.items():
        assert not STABMON_FRAME.search(text), (key, text)  # no traceback runs through stabmon, on any rank
    said = logs[(0, 1 - victim, "stderr")]  # the survivor's: one line says why
    assert len(re.findall(r"stabmon: rank \d: .* failed, another rank is gone", said)) == 1, said
    assert proc.returncode == 0, every[-6000:]
    assert "(exitcode: -9)" in proc.stdout + proc.stderr, every[-6000:]  # the agent saw the kill
    for rank in (0, 1):  # every rank resumed from the step both ranks hold, and trained to the end
        assert "attempt 1 starts at step 10" in logs[(1, rank, "stdout")], every[-6000:]
        assert f"rank {rank} attempt 1 ends at step {STEPS}" in logs[(1, rank, "stdout")], every[-6000:]
    with sqlite3.connect(db) as conn:
        runs = conn.execute("select status from runs").fetchall()
        steps = [s for (s,) in conn.execute("select step from steps order by seq")]
    assert runs == [("finished",)], runs  # the restart continued the same run
    if victim != 0:  # the rank that writes the store lived on: every step is stored once, in order
        assert steps == list(range(STEPS)), steps
    else:  # rows its writer thread had not committed yet (flush_interval) died with it; none is stored twice
        assert steps == sorted(set(steps)) and steps[-(STEPS - 10):] == list(range(10, STEPS)), steps
