"""A resumed run continues its own step count, or refuses to write anything.

A run reopened with ``Monitor(..., resume_run_id=ID)`` already has steps in the store. If the loop forgets to
load the monitor's saved state (``monitor.load_state_dict(checkpoint["monitor"])``) the step counter would
restart at 0 and the run would hold a second step 0, 1, 2, ... mixed with the first: :class:`ResumeCheck`
refuses that at the first step with one ``ValueError`` line naming the fix, before anything is written.
Loading a state or calling ``monitor.sync_step(n)`` settles it: the loop then says where it is.

>>> check = ResumeCheck("r-1", last_step=599)
>>> try:
...     check.first_step(0)
... except ValueError as exc:
...     print(str(exc).split(";")[0])
resume_run_id='r-1': the run already holds steps up to 599 but the monitor starts at step 0
>>> check = ResumeCheck("r-1", last_step=599); check.settle(); check.first_step(0)  # the loop said where it is
"""

from __future__ import annotations


class ResumeCheck:
    """Refuses a resumed run's first step when its step counter went back without a loaded state."""

    def __init__(self, run_id: str | None, *, last_step: int | None) -> None:
        self.run_id = run_id
        self.last_step = last_step
        """The highest step the store holds for the resumed run (None: a new run, or no steps stored)."""
        self.settled = run_id is None or last_step is None

    def settle(self) -> None:
        """The monitor's state was loaded or its step set: the loop continues where it says."""
        self.settled = True

    def first_step(self, step: int) -> None:
        """Called as each step opens; raises once, at the first, when the run would go backwards."""
        if self.settled:
            return
        last = self.last_step
        if last is not None and step <= last:
            raise ValueError(
                f"resume_run_id={self.run_id!r}: the run already holds steps up to {last} but the monitor starts at "
                f"step {step}; load the monitor's saved state first (monitor.load_state_dict(checkpoint['monitor'])) "
                "or set the step (monitor.sync_step(iter_num)); nothing was written"
            )
        self.settled = True
