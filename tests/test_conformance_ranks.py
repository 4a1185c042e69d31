"""The conformance matrix on two ranks: ``torchrun --nproc-per-node 2`` (gloo, CPU) with DistributedDataParallel
over the matrix's Tiny model, and the same under FSDP2 (``fully_shard``). Every action a shipped runbook uses,
forced by the injected fault, then each event: the run goes on (``continue``); every rank crashes and the run is
resumed from the step every rank holds (``resume``); every rank gets SIGINT, as Ctrl-C sends it to a job, and the
run is resumed (``interrupt``); one rank is SIGKILLed, ``torchrun --max-restarts`` restarts both and they resume
from ``stabmon.resume_checkpoint(...)`` (``kill``). A run that stops itself (``checkpoint_and_stop``) is resumed
too, as a person would after looking.

Checkpoint layouts as docs/distributed.md recommends: DDP saves into one shared directory (rank 0 writes, rank 1
reads it), except in the ``kill`` cells, which follow the restart recipe (a directory per rank); FSDP2 always has
a directory per rank. A ``resume`` or ``interrupt`` cell resumes in the same processes, with fresh objects (the
``kill`` cells resume in new ones). When the victim of a kill is rank 0, the store's writer, it waits for its
store's writer before the SIGKILL: the rows the writer has not committed die with it (docs/distributed.md), and
what is checked is the restart. The survivor is stopped by torchrun's SIGTERM; its close finishes first (the
signal is held: its rows drained, its interrupt checkpoint whole), and that checkpoint is checked like any other.

Process start-up is paid once per launch, not per cell: ``tests/conformance_ranks_worker.py`` runs many cells in
sequence under one ``torchrun`` (one fresh model, optimizer and monitor per cell, each in its own folder) and
writes down what happened; the kill cells share one launch whose ``--max-restarts`` covers one restart per cell
(the worker skips the cells already done). The launches run once per module, for the cells selected; each test
then checks one cell from what was written:

- every checkpoint stabmon wrote loads with ``torch.load(weights_only=True)`` (an FSDP2 shard is a DTensor: the
  loading process imports ``torch.distributed.tensor``, as any FSDP2 process has);
- resume equivalence: after every resume, each rank's weights (its shard under FSDP2), optimizer, scheduler,
  overrides, executor, step and data position (and rank 0's engine) equal bit for bit the live ones at the step
  the run went on from when that checkpoint was written; every checkpoint still on disk holds that live state;
- the ranks agree all along: at every snapshot the other rank's overrides and executor state (record ids aside:
  each rank numbers its own records) equal rank 0's, and so do step and data position; DDP replicas are equal;
- a rollback lands on the step rank 0 recorded as agreed, on every rank, each with its own state of that step;
- the store (written by rank 0), ``stabmon trace`` and ``stabmon goodput`` agree with what happened
  (:meth:`conformance_support.Invariants.store`), and the run is one run, finished;
- no traceback from stabmon on any rank's stderr;
- the ranks end at the same step, DDP replicas with the same weights.

The matrix found two bugs, fixed since: the other rank could not follow rank 0's release or re-apply of a change
(only a revert's ids were translated: the ranks trained on with different settings, and under ``skip_step`` gloo
aborted the job), and a failure while closing for Ctrl-C or SIGTERM re-raised the interrupt and stopped the close
half-way (tests/test_executor_commit.py and tests/test_interrupts.py hold one-process reproductions of each).
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from conformance_ranks_worker import EVENT_AT, STEPS
from conformance_support import ACTIONS, EVENTS, Invariants, assert_same
from dist_support import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "conformance_ranks_worker.py"
LOOPS = ("ddp", "fsdp2")
RANK_EVENTS = (*EVENTS, "kill")
SPARE_RESTARTS = 6
"""Restarts a launch has beyond one per kill cell: a cell that fails takes its ranks down with it, and the
restarted attempt goes on with the next cell."""


def _name(loop: str, action: str, event: str) -> str:
    return f"{loop}-{action}-{event}"


def _spec(loop: str, action: str, event: str) -> dict[str, Any]:
    return {"name": _name(loop, action, event), "loop": loop, "action": action, "event": event,
            "layout": "shared" if loop == "ddp" and event != "kill" else "per_rank",
            "victim": sorted(ACTIONS).index(action) % 2}  # rank 0 (the store's writer) or rank 1


def _cells() -> list[Any]:
    out = []
    for loop in LOOPS:
        for action in sorted(ACTIONS):
            for event in RANK_EVENTS:
                out.append(pytest.param(loop, action, event, id=f"{loop}-{action}-{event}"))
    return out


# -- the launches -------------------------------------------------------------------------------------------
class Matrix:
    """The cells selected in this session, run by as few launches as the kill cells allow, once."""

    def __init__(self, root: Path, selected: list[tuple[str, str, str]]) -> None:
        self.root, self.selected = root, selected
        self.cells = root / "cells"
        self.cells.mkdir(parents=True, exist_ok=True)
        self.ran: dict[str, str] = {}  # group -> the launches' output (for a failing cell's message)
        self.launches = 0
        self.seconds = 0.0
        self._logs: tuple[int, dict[tuple[str, int], list[str]]] | None = None

    def group(self, event: str) -> str:
        return "kill" if event == "kill" else "steady"

    def ensure(self, event: str) -> str:
        group = self.group(event)
        if group not in self.ran:
            specs = [_spec(*c) for c in self.selected if self.group(c[2]) == group]
            self.ran[group] = self._run(group, specs)
        return self.ran[group]

    def _pending(self, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [s for s in specs if not (self.cells / s["name"] / "done").exists()
                and not any((self.cells / s["name"]).glob("failed-rank*"))]

    def _run(self, group: str, specs: list[dict[str, Any]]) -> str:
        output = []
        for _ in range(3):  # a launch that ended early (out of restarts) is launched again for the rest
            pending = self._pending(specs)
            if not pending:
                break
            kills = sum(1 for s in pending if s["event"] == "kill")
            output.append(self._launch(group, pending, restarts=kills + SPARE_RESTARTS))
            if len(self._pending(specs)) == len(pending):
                break  # no progress: say so in the cells' failures
        return "\n".join(output)

    def _launch(self, group: str, specs: list[dict[str, Any]], *, restarts: int) -> str:
        self.launches += 1
        n = self.launches
        plan = self.root / f"plan-{n}.json"
        plan.write_text(json.dumps(specs))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
               f"--max-restarts={restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
               f"--rdzv-id=stabmon-conformance-{group}-{n}", "--monitor-interval=0.5", "--redirects=3",
               f"--log-dir={self.root / 'logs' / str(n)}", str(WORKER), str(self.cells), str(plan)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(WORKER.parent)]), "OMP_NUM_THREADS": "1"}
        started = time.monotonic()
        timeout = 60 + 15 * len(specs)
        try:
            proc = subprocess.run(cmd, cwd=self.root, capture_output=True, text=True, timeout=timeout, env=env)
            out = f"launch {n} ({group}, {len(specs)} cells) exited {proc.returncode}\n{proc.stdout}{proc.stderr}"
        except subprocess.TimeoutExpired as exc:
            out = f"launch {n} ({group}) timed out after {timeout} s\n{exc.stdout!r}{exc.stderr!r}"
        self.seconds += time.monotonic() - started
        return out

    def stderr(self) -> dict[tuple[str, int], list[str]]:
        """Each cell's parts of each rank's stderr, one per attempt that ran it, by (cell, rank)."""
        if self._logs is not None and self._logs[0] == self.launches:
            return self._logs[1]
        parts: dict[tuple[str, int], list[str]] = {}
        logs = sorted(self.root.glob("logs/*/*/attempt_*/*/stderr.log"), key=_log_order)
        marker = re.compile(r"^@@cell (\S+) rank (\d+)$", re.M)
        for path in logs:
            text = path.read_text(errors="replace")
            pieces = marker.split(text)
            for i in range(1, len(pieces) - 2, 3):
                parts.setdefault((pieces[i], int(pieces[i + 1])), []).append(pieces[i + 2])
        self._logs = (self.launches, parts)
        return parts


def _log_order(path: Path) -> tuple[int, int, int]:
    launch, attempt, rank = path.parents[3].name, path.parents[1].name, path.parent.name
    return int(launch), int(attempt.split("_")[1]), int(rank)


@pytest.fixture(scope="module")
def matrix(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    selected = []
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if not isinstance(item, pytest.Function) or item.module is not request.module or spec is None:
            continue  # (a doctest, another module's test)
        if {"loop", "action", "event"} <= set(spec.params):
            selected.append((spec.params["loop"], spec.params["action"], spec.params["event"]))
    started = time.monotonic()
    m = Matrix(tmp_path_factory.mktemp("ranks"), selected)
    yield m
    print(f"\nconformance matrix on ranks: {len(selected)} cells, {m.launches} launches, "
          f"{m.seconds:.0f} s in torchrun, {time.monotonic() - started:.0f} s in all")


# -- what one rank wrote down ---------------------------------------------------------------------------------
@dataclass
class Segment:
    n: int
    steps: list[int] = field(default_factory=list)
    snaps: list[tuple[str, int, str]] = field(default_factory=list)  # (id, step, at), in order
    resume: dict[str, Any] | None = None
    how: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass
class Rank:
    rank: int
    folder: Path
    segments: dict[int, Segment] = field(default_factory=dict)
    files: dict[tuple[str, int], str] = field(default_factory=dict)  # checkpoint file (path, mtime) -> snapshot
    loaded: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def read(cls, folder: Path, rank: int) -> Rank:
        out = cls(rank, folder)
        path = folder / f"journal-rank{rank}.jsonl"
        assert path.is_file(), f"rank {rank} wrote no journal"
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if "file" in entry:
                out.files[(entry["file"], entry["mtime"])] = entry["snap"]
            elif "snap" in entry:
                out.seg(entry["seg"]).snaps.append((entry["snap"], entry["step"], entry["at"]))
            elif "resume" in entry:
                out.seg(entry["resume"]).resume = entry
            elif "end" in entry:
                seg = out.seg(entry["end"])
                seg.how, seg.facts = entry["how"], entry["facts"]
            else:
                out.seg(entry["seg"]).steps.append(entry["step"])
        return out

    def seg(self, n: int) -> Segment:
        return self.segments.setdefault(n, Segment(n))

    def snap(self, snap: str) -> dict[str, Any]:
        if snap not in self.loaded:
            self.loaded[snap] = torch.load(self.folder / f"snap-rank{self.rank}-{snap}.pt", weights_only=False)
        return self.loaded[snap]

    @property
    def last(self) -> Segment:
        return self.segments[max(self.segments)]


def _executor(state: dict[str, Any] | None) -> Any:
    """An executor's state without the record ids (each rank numbers the records of its own executor)."""
    if state is None:
        return None

    def plain(sd: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in sd.items() if k != "record_id"}

    applied = sorted((plain(v) for v in state["applied"].values()), key=lambda v: str(v.get("decision_id")))
    released = sorted(([plain(v) for v in vs] for vs in state["released"].values()), key=repr)
    return {"errors": state["errors"], "applied": applied, "released": released}


