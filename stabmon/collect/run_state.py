"""The run's position, owned by no component: the step counter, the data cursor and the overrides in force.

The monitor makes one :class:`RunState` and passes it to the collaborators that read or change it (the optimizer
hooks read the overrides, the intervention target rolls the step and the data back, the failsafe names the step
in its log lines); none of them reads the position through the monitor. In a checkpoint it is three entries of
the monitor's state, ``step``, ``data`` and ``overrides`` (:meth:`RunState.states`).

>>> from stabmon.collect.restore import NamedStates
>>> run = RunState()
>>> run.step = 7; run.cursor.position = 7
>>> saved = NamedStates(run.states()).state_dict()
>>> saved["step"], saved["data"], run.restored
(7, {'position': 7, 'skip': []}, False)
>>> later = RunState(); NamedStates(later.states()).load_state_dict(saved)
>>> later.step, later.cursor.position, later.restored
(7, 7, True)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stabmon.collect.data import DataCursor
from stabmon.collect.restore import Stateful
from stabmon.overrides import Overrides


@dataclass(eq=False)
class RunState:
    """Step, data position and overrides; see the module docstring."""

    step: int = 0
    """Optimizer steps completed (the index the next step will get)."""
    cursor: DataCursor = field(default_factory=DataCursor)
    """The data position and the batches to skip."""
    overrides: Overrides = field(default_factory=Overrides)
    """LR / clip / beta2 / weight-decay / skip overrides in force."""
    restored: bool = False
    """A saved step was loaded into this run (a resume or a rollback): its first step is not its initial
    state, and its step count is the loaded one."""

    def states(self) -> dict[str, Stateful]:
        """The entries of a checkpoint this state owns, by name."""
        return {"step": _StepCounter(self), "data": self.cursor, "overrides": self.overrides}


class _StepCounter:
    """The step counter as a checkpoint entry (an int, as saved since the first format)."""

    def __init__(self, run: RunState) -> None:
        self.run = run

    def state_dict(self) -> int:
        return self.run.step

    def load_state_dict(self, state: Any) -> None:
        self.run.step = int(state)
        self.run.restored = True
