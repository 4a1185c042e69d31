"""``skip_step``: turn on the device-side update guard.

Sets ``overrides.skip_factor``: from the next step on, the monitor's optimizer hook discards the update
(with tensor operations on the device, no host synchronisation) whenever the step's gradient norm exceeds
``factor`` times its running mean, as OLMo-core and metaseq do; every skipped update is counted and written
at the next flush (metric ``skipped``). Reverting turns the guard back to what it was.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from stabmon.interventions._override import OverrideIntervention
from stabmon.interventions.base import Params


class SkipStepParams(Params):
    """``factor``: discard an update whose gradient norm exceeds factor x its running mean (> 1)."""

    factor: float = Field(gt=1)


class SkipStep(OverrideIntervention):
    """Guard against single bad updates.

    >>> from stabmon.overrides import Overrides
    >>> class T:
    ...     overrides = Overrides(); step = 5
    ...     def hparams(self): return {}
    >>> t = T(); _ = SkipStep(t, {"factor": 6.0}, decision_id="d").apply(); t.overrides.skip_factor
    6.0
    """

    name = "skip_step"
    Params = SkipStepParams
    field = "skip_factor"
    hparam = "skip_factor"

    def _new_value(self, current: Any) -> Any:
        assert isinstance(self.params, SkipStepParams)
        return self.params.factor

    def _in_force(self) -> Any:
        return self.target.overrides.skip_factor
