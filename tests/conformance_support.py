"""The conformance matrix's shared parts: the runbooks that force each action, the fault that forces them, and the
one assertion helper every loop uses (:class:`Invariants`).

A cell of the matrix is (loop, action, event). The loop trains a small model; a transient fault (the loss multiplied
by 1,000 on three steps, the first time the run reaches them: a gradient spike and a loss spike the default
detectors call an error on every seed) opens an incident; the runbook of the cell answers it with the one action
under test (:func:`forced_runbook`; ``diagnose`` is followed by the restart its verdict calls for, which lands on
the checkpoint a ``data`` or ``hardware_suspect`` verdict cleared: the fault does not come back on a re-run, so the
verdict is ``hardware_suspect`` wherever the loop hands its batches and loss). Then the event: the run goes on to
its end (``continue``), or it is resumed from its newest checkpoint (``resume``), or it is interrupted by Ctrl-C and
resumed (``interrupt``), or one of its ranks is SIGKILLed and ``torchrun`` restarts it (``kill``, the multi-rank
loops).

The invariants (each a method of :class:`Invariants`):

- every checkpoint stabmon writes loads with ``torch.load(weights_only=True)`` (:meth:`Invariants.checkpoints`);
- resume equivalence: the state a resume reconstructs equals, bit for bit, the live state the run went on from
  when that checkpoint was written (model, optimizer, scheduler, overrides, engine, executor, step, data
  position; :class:`Probe` takes the live snapshots, :func:`assert_same` compares);
- the store agrees with what happened: every applied change has its record and its outcome, the trace prints,
  ``stabmon goodput`` books the rolled-back and the skipped steps (:meth:`Invariants.store`);
- no traceback from stabmon (:meth:`Invariants.quiet`);
- a rung that cannot act in the loop is dropped at start with one line and never decided (:meth:`Invariants.dropped`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

FAULT_STEPS = (44, 45, 46)
"""The steps whose loss is multiplied by :data:`FAULT_SCALE` the first time the run reaches them."""
FAULT_SCALE = 1e3

ACTIONS: dict[str, dict[str, Any]] = {
    "alert_only": {},
    "scale_lr": {"factor": 0.5},
    "set_clip": {"max_norm": 0.5},
    "set_beta2": {"beta2": 0.95},
    "set_weight_decay": {"weight_decay": 0.3},
    "skip_step": {"factor": 3.0},
    "adaptive_clip": {},
    "reset_moments": {"second_moment": True, "rewarm_steps": 5},
    "qk_clip": {"tau": 0.5},
    "scale_layer_lr": {"factor": 0.1, "tensors": ["head"]},
    "rollback": {"lookback": 0, "lr_cap": 0.5, "skip_batches": 3},
    "diagnose": {"max_batches": 4},
    "checkpoint_and_stop": {"reason": "forced by the conformance matrix"},
}
"""Every action a shipped runbook uses, with the parameters that make it act on the matrix's models."""

EVENTS = ("continue", "resume", "interrupt")
"""What happens after the intervention in a one-process loop (the multi-rank loops add ``kill``)."""


def forced_runbook(action: str, params: Mapping[str, Any] | None = None, *, observe: int = 6) -> Any:
    """A runbook whose one rule answers any error with ``action`` alone."""
    from stabmon.runbook import loads_runbook
    from stabmon.runbook.schema import Runbook

    params = dict(ACTIONS[action] if params is None else params)
    rung = {"action": action, "params": params, "observe": 1 if action in ("alert_only", "diagnose") else observe}
    doc = {"name": f"forced-{action}", "mode": "apply", "cooldown": 0, "baseline_steps": 20,
           "rules": [{"name": "forced", "when": {"kind": "*", "severity": "error"}, "ladder": [rung]}]}
    if action == "diagnose":  # and the restart its verdict calls for, as the shipped runbooks follow one: a
        # data or hardware_suspect verdict lands it on the checkpoint the diagnosis cleared
        restart = {"action": "rollback", "params": {"lookback": 0}, "observe": observe}
        doc["rules"] += [{"name": f"after_{v}", "when": {"verdict": v}, "ladder": [restart]}
                         for v in ("data", "state", "hardware_suspect")]
    runbook = loads_runbook(_yaml(doc))
    assert isinstance(runbook, Runbook)
    return runbook


