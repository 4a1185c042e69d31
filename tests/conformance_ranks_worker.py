"""The worker of tests/test_conformance_ranks.py: run under ``torchrun --nproc-per-node 2`` (gloo, CPU), it runs
many cells of the conformance matrix in sequence, each with a fresh model, optimizer and monitor in a folder of
its own, and writes down what the test checks afterwards; nothing here asserts.

``python conformance_ranks_worker.py ROOT PLAN``: PLAN is a JSON list of cells ``{"name", "loop", "action",
"event", "victim"}``; each cell runs in ``ROOT/<name>``. A cell with a ``done`` or a ``failed-rank*`` file is
skipped, so a restarted attempt (``torchrun --max-restarts``) goes on where the last one ended: a cell whose
rank was SIGKILLed (its ``killed`` file) is resumed from ``stabmon.resume_checkpoint(...)``.

A cell's run is a sequence of segments. The first trains from scratch; the event comes the first time step
:data:`EVENT_AT` is reached (``resume``: every rank raises, ``interrupt``: every rank sends itself SIGINT,
``kill``: the victim rank SIGKILLs itself); a run that stopped itself (``checkpoint_and_stop``) or was crashed,
interrupted or killed is resumed in a new segment (fresh objects, a new process after a kill) from the step every
rank holds, until one reaches :data:`STEPS`.

What each rank writes in the cell's folder:

- ``journal-rank<r>.jsonl``: one line per step (``{"seg", "step"}``), per snapshot (``{"snap", "seg", "step",
  "at"}``), per checkpoint file it saw appear (``{"file", "mtime", "snap"}``: the snapshot of the state the run
  went on from), per resume (``{"resume", "path", "mtime", "step"}``) and per segment end (``{"end", "how"}``);
- ``snap-rank<r>-<id>.pt``: the live state (``conformance_support.live_state``, DTensors as the rank's local
  shard) at the start of the first step of a segment, of every step a multiple of ``checkpoint_every``, of the
  first step after a rollback, and at each segment's end; and at any step start where a new checkpoint file
  appeared (``"at": "unplanned"``), and where torchrun's SIGTERM ended the survivor of a kill (``"terminated"``:
  its close may have saved a checkpoint);
  the end line holds the segment's facts: its monitor's step, exit code, run id and intervention records, and
  at the run's end a digest of this rank's tensors and of the full weights.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

STEPS = 80
EVENT_AT = 63
CHECKPOINT_EVERY = 10
SEED = int(os.environ.get("STABMON_TEST_SEED", "0"))


class Crash(RuntimeError):
    """The loop's own failure on every rank (a node lost): the run ends as failed, and is resumed."""


def _config() -> Any:
    from stabmon.collect.config import AttentionConfig, MonitorConfig

    return MonitorConfig(clip=1.0, flush_every=5, checkpoint_every=CHECKPOINT_EVERY,
                         attention=AttentionConfig(every=5))


def _build(loop: str, seed: int) -> tuple[Any, Any, Any, Any]:
    """The wrapped model, the Tiny inside it, AdamW over two param groups (body, head) and a LambdaLR."""
    import torch
    from conformance_support import Tiny

    torch.manual_seed(seed)
    tiny = Tiny()
    if loop == "ddp":
        model: Any = torch.nn.parallel.DistributedDataParallel(tiny)
    else:
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(tiny)  # one unit: one all-gather and one reduce-scatter per step
    body = [*tiny.embed.parameters(), *tiny.attn.parameters()]
    optimizer = torch.optim.AdamW([{"params": body}, {"params": tiny.head.parameters()}], lr=3e-3,
                                  weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    return model, tiny, optimizer, scheduler


def _local(value: Any) -> Any:
    """``value`` with every DTensor replaced by this rank's shard (plain tensors: loadable anywhere)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_local(v) for v in value)
    return value


def _digest(tensors: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].detach().contiguous().numpy().tobytes())
    return h.hexdigest()


class Journal:
    """What one rank writes down about one cell (see the module docstring)."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.folder, self.rank = folder, rank
        self.path = folder / f"journal-rank{rank}.jsonl"
        self.known: set[tuple[str, int]] = set()
        self.count = 0
        if self.path.is_file():  # an earlier attempt's lines: the files it mapped, how many snapshots it took
            for line in self.path.read_text().splitlines():
                entry = json.loads(line)
                if "file" in entry:
                    self.known.add((entry["file"], entry["mtime"]))
                if "snap" in entry and "file" not in entry:
                    self.count += 1

    def write(self, **entry: Any) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(entry, default=str) + "\n")

    def snapshot(self, state: dict[str, Any], *, seg: int, step: int, at: str) -> str:
        import torch

        snap = f"{self.count:04d}"
        self.count += 1
        torch.save(_local(state), self.folder / f"snap-rank{self.rank}-{snap}.pt")
        self.write(snap=snap, seg=seg, step=step, at=at)
        return snap

    def new_files(self, paths: list[str]) -> list[tuple[str, int]]:
        new = []
        for path in paths:
            if os.path.isfile(path):
                key = (path, os.stat(path).st_mtime_ns)
                if key not in self.known:
                    new.append(key)
        return new

    def files(self, keys: list[tuple[str, int]], snap: str) -> None:
        for path, mtime in keys:
            self.known.add((path, mtime))
            self.write(file=path, mtime=mtime, snap=snap)