def _compared(state: dict[str, Any], *, rank: int, own_ids: bool) -> dict[str, Any]:
    """What a rank's resume must bring back: everything, but the engine on rank 0 only (rank 0 runs it), and the
    executor without record ids where the rank loaded another rank's file (a shared directory)."""
    out = dict(state)
    if rank != 0:
        out.pop("engine", None)
    if not own_ids:
        out["executor"] = _executor(out["executor"])
    return out


# -- the test -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("loop", "action", "event"), _cells())
def test_ranks(loop: str, action: str, event: str, matrix: Matrix) -> None:
    spec = _spec(loop, action, event)
    cell = Invariants(spec["name"])
    output = matrix.ensure(event)
    folder = matrix.cells / spec["name"]
    logs = matrix.stderr()
    stderr = {r: logs.get((spec["name"], r), []) for r in (0, 1)}
    failed = {p.name: p.read_text() for p in folder.glob("failed-rank*")}
    said = "".join(f"\n== rank {r}'s stderr\n{''.join(stderr[r])[-3000:]}" for r in (0, 1))
    assert not failed, f"{cell.cell}: the cell failed:\n" + "\n".join(
        f"== {k}\n{v[-3000:]}" for k, v in failed.items()) + said
    assert (folder / "done").exists(), f"{cell.cell}: the cell did not finish:\n{output[-6000:]}{said}"
    ranks = [Rank.read(folder, r) for r in (0, 1)]
    _same_journey(cell, ranks)
    _ranks_agree(cell, ranks, loop, "".join(stderr[1]))
    _checkpoints(cell, folder, spec)
    _resumes(cell, ranks, spec)
    _files_hold_the_live_state(cell, ranks, spec)
    records = _store(cell, folder, ranks, action)
    _rollbacks_land(cell, ranks, records)
    _ends(cell, ranks, loop)
    if event == "kill":
        _killed_and_restarted(cell, folder, ranks, spec)
    _quiet(cell, stderr)


