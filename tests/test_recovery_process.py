"""Across processes, with the real Monitor, detectors, engine, executor and SQLite store:

* resume: the training process is killed after an intervention; a new process resumes from the checkpoint
  with the override still in force, without a duplicate intervention and without the old evidence firing
  again;
* propose mode: `stabmon approve` from another process while training runs; the change lands at the next
  flush.

The training loop (a small regression model under a LambdaLR schedule) makes its own gradient spikes: on a few
scripted steps the loss is multiplied by a large factor, which the real grad-norm spike detector catches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

RUNBOOK = """\
name: process-test
mode: {mode}
cooldown: 10
approval: {{timeout: 100000, on_timeout: expire}}
rules:
  - name: grad_spikes
    when: {{kind: spike, metric: grad_norm, severity: warning}}
    ladder:
      - action: scale_lr
        params: {{factor: 0.5}}
        observe: 30
        success: {{quiet_steps: 10}}
      - action: set_clip
        params: {{max_norm: 0.5}}
        observe: 30
"""

CHILD = r'''
import json, os, sys, time
import torch
from stabmon.checkpoints import CheckpointManager
from stabmon.events import Decision, to_dict
from stabmon.monitor import Monitor, MonitorConfig

args = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s / 200))
g = torch.Generator().manual_seed(1)
w = torch.randn(8, 1, generator=g)
data = []
for i in range(400):
    x = torch.randn(32, 8, generator=g)
    data.append((x, x @ w))
mon = Monitor(model, opt, scheduler=sched, store=args["db"], runbook=args["runbook"], mode=args["mode"],
              detectors={"spike": {"grace_period": 10}, "robust_spike": {"grace_period": 10}},
              checkpoint_dir=args["ckpt"], run_name="process-test", resume_run_id=args.get("resume"),
              config=MonitorConfig(flush_every=5, checkpoint_every=5, hang_timeout=None))
flushes = []  # the steps the monitor flushed at (answers are picked up there)
flush = mon.flush
mon.flush = lambda: (flushes.append(mon.step), flush())[1]
if args.get("resume"):
    info, state = CheckpointManager(args["ckpt"]).last_known_good()
    mon.load_training_state(state)
    print(json.dumps({"resumed_from": info.step, "lr_scale": mon.overrides.lr_scale}), flush=True)
print(json.dumps({"run_id": mon.run_id}), flush=True)
used = []
def probe(o, a, k):
    used.append((mon.step, o.param_groups[0]["lr"], sched.get_last_lr()[0]))
opt.register_step_pre_hook(probe)
landed = None
for step, (x, y) in mon.steps(data, max_steps=args["max_steps"]):
    loss = (model(x) - y).pow(2).mean()
    if step in args["spikes"]:
        loss = loss * 1e4
    loss.backward()
    mon.observe(loss=loss)
    opt.step(); sched.step(); opt.zero_grad()
    if args.get("sleep"):
        time.sleep(args["sleep"])
    if landed is None and mon.overrides.lr_scale != 1.0:
        landed = mon.step
    if args.get("kill_at") is not None and mon.step == args["kill_at"]:
        print(json.dumps({"events": [to_dict(e) for e in mon.events], "used": used}), flush=True)
        os._exit(137)  # killed: no close(), no final flush
    if args["mode"] == "propose" and landed is not None and mon.step >= landed + 5:
        break
mon.close()
print(json.dumps({"events": [to_dict(e) for e in mon.events], "used": used, "landed": landed,
                  "lr_scale": mon.overrides.lr_scale, "step": mon.step, "flushes": flushes}), flush=True)
'''


def launch(tmp_path: Path, **args: Any) -> subprocess.Popen[str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(script), json.dumps(args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)


def finish(proc: subprocess.Popen[str], timeout: float = 300) -> tuple[int, list[dict[str, Any]], str]:
    out, err = proc.communicate(timeout=timeout)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return proc.returncode, lines, err


def merged(lines: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for line in lines:
        out.update(line)
    return out


def decisions(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "Decision"]


def test_resume_after_a_kill_keeps_the_override_and_does_not_repeat(tmp_path: Path, sqlite_url: str) -> None:
    rb = tmp_path / "rb.yaml"
    rb.write_text(RUNBOOK.format(mode="apply"))
    common = {"db": sqlite_url, "runbook": str(rb), "mode": "apply", "ckpt": str(tmp_path / "ckpt"),
              "spikes": [30, 31, 32, 33, 34]}
    rc, lines, err = finish(launch(tmp_path, **common, max_steps=200, kill_at=43))
    assert rc == 137, err
    first = merged(lines)
    applied = decisions(first["events"])
    assert [(d["action"], d["status"]) for d in applied] == [("scale_lr", "apply")], err
    assert 30 <= applied[0]["step"] <= 40  # decided at the flush after the spikes
    assert any(e["type"] == "InterventionRecord" and e["after"]["lr_scale"] == 0.5 for e in first["events"])

    # after the resume a new spike comes at step 55, while the restored engine still observes the first change
    common["spikes"] = [*common["spikes"], 55]
    rc, lines, err = finish(launch(tmp_path, **common, max_steps=120, resume=first["run_id"]))
    assert rc == 0, err
    second = merged(lines)
    resumed = next(line for line in lines if "resumed_from" in line)
    assert resumed["resumed_from"] == 40 and resumed["lr_scale"] == 0.5  # the override came back with the state
    assert second["run_id"] == first["run_id"]
    events = second["events"]
    # the restored engine goes on with the incident it was in: no duplicate of the first change, and no second
    # change while it is observed. The new spike falls in that change's window (the checkpoint of step 40 holds
    # the engine that judged steps up to 39, as the live run had them), so the change is judged failed: reverted,
    # then the next rung, each decision of the same incident
    made = decisions(events)
    assert "scale_lr" not in [d["action"] for d in made], made
    assert made and {d["incident_id"] for d in made} == {applied[0]["incident_id"]}, made
    assert made[0]["action"] == "revert" and made[0]["params"]["intervention_id"] == next(
        e["id"] for e in first["events"] if e["type"] == "InterventionRecord")
    # every step after the resume, until the first change was judged, used half the scheduler's learning rate
    before = [(lr, sched_lr) for step, lr, sched_lr in second["used"] if step <= made[0]["step"]]
    assert before and all(lr == pytest.approx(0.5 * sched_lr, rel=1e-9) for lr, sched_lr in before)
    spikes = [e["step"] for e in events if e["type"] == "Anomaly" and e["metric"] == "grad_norm"]
    assert spikes and min(spikes) >= 55  # the new spike is seen; the old evidence does not fire again
    outcomes = [e for e in events if e["type"] == "Outcome"]
    assert outcomes[0]["decision_id"] == applied[0]["id"]  # the first change's outcome comes after the resume


def test_approve_from_another_process_lands_at_the_next_flush(tmp_path: Path, sqlite_url: str) -> None:
    from stabmon.store import open_store, repo

    rb = tmp_path / "rb.yaml"
    rb.write_text(RUNBOOK.format(mode="propose"))
    proc = launch(tmp_path, db=sqlite_url, runbook=str(rb), mode="propose", ckpt=str(tmp_path / "ckpt"),
                  spikes=[30, 31, 32, 33, 34], max_steps=3000, sleep=0.01)
    try:
        run_id = json.loads(proc.stdout.readline())["run_id"]  # type: ignore[union-attr]
        store = open_store(sqlite_url)
        deadline, pending = time.monotonic() + 240, []
        while not pending and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            with store.session() as s:
                pending = repo.pending_answers(session=s, run_id=run_id)
        store.close()
        assert pending, "no proposal appeared"
        proposal = pending[0].decision
        assert proposal.action == "scale_lr"
        cli = subprocess.run([sys.executable, "-m", "stabmon.cli", "approve", run_id, proposal.id, "--db",
                              sqlite_url, "--by", "tester"], capture_output=True, text=True, timeout=120)
        assert cli.returncode == 0, cli.stderr
        assert cli.stdout.startswith(f"approved {proposal.id}")
        rc, lines, err = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, err
    result = merged(lines)
    ds = decisions(result["events"])
    assert [(d["id"], d["status"]) for d in ds] == [(proposal.id, "proposed"), (proposal.id, "approved")]
    approved_at = ds[1]["step"]
    # picked up at a flush: every 5 steps, every 4 while the proposal's incident is open (MonitorConfig.watch)
    assert approved_at > proposal.step and approved_at in result["flushes"], (approved_at, result["flushes"])
    assert result["landed"] == approved_at and result["lr_scale"] == 0.5
    before = [lr / s for step, lr, s in result["used"] if step < approved_at]
    after = [lr / s for step, lr, s in result["used"] if step >= approved_at]
    assert before and all(r == pytest.approx(1.0) for r in before)
    assert after and all(r == pytest.approx(0.5) for r in after)