def _yaml(doc: Any) -> str:
    import yaml

    return yaml.safe_dump(doc, sort_keys=False)


class Fault:
    """Multiply the loss by :data:`FAULT_SCALE` at :data:`FAULT_STEPS`, the first time each is reached (a transient
    fault: a rollback does not meet it again)."""

    def __init__(self, steps: Iterable[int] = FAULT_STEPS, scale: float = FAULT_SCALE) -> None:
        self.steps, self.scale = set(steps), scale
        self.done: set[int] = set()

    def __call__(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if step in self.steps and step not in self.done:
            self.done.add(step)
            return loss * self.scale
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"done": sorted(self.done)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.done = set(state["done"])


# -- the one-process model and data ------------------------------------------------------------------------
class Tiny(nn.Module):
    """An attention layer between two linear layers: every state-level action finds what it acts on (a head for
    qk_clip, a param group of its own for the head's LR), no dropout (a re-run is exact)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(torch.relu(a)).squeeze(-1).mean(-1)


def tiny_setup(seed: int = 0, lr: float = 3e-3) -> tuple[Tiny, torch.optim.Optimizer, Any]:
    """The model, AdamW over two param groups (body, head) and a scheduler (its state is part of a resume)."""
    torch.manual_seed(seed)
    model = Tiny()
    body = [*model.embed.parameters(), *model.attn.parameters()]
    optimizer = torch.optim.AdamW([{"params": body}, {"params": model.head.parameters()}], lr=lr,
                                  weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    return model, optimizer, scheduler


def tiny_data(n: int = 200, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(16, 4, 8, generator=g)
        out.append((x, (x @ w).mean(-1)))
    return out


def tiny_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).pow(2).mean()


# -- live state and its comparison --------------------------------------------------------------------------
def live_state(*, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, monitor: Any,
               counted: bool = True) -> dict[str, Any]:
    """A deep copy of everything a resume must bring back (``counted``: the monitor counts the steps, so its step
    and data position are part of it; a framework's are the framework's own)."""
    executor = monitor.executor
    engine = monitor.pipeline.engine
    state: dict[str, Any] = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "overrides": monitor.overrides.state_dict(),
        "engine": _engine(engine.state_dict()) if engine is not None else None,
        "executor": executor.state_dict() if executor is not None else None,
    }
    if counted:
        state["step"] = monitor.step
        data = monitor.cursor.state_dict()
        if monitor.buffer.open and monitor.cursor.drawing:  # inside a step: its batch is drawn already
            data["position"] -= 1
        state["data"] = data
    return copy.deepcopy(state)


def _engine(state: dict[str, Any]) -> dict[str, Any]:
    """The engine's state but its id line (a resumed run draws fresh ids on purpose)."""
    return {k: v for k, v in state.items() if k not in ("salt", "counter")}


def _next_draw(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state`` with its data position moved past the batches it is to skip: the batch the run draws next. The
    checkpoint a rollback writes of the state it restored holds the position before its skipped batches (they are
    skipped as the loop draws them), the live state after the draw holds the one past them; both go on with the
    same batch."""
    data = state.get("data") if isinstance(state, Mapping) else None
    if not isinstance(data, Mapping) or not isinstance(data.get("position"), int):
        return state
    position, skip = data["position"], set(data.get("skip") or ())
    while position in skip:
        position += 1
    return {**state, "data": {**data, "position": position}}


def assert_same(live: Any, resumed: Any, path: str = "state") -> None:
    """``resumed`` equals ``live``: tensors bit for bit, floats exactly (NaN equals NaN), containers entry by entry;
    the first difference is named by its path."""
    if isinstance(live, torch.Tensor):
        assert isinstance(resumed, torch.Tensor), f"{path}: {type(resumed).__name__} where a tensor was"
        assert live.shape == resumed.shape and live.dtype == resumed.dtype, f"{path}: shape/dtype differ"
        assert torch.equal(live, resumed) or (live.isnan() == resumed.isnan()).all() and torch.equal(
            live.nan_to_num(), resumed.nan_to_num()), f"{path}: values differ"
        return
    if isinstance(live, Mapping):
        assert isinstance(resumed, Mapping), f"{path}: {type(resumed).__name__} where a mapping was"
        assert set(live) == set(resumed), f"{path}: keys {sorted(map(str, set(live) ^ set(resumed)))} differ"
        for key in live:
            assert_same(live[key], resumed[key], f"{path}.{key}")
        return
    if isinstance(live, (list, tuple)):
        assert isinstance(resumed, (list, tuple)) and len(live) == len(resumed), f"{path}: lengths differ"
        for i, (a, b) in enumerate(zip(live, resumed, strict=True)):
            assert_same(a, b, f"{path}[{i}]")
        return
    if isinstance(live, float) and isinstance(resumed, float) and math.isnan(live) and math.isnan(resumed):
        return
    assert live == resumed, f"{path}: {live!r} live, {resumed!r} after the resume"


@dataclass
class Probe:
    """The live state at the start of the first step after each checkpoint file was written (the state training
    went on from), by file (:meth:`key`: a file written again, as a loop's ``ckpt-<step>.pt`` after a rollback,
    is a new checkpoint); call :meth:`step_start` at the start of every step and at the end of the run."""

    saved: Callable[[], Iterable[str]]
    state: Callable[[], dict[str, Any]]
    snapshots: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)

    @staticmethod
    def key(path: str | Path) -> tuple[str, int]:
        return str(path), Path(path).stat().st_mtime_ns

    def step_start(self) -> None:
        for path in self.saved():
            if not Path(path).is_file():
                continue
            key = self.key(path)
            if key not in self.snapshots:
                self.snapshots[key] = self.state()

    def at(self, path: str | Path) -> dict[str, Any]:
        """The live state that went with the checkpoint file at ``path`` as it is now."""
        return self.snapshots[self.key(path)]


# -- the invariants -----------------------------------------------------------------------------------------
@dataclass
class Invariants:
    """The one assertion helper of the matrix: each method checks one invariant of the module docstring."""

    cell: str

    def checkpoints(self, paths: Iterable[str | Path]) -> int:
        """Every checkpoint file stabmon wrote loads with ``weights_only=True`` and holds the monitor's state."""
        n = 0
        for path in paths:
            state = torch.load(path, weights_only=True, map_location="cpu")
            monitor = state.get("monitor", state) if isinstance(state, dict) else None
            assert isinstance(monitor, dict) and "step" in monitor, f"{self.cell}: {path} holds no monitor state"
            n += 1
        return n

    def resumed(self, live: Mapping[str, Any], resumed: Mapping[str, Any]) -> None:
        assert_same(_next_draw(live), _next_draw(resumed), f"{self.cell}")

    def store(self, url: str, run_id: str, *, action: str, stopped: bool = False) -> dict[str, Any]:
        """The store agrees with what happened; returns the facts checked (for a failing message)."""
        from typer.testing import CliRunner

        from stabmon.cli import app
        from stabmon.events import Decision, DecisionStatus, InterventionRecord, Outcome
        from stabmon.goodput import compute_ledger, load_input
        from stabmon.interventions.traits import changed_training, traits_of
        from stabmon.store import open_store
        from stabmon.store.repo import load_events, load_steps

        store = open_store(url)
        try:
            with store.session() as session:
                events = load_events(session=session, run_id=run_id)
                steps = load_steps(session=session, run_id=run_id)
                ledger = compute_ledger(load_input(session=session, run_id=run_id))
        finally:
            store.close()
        decisions = {e.id: e for e in events if isinstance(e, Decision)}
        records = [e for e in events if isinstance(e, InterventionRecord)]
        outcomes = [e for e in events if isinstance(e, Outcome)]
        applied = [d for d in decisions.values() if d.status in (DecisionStatus.APPLY, DecisionStatus.APPROVED)]
        recorded = {r.decision_id for r in records}
        missing = [d.action for d in applied if d.id not in recorded]
        assert not missing, f"{self.cell}: decisions applied without a record: {missing}"
        forced = [r for r in records if r.action == action and not r.reverted]
        assert forced, f"{self.cell}: {action} was never applied: {[(d.action, d.reason) for d in applied]}"
        judged = {o.decision_id for o in outcomes}
        for r in records:
            traits = traits_of(r.action)
            if r.reverted or traits.releases or traits.reapplies or traits.stops_run or traits.undoes:
                continue  # judged as part of another's outcome (a release's "kept" names the release) or none
            assert r.decision_id in judged, f"{self.cell}: {r.action} at step {r.step} has no outcome"
        if stopped:
            assert any(traits_of(r.action).stops_run for r in records), f"{self.cell}: no stop recorded"
        rollbacks = [r for r in records if traits_of(r.action).rewinds_step and changed_training(r)]
        if action == "diagnose":  # its verdict's restart followed, and a cleared state is where it landed
            diagnosis = forced[0].after
            verdict, checkpoint = diagnosis.get("verdict"), diagnosis.get("checkpoint_step")
            cleared = diagnosis.get("cleared_step", checkpoint)  # (a transient fault: the step that did not reproduce)
            restarts = [r for r in rollbacks if r.before.get("cleared_step") is not None]
            landing = diagnosis.get("landing") or {}
            # where one process kept the re-run's state it landed there; else on the newest checkpoint up to it
            where = [cleared] if landing and "refused" not in landing else list(range(checkpoint, cleared + 1))
            if verdict in ("data", "hardware_suspect"):
                assert restarts and all(r.before["cleared_step"] == cleared and r.after["checkpoint_step"] in where
                                        for r in restarts), (
                    f"{self.cell}: verdict {verdict}, landing {landing}, rollbacks "
                    f"{[(r.before, r.after) for r in rollbacks]}")
        abandoned = sum(int(r.after["from_step"]) - int(r.after["checkpoint_step"]) for r in rollbacks)
        assert ledger.cause("rollback").steps >= abandoned, (
            f"{self.cell}: {abandoned} steps rolled back, goodput books {ledger.cause('rollback').steps}")
        skipped = sum(1 for s in steps if (s.get("skipped") or 0) > 0)
        if skipped:
            assert ledger.cause("skipped_update").steps >= 1, f"{self.cell}: skipped steps not booked"
        trace = CliRunner().invoke(app, ["trace", run_id, "--db", url])
        assert trace.exit_code == 0 and action in trace.output, f"{self.cell}: trace failed: {trace.output[-800:]}"
        return {"records": len(records), "outcomes": len(outcomes), "rolled_back": abandoned,
                "goodput": ledger.goodput}

    def quiet(self, text: str) -> None:
        """No traceback from stabmon in ``text`` (a process's stderr, or the captured log)."""
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("Traceback"):
                frames = "\n".join(lines[i:i + 40])
                assert "stabmon" not in frames, f"{self.cell}: a traceback through stabmon:\n{frames}"

    def quiet_log(self, records: Iterable[Any]) -> None:
        """No log record of stabmon's carries a traceback (``caplog.records``)."""
        noisy = [f"{r.name}: {r.getMessage()}" for r in records if r.exc_info and r.name.startswith("stabmon")]
        assert not noisy, f"{self.cell}: stabmon logged tracebacks: {noisy[:3]}"

    def dropped(self, log: str, decided: Iterable[str], action: str) -> None:
        """``action`` could not act in this loop: one start-up line said so and it was never decided."""
        assert "dropped from the ladder" in log and action in log, f"{self.cell}: no start-up line for {action}"
        assert action not in set(decided), f"{self.cell}: {action} was decided though it cannot act here"
