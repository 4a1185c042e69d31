"""The intervention base class: it owns the guard and the audit record; subclasses only change things.

An intervention is created for one :class:`~stabmon.events.Decision` and acts on an
:class:`~stabmon.interventions.handle.Handle` (the live run's or replay's, the same class).
:meth:`Intervention.apply` and :meth:`Intervention.revert` are the public methods: they check the state
(an intervention is applied once and reverted at most once, after it was applied), hold the target's lock
so no two interventions change the target at the same time, and build the
:class:`~stabmon.events.InterventionRecord` with the values in force before and after. Subclasses
implement ``_apply`` (returns ``(before, after)``) and, when they can be undone, ``_revert``.

Parameters are validated by a pydantic model per intervention (``Params``), the same model the runbook
schema uses, so a runbook that loads is a runbook whose rungs can be built.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

from stabmon.events import InterventionRecord

if TYPE_CHECKING:
    from stabmon.interventions.handle import Handle


class InterventionError(RuntimeError):
    """An intervention could not be applied or reverted (wrong state, or the target refused)."""


class NoChange(InterventionError):
    """The intervention would change nothing, or would move a value the harmful way (loosen clipping, raise the
    LR, raise beta2, lower weight decay): it is skipped, recorded as skipped, and the runbook moves on."""


class Params(BaseModel):
    """Base of every intervention's parameter model: unknown fields and silent type coercion are refused."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def target_lock(target: Any) -> threading.RLock:
    """The one lock per target under which interventions change it (targets that cannot be weakly referenced
    share a module lock)."""
    with _LOCKS_GUARD:
        try:
            lock = _LOCKS.get(target)
            if lock is None:
                lock = _LOCKS[target] = threading.RLock()
            return lock
        except TypeError:
            return _FALLBACK_LOCK


_FALLBACK_LOCK = threading.RLock()


