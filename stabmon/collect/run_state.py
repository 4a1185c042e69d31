"""The run's position, owned by no component: the step counter, the data cursor and the overrides in force.

The monitor makes one :class:`RunState` and passes it to the collaborators that read or change it (the optimizer
hooks read the overrides, the intervention target rolls the step and the data back, the failsafe names the step
in its log lines); none of them reads the position through the monitor. In a checkpoint it is three entries of
the monitor's state, ``step``, ``data`` and ``overrides`` (:mod:`stabmon.collect.checkpoint.monitor_state`).

>>> run = RunState()
>>> run.step = 7; run.cursor.position = 7; run.overrides.lr_scale = 0.5
>>> run.step, run.cursor.state_dict(), run.restored
(7, {'position': 7, 'skip': []}, False)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stabmon.collect.data import DataCursor
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