def _quiet(cell: Invariants, stderr: dict[int, list[str]]) -> None:
    """No traceback through stabmon on any rank's stderr, in any attempt (a kill's survivor prints its own, through
    torch). Stricter than :meth:`Invariants.quiet` about what a traceback is: its frames, up to the exception line;
    the SIGTERM handler's own frame (it raises SystemExit to unwind the loop, by design) is not one."""
    noisy = {r: [tb for part in stderr[r] for tb in _stabmon_frames(part)] for r in (0, 1)}
    noisy = {r: found for r, found in noisy.items() if found}
    assert not noisy, f"{cell.cell}: tracebacks through stabmon, by rank: {noisy}"


def _stabmon_frames(text: str) -> list[list[str]]:
    """The stabmon frames of each traceback in ``text`` that has any, less a traceback that ends in the SIGTERM
    handler: it raises SystemExit by design, wherever the signal landed (in the loop, or at the end of ``close()``
    where a signal held during the close is delivered)."""
    import stabmon

    package = str(Path(stabmon.__file__).resolve().parent) + os.sep
    frame = re.compile(r'^\s+File "([^"]+)", line \d+, in (\S+)')
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if not lines[i].startswith("Traceback (most recent call last):"):
            i += 1
            continue
        i += 1
        found = []
        while i < len(lines) and lines[i].startswith(" "):
            m = frame.match(lines[i])
            if m and m.group(1).startswith(package):
                found.append(f"{m.group(1)[len(package):]} in {m.group(2)}")
            i += 1
        if found and not found[-1].endswith(" in _on_sigterm"):
            out.append(found)
    return out