class Intervention:
    """One change to a training run, applied once and possibly reverted.

    Subclasses set ``name``, ``Params`` (a :class:`Params` model) and their traits (what the runbook engine
    needs to know about them, see :mod:`stabmon.interventions.traits`), and implement ``_apply`` and
    ``_revert``.

    >>> from stabmon.interventions.handle import Handle
    >>> from stabmon.overrides import Overrides
    >>> def T(): return Handle(Overrides(), clock=lambda: 10, hparams=lambda: {"lr": 1e-3})
    >>> class Halve(Intervention):
    ...     name = "halve_lr"
    ...     def _apply(self):
    ...         before = self.target.overrides.lr_scale
    ...         self.target.overrides.lr_scale = before / 2
    ...         return {"lr_scale": before}, {"lr_scale": before / 2}
    >>> rec = Halve(T(), {}, decision_id="d1").apply()
    >>> rec.action, dict(rec.before), dict(rec.after)
    ('halve_lr', {'lr_scale': 1.0}, {'lr_scale': 0.5})
    """

    name: ClassVar[str] = ""
    Params: ClassVar[type[Params]] = Params
    revertible: ClassVar[bool] = False  # _revert can undo it
    changes_training: ClassVar[bool] = True  # it acts on the run (an alert does not)
    stays_in_force: ClassVar[bool] = True  # what it changed stays until reverted (a stop or a diagnosis: nothing)
    stops_run: ClassVar[bool] = False  # it ends the run
    rewinds_step: ClassVar[bool] = False  # it moves the step counter back (a rollback)
    diagnoses: ClassVar[bool] = False  # it returns a verdict the runbook branches on
    samples: ClassVar[str | None] = None  # the MonitorConfig section whose sampled metrics it acts on (off: idle)

    def __init__(
        self,
        target: Handle,
        params: Mapping[str, Any] | None = None,
        *,
        decision_id: str,
        simulated: bool = False,
    ) -> None:
        self.target = target
        self.params = type(self).Params.model_validate(dict(params or {}))
        self.decision_id = decision_id
        self.simulated = simulated
        self.record: InterventionRecord | None = None
        self.revert_record: InterventionRecord | None = None
        self._undo: dict[str, Any] = {}

    @property
    def applied(self) -> bool:
        return self.record is not None

    @property
    def reverted(self) -> bool:
        return self.revert_record is not None

    def apply(self) -> InterventionRecord:
        """Apply the change once; return the audit record (before / after values)."""
        with target_lock(self.target):
            if self.record is not None:
                raise InterventionError(f"{self.name} for decision {self.decision_id} was already applied")
            before, after = self._apply()
            self.record = InterventionRecord(
                decision_id=self.decision_id, step=int(self.target.step), action=self.name,
                before=dict(before), after=dict(after), simulated=self.simulated,
            )
            return self.record

    def revert(self, *, decision_id: str) -> InterventionRecord:
        """Undo the change (for the revert decision ``decision_id``); return the audit record of the
        revert."""
        with target_lock(self.target):
            if not self.revertible:
                raise InterventionError(f"{self.name} cannot be reverted")
            if self.record is None:
                raise InterventionError(f"{self.name} for decision {self.decision_id} was never applied")
            if self.revert_record is not None:
                raise InterventionError(f"{self.name} for decision {self.decision_id} was already reverted")
            before, after = self._revert()
            self.revert_record = InterventionRecord(
                decision_id=decision_id, step=int(self.target.step), action=self.name,
                before=dict(before), after=dict(after), reverted=True, simulated=self.simulated,
            )
            return self.revert_record

    def release(self, *, decision_id: str, steps: int) -> InterventionRecord:
        """Give the change back after it resolved its incident (for the release decision ``decision_id``): by
        default its revert; a change whose giving back must wait (a learning-rate cap while the schedule is above
        where the trouble began) overrides ``_release``. ``steps``: the re-warm-up length."""
        with target_lock(self.target):
            if self.record is None or self.revert_record is not None:
                raise InterventionError(f"{self.name} for decision {self.decision_id} is not in force")
            before, after = self._release(steps)
            self.revert_record = InterventionRecord(
                decision_id=decision_id, step=int(self.target.step), action=self.name,
                before=dict(before), after=dict(after), reverted=True, simulated=self.simulated,
            )
            return self.revert_record

    def _release(self, steps: int) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        return self._revert()

    def reapply(self, *, decision_id: str) -> InterventionRecord:
        """Put back what a revert (a release) gave back: the trouble came back without it (for the decision
        ``decision_id``); return the audit record. It is in force again, and can be reverted again."""
        with target_lock(self.target):
            if self.revert_record is None:
                raise InterventionError(f"{self.name} for decision {self.decision_id} is in force: nothing to reapply")
            before, after = self._reapply()
            self.revert_record = None
            return InterventionRecord(
                decision_id=decision_id, step=int(self.target.step), action=self.name,
                before=dict(before), after=dict(after), simulated=self.simulated,
            )

    @classmethod
    def levers(cls, params: Mapping[str, Any]) -> frozenset[str]:
        """What of training a change with these params pulls on, for the engine: ``"lr"`` (it lowers the learning
        rate), ``"data"`` (it skips batches). When a rung's change did not keep its trouble away (it came back in
        the window, or a repeat held it off no longer than the attempt before), its levers are spent for that rule
        in this run, and a later rung that pulls only spent levers is passed over. None by default (never passed
        over)."""
        return frozenset()

    @classmethod
    def holds(cls, record: InterventionRecord) -> bool:
        """Whether the change ``record`` made stays in force until it is undone (what a failed rung's revert and
        a resolved incident's release act on): every revertible change, unless a subclass says otherwise."""
        return cls.revertible

    def _apply(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        raise NotImplementedError

    def _reapply(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        raise InterventionError(f"{self.name} cannot be put back once reverted")

    def _revert(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        raise NotImplementedError

    # -- state (so a resumed run can still revert a change made before the restart) --
    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "params": self.params.model_dump(),
            "decision_id": self.decision_id,
            "record_id": self.record.id if self.record else None,
            "undo": dict(self._undo),
            "reverted": self.reverted,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._undo = dict(state["undo"])
        if state.get("record_id") is not None:
            self.record = InterventionRecord(
                decision_id=self.decision_id, step=-1, action=self.name, before={}, after={},
                simulated=self.simulated, id=state["record_id"],
            )
        if state.get("reverted"):
            self.revert_record = InterventionRecord(
                decision_id="", step=-1, action=self.name, before={}, after={}, reverted=True,
            )
