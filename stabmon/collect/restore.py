"""What a checkpoint holds and how it is restored: stateful objects by name, and per reason to load, the names
left as they are.

:class:`TrainingState` holds the model, optimizer, GradScaler, scheduler and the monitor's own state, each under
its name (the way torchtitan's checkpointer takes ``states={...}``); the monitor's own state is itself a
:class:`NamedStates` (step, data position, overrides, detectors and engine, alert gates, ...). Nothing in a
state calls back into its owner: each entry is the collaborator that owns that state.

Loading names its reason, and each reason has one exclusion set of dotted names (torchtitan's
``exclude_from_loading``): a rollback (:meth:`stabmon.collect.target.LiveTarget.rollback`) restores the training
state and keeps what describes the run as it is now; a resume restores everything.

>>> import torch
>>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> state = TrainingState({"model": model, "optimizer": opt, "scaler": None})
>>> sorted(state.state_dict())
['model', 'optimizer', 'scaler']
>>> state.mismatch({"model": {}})
"does not match the model: missing ['bias', 'weight'], unexpected []"
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

ROLLBACK = "rollback"
"""Loading the last-known-good checkpoint in the middle of a run."""
RESUME = "resume"
"""Loading a saved state into a new process (or a new monitor) to continue the run."""


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict`` / ``load_state_dict`` (a module, an optimizer, a detector suite, ...)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


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
        ``monitor.notifier``)."""
        for name, entry in self.states.items():
            if entry is None or name in exclude or state.get(name) is None:
                continue
            if isinstance(entry, NamedStates):
                inner = [n.split(".", 1)[1] for n in exclude if n.startswith(name + ".")]
                entry.load_state_dict(state[name], exclude=inner)
            else:
                entry.load_state_dict(state[name])


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
        """Why ``state`` cannot be restored into the model and optimizer (missing or unexpected keys, another
        shape or dtype, another optimizer layout), or None when it fits. Reads metadata only."""
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            return "holds no model state"
        problem = _model_mismatch(self.states["model"].state_dict(), state["model"])  # type: ignore[union-attr]
        if problem is not None:
            return problem
        groups = (state.get("optimizer") or {}).get("param_groups")
        want = [len(g["params"]) for g in self.states["optimizer"].param_groups]  # type: ignore[union-attr]
        if groups is None or [len(g.get("params", ())) for g in groups] != want:
            return f"does not match the optimizer: parameter groups of sizes {want} expected"
        for name, hint in self.required.items():
            if not isinstance(state.get(name), dict):
                return f"holds no {name} state ({hint})"
        return None

    def load(self, state: dict[str, Any], *, reason: str = RESUME) -> None:
        """Restore what :meth:`state_dict` saved, except what ``reason`` excludes.

        All or nothing: ``ValueError`` before anything is touched when the state does not fit the model or the
        optimizer, and the previous training state (every entry that is not itself :class:`NamedStates`) is put
        back if loading fails part-way."""
        problem = self.mismatch(state)
        if problem is not None:
            raise ValueError(f"checkpoint {problem}")
        excluded = self.exclude.get(reason, frozenset())
        plain = {n: s for n, s in self.states.items() if s is not None and not isinstance(s, NamedStates)}
        before = copy.deepcopy({n: s.state_dict() for n, s in plain.items()})
        try:
            self.load_state_dict(state, exclude=excluded)
        except BaseException:
            self.load_state_dict(before, exclude=excluded)
            raise


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