def _same_journey(cell: Invariants, ranks: list[Rank]) -> None:
    """Both ranks took the same steps, segment by segment, and took their snapshots at the same points."""
    a, b = ranks
    assert sorted(a.segments) == sorted(b.segments), f"{cell.cell}: segments {sorted(a.segments)}, {sorted(b.segments)}"
    for n, seg in a.segments.items():
        other = b.segments[n]
        assert seg.steps == other.steps, f"{cell.cell}: segment {n}: the ranks took different steps"
        both = ("unplanned", "terminated")  # (only the survivor of a kill is terminated)
        planned = [(s, at) for _, s, at in seg.snaps if at not in both]
        assert planned == [(s, at) for _, s, at in other.snaps if at not in both], f"{cell.cell}: snapshots"
    for r in ranks:
        assert r.last.how == "end", f"{cell.cell}: rank {r.rank}'s run ended by {r.last.how}"
        for seg in r.segments.values():
            unplanned = [step for _, step, at in seg.snaps if at == "unplanned"]
            assert not unplanned, f"{cell.cell}: rank {r.rank} saved a checkpoint at unexpected steps {unplanned}"


def _checkpoints(cell: Invariants, folder: Path, spec: dict[str, Any]) -> None:
    import torch.distributed.tensor  # noqa: F401 - an FSDP2 shard is a DTensor: its class must be known to load it

    dirs = ["ckpt"] if spec["layout"] == "shared" else ["ckpt-rank0", "ckpt-rank1"]
    assert sorted(p.name for p in folder.glob("ckpt*")) == dirs, f"{cell.cell}: checkpoint folders"
    for name in dirs:
        assert cell.checkpoints(sorted((folder / name).glob("*.pt"))) >= 2, f"{cell.cell}: {name} holds < 2"


