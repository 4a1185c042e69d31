"""What a checkpoint holds and how it is restored: stateful objects by name, and per reason to load, the names
left as they are.

:class:`TrainingState` holds the model, optimizer, GradScaler, scheduler and the monitor's own state, each under
its name (the way torchtitan's checkpointer takes ``states={...}``); the monitor's own state is itself a
:class:`NamedStates` (step, data position, overrides, detectors and engine, alert gates, ...). Nothing in a
state calls back into its owner: each entry is the collaborator that owns that state.

Loading names its reason, and each reason has one exclusion set of dotted names (torchtitan's
``exclude_from_loading``): a rollback (:meth:`stabmon.collect.checkpoint.recovery.Recovery.rollback`) restores the
training state and keeps what describes the run as it is now; a resume restores everything.

A load is all or nothing, without a second copy of the weights and the optimizer state: what can be checked is
checked before anything is touched (:meth:`TrainingState.mismatch`); then every entry is loaded, the model last,
each after keeping what puts it back (an optimizer's current state by reference: its load builds new state and
leaves the old tensors as they are; a small entry's state as a copy; an entry whose load does more than set its
state, :class:`Restorable`, its own snapshot). Should one fail, every entry loaded so far, the failing one
included, is put back. The model is loaded last and copies into its weights in place: after the checks the only
failure left there is a load hook of the user's own. Ctrl-C and SIGTERM wait until the load is done (a second
one does not), so that an interrupt never leaves it half done.

>>> import torch
>>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> state = TrainingState({"model": model, "optimizer": opt, "scaler": None})
>>> sorted(state.state_dict())
['model', 'optimizer', 'scaler']
>>> state.mismatch({"model": {}})
"does not match the model: missing ['bias', 'weight'], unexpected []"
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from stabmon.collect.interrupts import InterruptHold

ROLLBACK = "rollback"
"""Loading the last-known-good checkpoint in the middle of a run."""
RESUME = "resume"
"""Loading a saved state into a new process (or a new monitor) to continue the run."""

log = logging.getLogger(__name__)


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict`` / ``load_state_dict`` (a module, an optimizer, a detector suite, ...)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@runtime_checkable
class Restorable(Protocol):
    """An entry whose load does more than set what ``state_dict`` returns (marks the run restored, rewinds the
    data, reseeds the engine, adopts checkpoints): what it keeps to be put back exactly as it is now, and how,
    should a load fail after touching it."""

    def snapshot(self) -> Any: ...

    def restore(self, snapshot: Any) -> None: ...


class NamedStates:
    """Stateful objects by name, saved and loaded as one dict; ``meta`` adds values that are saved and never
    loaded (a format version, the run's id). An entry that is None saves None and loads nothing.

    >>> from stabmon.overrides import Overrides
    >>> o = Overrides(lr_scale=0.5)
    >>> states = NamedStates({"overrides": o}, meta={"version": lambda: 1})
    >>> saved = states.state_dict(); o.lr_scale = 1.0
    >>> states.load_state_dict(saved, exclude={"overrides"}); o.lr_scale
    1.0
    >>> states.load_state_dict(saved); o.lr_scale, saved["version"]
    (0.5, 1)
    """

    def __init__(
        self, states: Mapping[str, Stateful | None], *, meta: Mapping[str, Callable[[], Any]] | None = None
    ) -> None:
        self.states = dict(states)
        self.meta = dict(meta or {})

    def state_dict(self) -> dict[str, Any]:
        out = {name: read() for name, read in self.meta.items()}
        out.update({name: s.state_dict() if s is not None else None for name, s in self.states.items()})
        return out

    def load_state_dict(self, state: Mapping[str, Any], *, exclude: Collection[str] = ()) -> None:
        """Load every entry ``state`` holds, except the names in ``exclude`` (dotted for nested states:
        ``monitor.notifier``). All or nothing (see the module docstring): if an entry fails, every entry
        loaded before it and the failing one are put back as they were, and the error is raised."""
        loads = sorted(self.loads(state, exclude=exclude), key=lambda load: isinstance(load[0], nn.Module))
        undo: list[Callable[[], None]] = []
        with _interrupts_held():  # Ctrl-C or SIGTERM takes effect once the load is whole (or undone)
            try:
                for entry, saved in loads:  # modules last: they are the one entry kept without a copy
                    undo.append(_keeper(entry))
                    entry.load_state_dict(saved)
            except BaseException:
                _put_back(undo)
                raise

    def loads(self, state: Mapping[str, Any], *, exclude: Collection[str] = ()) -> list[tuple[Stateful, Any]]:
        """(entry, its saved state) for every entry a load of ``state`` loads, nested states flattened, in
        order."""
        out: list[tuple[Stateful, Any]] = []
        for name, entry in self.states.items():
            if entry is None or name in exclude or state.get(name) is None:
                continue
            if isinstance(entry, NamedStates):
                inner = [n.split(".", 1)[1] for n in exclude if n.startswith(name + ".")]
                out.extend(entry.loads(state[name], exclude=inner))
            else:
                out.append((entry, state[name]))
        return out


class TrainingState(NamedStates):
    """The objects a checkpoint holds (a ``model`` and an ``optimizer``, and any others by name), and for each
    reason to load (:data:`ROLLBACK`, :data:`RESUME`) the dotted names not loaded; see the module docstring.
    ``required``: names whose state a checkpoint must hold (a dict), with the hint the error gives."""

    def __init__(
        self,
        states: Mapping[str, Stateful | None],
        *,
        exclude: Mapping[str, Collection[str]] | None = None,
        required: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(states)
        self.exclude = {reason: frozenset(names) for reason, names in (exclude or {}).items()}
        self.required = dict(required or {})

    @property
    def model(self) -> nn.Module:
        """The model whose weights the checkpoint holds (what in-place interventions change)."""
        model = self.states["model"]
        assert isinstance(model, nn.Module)
        return model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose state the checkpoint holds."""
        optimizer = self.states["optimizer"]
        assert isinstance(optimizer, torch.optim.Optimizer)
        return optimizer

    def mismatch(self, state: Any) -> str | None:
        """Why ``state`` cannot be restored (the model's missing or unexpected keys, another shape or dtype;
        another optimizer layout, or optimizer state of another shape; a GradScaler, scheduler or monitor state
        of the wrong type, or empty), or None when it fits. Reads metadata only: checked before a load touches
        anything."""
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            return "holds no model state"
        problem = _model_mismatch(self.states["model"].state_dict(), state["model"])  # type: ignore[union-attr]
        if problem is not None:
            return problem
        groups = (state.get("optimizer") or {}).get("param_groups")
        want = [len(g["params"]) for g in self.states["optimizer"].param_groups]  # type: ignore[union-attr]
        if groups is None or [len(g.get("params", ())) for g in groups] != want:
            return f"does not match the optimizer: parameter groups of sizes {want} expected"
        problem = _optimizer_mismatch(self.optimizer, state["optimizer"])
        if problem is not None:
            return problem
        for name, hint in self.required.items():
            if not isinstance(state.get(name), dict):
                return f"holds no {name} state ({hint})"
        for name, entry in self.states.items():
            if name not in ("model", "optimizer") and entry is not None and state.get(name) is not None:
                problem = _entry_mismatch(name, entry, state[name])
                if problem is not None:
                    return problem
        return None

    def load(self, state: dict[str, Any], *, reason: str = RESUME) -> None:
        """Restore what :meth:`state_dict` saved, except what ``reason`` excludes.

        All or nothing: ``ValueError`` before anything is touched when the state does not fit (:meth:`mismatch`),
        and every entry, the monitor's own nested ones included, is put back if loading fails part-way (see the
        module docstring; no copy of the weights or the optimizer state is made)."""
        problem = self.mismatch(state)
        if problem is not None:
            raise ValueError(f"checkpoint {problem}")
        self.load_state_dict(state, exclude=self.exclude.get(reason, frozenset()))


def _model_mismatch(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    import torch

    missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    if missing or extra:
        return f"does not match the model: missing {missing[:3]}, unexpected {extra[:3]}"
    for key, t in mine.items():
        o = theirs[key]
        if not isinstance(o, torch.Tensor) or o.shape != t.shape or o.dtype != t.dtype:
            got = f"{tuple(o.shape)} {o.dtype}" if isinstance(o, torch.Tensor) else type(o).__name__
            return f"does not match the model: {key} is {got}, the model has {tuple(t.shape)} {t.dtype}"
    return None


def _optimizer_mismatch(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> str | None:
    """Why the saved per-parameter state cannot be the optimizer's: a tensor where the optimizer holds one of
    another shape for the same parameter (its own load would take it, and the next step fail). Parameters are
    matched as its ``load_state_dict`` matches them, by position in the saved parameter groups."""
    state = saved.get("state")
    if state is None:
        return None
    if not isinstance(state, Mapping):
        return f"does not match the optimizer: its state is {type(state).__name__}"
    ids = [i for group in saved["param_groups"] for i in group.get("params", ())]
    params = dict(zip(ids, (p for group in optimizer.param_groups for p in group["params"]), strict=False))
    for key, entry in state.items():
        if key not in params:
            continue  # the optimizer's own load skips it too
        live = optimizer.state.get(params[key], {})
        if not isinstance(entry, Mapping):
            return f"does not match the optimizer: the state of parameter {key} is {type(entry).__name__}"
        for name, value in entry.items():
            mine = live.get(name)
            if isinstance(mine, torch.Tensor) and (not isinstance(value, torch.Tensor) or value.shape != mine.shape):
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                return f"does not match the optimizer: state {key}.{name} is {got}, not {tuple(mine.shape)}"
    return None


def _entry_mismatch(name: str, entry: Stateful, saved: Any) -> str | None:
    """Why ``saved`` cannot be loaded into ``entry`` (a GradScaler, a scheduler, the monitor's own state), as
    far as its shape tells: a nested state that is not a dict, or a dict state that is another type or empty
    (a disabled GradScaler saves ``{}``, which an enabled one refuses)."""
    if isinstance(entry, NamedStates):
        return None if isinstance(saved, Mapping) else f"holds a {name} state that is {type(saved).__name__}"
    mine = entry.state_dict()
    if isinstance(mine, dict) and not isinstance(saved, dict):
        return f"holds a {name} state that is {type(saved).__name__}, not a dict"
    if isinstance(mine, dict) and mine and not saved:
        return f"holds an empty {name} state (saved from a disabled one?)"
    return None


def _keeper(entry: Stateful) -> Callable[[], None]:
    """What puts ``entry`` back as it is now (see the module docstring)."""
    if isinstance(entry, Restorable):
        snapshot = entry.snapshot()
        return lambda: entry.restore(snapshot)
    if isinstance(entry, nn.Module):  # loaded last, in place: its checks passed and interrupts are held
        return lambda: None
    if isinstance(entry, torch.optim.Optimizer):  # by reference: its load builds new state, the old is kept
        kept = entry.state_dict()
        return lambda: entry.load_state_dict(kept)
    kept = copy.deepcopy(entry.state_dict())
    return lambda: entry.load_state_dict(kept)


def _put_back(undo: list[Callable[[], None]]) -> None:
    """Every entry loaded so far back as it was, the newest first; one that cannot be is logged, the others
    still are."""
    for restore in reversed(undo):
        try:
            restore()
        except Exception:  # noqa: BLE001 - the load's own error is the one raised
            log.exception("stabmon: an entry could not be put back after a failed load")


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block is done, then take effect as if they came just after it
    (:class:`~stabmon.collect.interrupts.InterruptHold`, with no time limit: a load is never cut)."""
    hold = InterruptHold(at_most_s=None)
    hold.hold()
    try:
        yield
    finally:
        hold.release()
