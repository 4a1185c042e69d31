"""Shared machinery for the interventions that set one field of :class:`~stabmon.overrides.Overrides`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from stabmon.interventions.base import Intervention, NoChange


class OverrideIntervention(Intervention):
    """Sets ``target.overrides.<field>`` to ``_new_value()``; reverting restores the previous override.

    ``hparam`` names the :attr:`~stabmon.interventions.handle.Handle.hparams` key whose value in force is
    recorded beside the override, so the audit row shows what the optimizer actually used (where the two share
    a name, ``before`` holds the value in force).
    """

    field: ClassVar[str] = ""
    hparam: ClassVar[str] = ""
    direction: ClassVar[int] = 0
    """-1: the change may only lower the value in force (LR, clip, beta2); +1: only raise it (weight decay);
    0: any change. A change the other way, or none at all, raises :class:`NoChange` and touches nothing."""
    revertible = True

    def _new_value(self, current: Any) -> Any:
        raise NotImplementedError

    def _in_force(self) -> Any:
        try:
            return self.target.hparams().get(self.hparam)
        except Exception:  # noqa: BLE001 - a target that cannot report its hparams still gets the change
            return None

    def _apply(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        overrides = self.target.overrides
        old = getattr(overrides, self.field)
        new = self._new_value(old)
        in_force = self._in_force()
        self._check_direction(*self._compared(in_force, old, new))
        setattr(overrides, self.field, new)
        try:
            overrides.validate()
        except ValueError:
            setattr(overrides, self.field, old)
            raise
        self._undo = {"value": old, "in_force": in_force, "new": new}
        before, after = {self.field: old}, {self.field: new}
        if self.hparam != self.field:  # the value in force beside the override
            before[self.hparam], after[self.hparam] = in_force, self._expected(in_force, old, new)
        elif in_force is not None:  # same name: record what the optimizer used rather than "no override"
            before[self.field] = in_force
        return before, after

    def _compared(self, in_force: Any, old: Any, new: Any) -> tuple[Any, Any]:
        """(value now, value the change would give) that ``direction`` is checked on."""
        return in_force, self._expected(in_force, old, new)

    def _check_direction(self, now: Any, then: Any) -> None:
        if not self.direction or not isinstance(now, (int, float)) or not isinstance(then, (int, float)):
            return  # a value the target cannot report is not second-guessed
        if (then - now) * self.direction <= 0:
            way = "lowers" if self.direction < 0 else "raises"
            raise NoChange(f"{self.name} only {way} {self.hparam}: {_fmt(now)} now, the rung gives {_fmt(then)}")

    def _expected(self, in_force: Any, old: Any, new: Any) -> Any:
        """The hyper-parameter value in force once the override applies (at the next optimizer step)."""
        return new

    def _revert(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        """Restore the previous override; the record shows the value in force beside it, as ``_apply``'s."""
        overrides = self.target.overrides
        current, restored = getattr(overrides, self.field), self._undo["value"]
        in_force = self._in_force()
        setattr(overrides, self.field, restored)
        # no override to go back to: the value in force before the change is in force again
        back = self._undo.get("in_force") if restored is None else self._expected(in_force, current, restored)
        before, after = {self.field: current}, {self.field: restored}
        if self.hparam != self.field:
            before[self.hparam], after[self.hparam] = in_force, back
        elif in_force is not None and back is not None:
            before[self.field], after[self.field] = in_force, back
        return before, after


    def _reapply(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        """Set the override this change applied again (after a release gave it back)."""
        if "new" not in self._undo:
            raise NoChange(f"{self.name}: the value it applied is not known (saved by an older version)")
        overrides = self.target.overrides
        current, new = getattr(overrides, self.field), self._undo["new"]
        setattr(overrides, self.field, new)
        return {self.field: current}, {self.field: new}


def _fmt(value: float) -> str:
    return f"{value:.6g}"