def _saver(ranks: list[Rank], rank: Rank, spec: dict[str, Any]) -> Rank:
    """The rank that wrote the checkpoints ``rank`` resumes from."""
    return ranks[0] if spec["layout"] == "shared" else rank


def _resumes(cell: Invariants, ranks: list[Rank], spec: dict[str, Any]) -> None:
    """Every resume brought back, on every rank, the live state the run went on from when its file was written."""
    own = spec["layout"] != "shared"
    for r in ranks:
        for n, seg in sorted(r.segments.items()):
            if seg.resume is None:
                continue
            key = (seg.resume["path"], seg.resume["mtime"])
            snap = _saver(ranks, r, spec).files.get(key)
            assert snap is not None, f"{cell.cell}: rank {r.rank} resumed from {key[0]}, which no rank saw written"
            first = seg.snaps[0]
            assert first[2] == "start" and first[1] == seg.resume["step"], (
                f"{cell.cell}: segment {n} began at step {first[1]}, its checkpoint holds {seg.resume['step']}")
            live = _compared(r.snap(snap), rank=r.rank, own_ids=own or r.rank == 0)
            resumed = _compared(r.snap(first[0]), rank=r.rank, own_ids=own or r.rank == 0)
            assert_same(live, resumed, f"{cell.cell}: rank {r.rank} resumed in segment {n}")


def _files_hold_the_live_state(cell: Invariants, ranks: list[Rank], spec: dict[str, Any]) -> None:
    """Each checkpoint file still on disk holds the live state (the rank's shard) at the step training went on
    from when it was written."""
    import torch.distributed.tensor  # noqa: F401

    for r in ranks if spec["layout"] != "shared" else ranks[:1]:
        for (path, mtime), snap in sorted(r.files.items()):
            if not os.path.isfile(path) or os.stat(path).st_mtime_ns != mtime:
                continue
            held = torch.load(path, weights_only=True, map_location="cpu")
            live = r.snap(snap)
            saved = {"model": _local(held["model"]), "optimizer": _local(held["optimizer"]),
                     "scheduler": held["scheduler"], "step": held["monitor"]["step"],
                     "overrides": held["monitor"]["overrides"]}
            assert_same({k: live[k] for k in saved}, saved, f"{cell.cell}: rank {r.rank}'s {Path(path).name}")


def _local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local(v) for v in value]
    return value


def _ranks_agree(cell: Invariants, ranks: list[Rank], loop: str, stderr: str) -> None:
    """At every snapshot the other rank's overrides, executor (record ids aside), step and data position equal
    rank 0's; DDP replicas hold the same weights and optimizer state."""
    a, b = ranks
    said = [line for line in stderr.splitlines() if "could not follow rank 0" in line]
    for n, seg in sorted(a.segments.items()):
        pairs = zip([x for x in seg.snaps if x[2] != "terminated"],
                    [x for x in b.segments[n].snaps if x[2] != "terminated"], strict=False)
        for (snap0, step, at), (snap1, _, _) in pairs:
            s0, s1 = a.snap(snap0), b.snap(snap1)
            where = f"{cell.cell}: segment {n}, step {step} ({at}): rank 1 vs rank 0"
            if said:
                where += f" (rank 1 said: {said[0]})"
            keep = ["overrides", "step", "data"] + (["model", "optimizer", "scheduler"] if loop == "ddp" else [])
            assert_same({k: s0[k] for k in keep}, {k: s1[k] for k in keep}, where)
            assert _executor(s0["executor"]) == _executor(s1["executor"]), f"{where}: executor state differs"