class Cell:
    """One cell on this rank: its segments, until the run reaches :data:`STEPS`."""

    def __init__(self, root: Path, spec: dict[str, Any], rank: int) -> None:
        self.spec, self.rank = spec, rank
        self.loop, self.action, self.event = spec["loop"], spec["action"], spec["event"]
        self.folder = root / spec["name"]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.shared = spec["layout"] == "shared"
        self.ckpt = self.folder / ("ckpt" if self.shared else f"ckpt-rank{rank}")
        self.saver = rank == 0 or not self.shared
        self.url = f"sqlite:///{self.folder / 'run.db'}"
        self.journal = Journal(self.folder, rank)

    # -- the fault, remembered across processes --------------------------------------------------------------
    def _fault(self) -> Any:
        from conformance_support import Fault

        fault = Fault()
        path = self.folder / f"fault-rank{self.rank}.json"
        if path.is_file():
            fault.load_state_dict(json.loads(path.read_text()))

        def apply(step: int, loss: Any) -> Any:
            before = len(fault.done)
            out = fault(step, loss)
            if len(fault.done) != before:
                path.write_text(json.dumps(fault.state_dict()))
            return out

        return apply

    def _fired(self) -> bool:
        return (self.folder / f"fired-rank{self.rank}").exists() or (self.folder / "killed").exists()

    def run(self) -> None:
        import torch.distributed as dist

        print(f"@@cell {self.spec['name']} rank {self.rank}", file=sys.stderr, flush=True)
        seg = self._segments_before()
        resume = seg > 0
        while True:
            seg += 1
            if self._segment(seg, resume=resume) == "end":
                break
            resume = True
        dist.barrier()
        if self.rank == 0:
            (self.folder / "done").write_text("ok")
        dist.barrier()

    def _segments_before(self) -> int:
        """Segments an earlier attempt began (after a kill: the new attempt resumes)."""
        if not self.journal.path.is_file():
            return 0
        return max((json.loads(line).get("seg", 0) for line in self.journal.path.read_text().splitlines()),
                   default=0)

    def _segment(self, seg: int, *, resume: bool) -> str:
        from conformance_support import forced_runbook, live_state, tiny_data, tiny_loss

        import stabmon
        from stabmon.events import InterventionRecord

        model, tiny, optimizer, scheduler = _build(self.loop, SEED + seg - 1)
        state = None
        if resume:
            found = stabmon.resume_checkpoint(self.ckpt)
            if found is None:
                raise RuntimeError(f"segment {seg}: nothing to resume from in {self.ckpt}")
            info, state = found
            self.journal.write(resume=seg, path=info.path, mtime=os.stat(info.path).st_mtime_ns, step=info.step,
                               attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        mon = stabmon.Monitor(model, optimizer, scheduler=scheduler, store=self.url,
                              runbook=forced_runbook(self.action), mode="apply", checkpoint_dir=str(self.ckpt),
                              config=_config(), run_name=f"{self.loop}-{self.action}-{self.event}", loss_fn=tiny_loss,
                              resume_run_id=state["monitor"]["run_id"] if state is not None else None)
        if state is not None:
            mon.load_training_state(state)
        manager = mon.checkpoints

        def live() -> dict[str, Any]:
            return live_state(model=model, optimizer=optimizer, scheduler=scheduler, monitor=mon)

        def saved() -> list[str]:
            return [c.path for c in manager.checkpoints] if self.saver and manager is not None else []

        data = tiny_data(n=2 * (STEPS + 20), seed=0)[self.rank::2]
        fault = self._fault()
        how, previous = "end", None
        try:
            with mon:
                for step, batch in mon.steps(data, max_steps=STEPS):
                    self.journal.write(seg=seg, step=step)
                    planned = previous is None or step % CHECKPOINT_EVERY == 0 or step <= previous
                    new = self.journal.new_files(saved())
                    if planned or new:
                        snap = self.journal.snapshot(live(), seg=seg, step=step,
                                                     at="start" if planned else "unplanned")
                        self.journal.files(new, snap)
                    previous = step
                    if step == EVENT_AT and not self._fired():
                        self._fire(step, mon)
                    loss = fault(step, tiny_loss(model, batch))
                    loss.backward()
                    mon.observe(loss=loss)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
        except Crash:
            how = "crash"
        except KeyboardInterrupt:
            how = "interrupt"
        except SystemExit:  # torchrun's SIGTERM to the survivor of a kill: what its close saved, then it exits
            snap = self.journal.snapshot(live(), seg=seg, step=mon.step, at="terminated")
            self.journal.files(self.journal.new_files(saved()), snap)
            raise
        if how == "end" and mon.should_stop:
            how = "stop"
        if how == "end" and mon.step < STEPS:
            how = "short"  # the loader ran dry: the test says so
        snap = self.journal.snapshot(live(), seg=seg, step=mon.step, at="end")
        self.journal.files(self.journal.new_files(saved()), snap)
        records = [_record(e) for e in mon.events if isinstance(e, InterventionRecord)]
        facts = {"step": mon.step, "exit_code": mon.exit_code, "run_id": mon.run_id, "records": records,
                 "layout": mon.policy.layout.value}
        if how in ("end", "short"):
            facts.update(self._final(model, tiny))
        self.journal.write(end=seg, how=how, facts=facts)
        return "end" if how == "short" else how

    def _fire(self, step: int, mon: Any) -> None:
        if self.event == "continue":
            return
        (self.folder / f"fired-rank{self.rank}").write_text(str(step))
        if self.event == "resume":
            raise Crash("the node went away")
        if self.event == "interrupt":  # Ctrl-C reaches every rank of the job
            os.kill(os.getpid(), signal.SIGINT)
        if self.event == "kill" and self.rank == self.spec["victim"]:
            if self.rank == 0 and mon.store is not None:  # the rows the store writer has not committed die with
                mon.store.flush(timeout=60.0)  # it (docs/distributed.md): what is checked is the restart
            (self.folder / "killed").write_text(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def _final(self, model: Any, tiny: Any) -> dict[str, Any]:
        """A digest of this rank's own tensors and of the full weights (gathered under FSDP2: a collective)."""
        from torch.distributed.tensor import DTensor

        own = _local(dict(model.state_dict()))
        full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in tiny.named_parameters()}
        return {"own_digest": _digest(own), "full_digest": _digest(full)}


def _record(record: Any) -> dict[str, Any]:
    return {"action": record.action, "step": record.step, "ok": record.ok, "reverted": record.reverted,
            "after": record.after, "error": record.error}


def _gave_up(folder: Path, spec: dict[str, Any], attempt: int, rank: int) -> bool:
    """Whether the cell already ended earlier attempts without a Python error (a process aborted: gloo's own
    abort on a collective mismatch): it is then marked failed instead of taking the next attempt down too. Every
    rank decides from the attempts before this one, so every rank decides alike."""
    path = folder / "attempts"
    before = [int(a) for a in path.read_text().split()] if path.is_file() else []
    before = [a for a in before if a < attempt]
    if len(before) >= (2 if spec["event"] == "kill" else 1):
        (folder / f"failed-rank{rank}").write_text(
            f"the cell ended attempt(s) {before} without a Python error on this rank: see its stderr")
        return True
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(f"{attempt}\n")
    return False


def main() -> int:
    import torch
    import torch.distributed as dist

    import stabmon

    root, plan = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    torch.set_num_threads(1)
    stabmon.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    print(f"@@attempt {attempt} rank {rank}", file=sys.stderr, flush=True)
    for spec in plan:
        folder = root / spec["name"]
        if (folder / "done").exists() or any(folder.glob("failed-rank*")):
            continue
        if _gave_up(folder, spec, attempt, rank):
            continue
        cell = Cell(root, spec, rank)
        try:
            cell.run()
        except BaseException:  # noqa: BLE001 - the cell's own failure, written down for the test
            text = traceback.format_exc()
            print(text, file=sys.stderr, flush=True)
            killed = folder / "killed"
            # the survivor of a kill dies with its peer; anything else is the cell's failure
            if not (killed.is_file() and killed.read_text() == str(attempt)):
                (folder / f"failed-rank{rank}").write_text(text)
            sys.stderr.flush()
            os._exit(3)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