def _store(cell: Invariants, folder: Path, ranks: list[Rank], action: str) -> list[Any]:
    """Rank 0's store: one run, finished, and it agrees with what happened; its intervention records."""
    from stabmon.events import InterventionRecord
    from stabmon.store import open_store
    from stabmon.store.repo import load_events

    with sqlite3.connect(folder / "run.db") as conn:
        runs = conn.execute("select id, status from runs").fetchall()
        stored = {s for (s,) in conn.execute("select step from steps")}
    assert stored == set(range(STEPS)), f"{cell.cell}: steps not stored: {sorted(set(range(STEPS)) - stored)}"
    run_ids = {seg.facts["run_id"] for r in ranks for seg in r.segments.values() if seg.facts}
    assert len(runs) == 1 and runs[0][1] == "finished" and run_ids == {runs[0][0]}, (
        f"{cell.cell}: runs in the store {runs}, the ranks' run ids {run_ids}")
    stopped = any(seg.how == "stop" for seg in ranks[0].segments.values())
    url = f"sqlite:///{folder / 'run.db'}"
    cell.store(url, runs[0][0], action=action, stopped=stopped)
    store = open_store(url)
    try:
        with store.session() as session:
            return [e for e in load_events(session=session, run_id=runs[0][0]) if isinstance(e, InterventionRecord)]
    finally:
        store.close()


def _rollbacks_land(cell: Invariants, ranks: list[Rank], records: list[Any]) -> None:
    """Each rollback rank 0 recorded: every rank went back to its agreed step, with its own state of that step."""
    from stabmon.interventions.traits import changed_training, traits_of

    rollbacks = [r for r in records if traits_of(r.action).rewinds_step and changed_training(r)]
    for record in rollbacks:
        agreed = int(record.after["checkpoint_step"])
        assert int(record.after["restored_step"]) == agreed, f"{cell.cell}: {record.after}"
        assert not record.after.get("rank_disagreements"), f"{cell.cell}: {record.after['rank_disagreements']}"
        for r in ranks:
            landings = [(n, i) for n, seg in r.segments.items() for i, (_, step, at) in enumerate(seg.snaps)
                        if at == "start" and i and step == agreed and step <= seg.snaps[i - 1][1]]
            assert landings, f"{cell.cell}: rank {r.rank} never went back to step {agreed}"
            n, i = landings[0]
            snaps = r.segments[n].snaps
            first = next(s for s in snaps[:i] if s[1] == agreed and s[2] == "start")  # the step's first visit
            landed, before = r.snap(snaps[i][0]), r.snap(first[0])
            assert landed["step"] == agreed, f"{cell.cell}: rank {r.rank} loaded step {landed['step']}"
            keep = ("model", "optimizer", "scheduler")
            assert_same({k: before[k] for k in keep}, {k: landed[k] for k in keep},
                        f"{cell.cell}: rank {r.rank} after the rollback to step {agreed}")


def _ends(cell: Invariants, ranks: list[Rank], loop: str) -> None:
    """The ranks end at the same step; DDP replicas with the same weights, FSDP2 ranks with their own shards of
    the same full weights."""
    a, b = (r.last.facts for r in ranks)
    assert a["step"] == b["step"] == STEPS, f"{cell.cell}: ended at steps {a['step']} and {b['step']}"
    assert a["full_digest"] == b["full_digest"], f"{cell.cell}: the ranks end with different weights"
    if loop == "ddp":
        assert a["own_digest"] == b["own_digest"], f"{cell.cell}: the DDP replicas differ"
    else:
        assert a["own_digest"] != b["own_digest"], f"{cell.cell}: both ranks hold the same shard"


def _killed_and_restarted(cell: Invariants, folder: Path, ranks: list[Rank], spec: dict[str, Any]) -> None:
    """The victim was SIGKILLed at :data:`EVENT_AT`, and both ranks resumed in the next attempt."""
    killed = folder / "killed"
    assert killed.is_file(), f"{cell.cell}: rank {spec['victim']} was never killed"
    attempt = int(killed.read_text())
    for r in ranks:
        resumed = [seg.resume for seg in r.segments.values() if seg.resume is not None]
        assert resumed and resumed[-1]["attempt"] > attempt, f"{cell.cell}: rank {r.rank} resumed in no later attempt"
        cut = [seg for seg in r.segments.values() if seg.how is None]  # the segment the kill ended
        assert len(cut) == 1 and cut[0].steps[-1] == EVENT_AT, f"{cell.cell}: rank {r.rank}: killed segments {cut}"
