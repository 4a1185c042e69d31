"""What an action is, as its intervention class declares it: the engine, the rejection plan and the trace read
these traits instead of comparing action names.

Every :class:`~stabmon.interventions.base.Intervention` subclass declares class-level booleans (defaults in
brackets):

- ``changes_training`` [True]: applying it acts on the run (an alert does not); it spends the runbook's budget,
  puts the detectors in grace, and an incident that did nothing else skips the cooldown.
- ``stays_in_force`` [True]: what it changed stays in force until reverted (a rejection reverts or keeps it); a
  diagnosis, a stop or an alert leave nothing behind.
- ``stops_run`` [False]: it ends the run (checkpoint-and-stop).
- ``rewinds_step`` [False]: it moves the step counter back (a rollback): its window lasts until the run has
  trained past the step it left, and it is told the incident's onset.
- ``diagnoses`` [False]: it returns a verdict the runbook branches on (``when: {verdict: ...}``).
- ``revertible`` [False]: ``_revert`` can undo it.

Three actions are not interventions but act on earlier ones: ``revert`` undoes the change named in
``params["intervention_id"]`` (:data:`REVERT`, whose traits say ``undoes``); ``release`` gives back the changes a
resolved incident holds (:data:`RELEASE`, ``releases``); ``reapply`` puts back what a release gave back
(:data:`REAPPLY`, ``reapplies``).

>>> traits_of("set_clip").changes_training, traits_of("set_clip").revertible
(True, True)
>>> traits_of("alert_only").changes_training, traits_of("rollback").rewinds_step
(False, True)
>>> traits_of(REVERT).undoes, traits_of("checkpoint_and_stop").stops_run
(True, True)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stabmon.events import InterventionRecord
from stabmon.interventions.registry import REVERT as REVERT
from stabmon.interventions.registry import get_intervention

if TYPE_CHECKING:
    from stabmon.interventions.base import Intervention

RELEASE = "release"
"""The action of a decision that gives back the changes an incident resolved with (their settings restored,
the learning rate re-warmed to the schedule over ``params["steps"]``), named in ``params["intervention_ids"]``."""
REAPPLY = "reapply"
"""The action of a decision that puts back what a release gave back (named in ``params["intervention_id"]``,
the release's record): the trouble came back while it was released."""


@dataclass(frozen=True, slots=True)
class Traits:
    """The declared traits of one action (see the module docstring)."""

    changes_training: bool = True
    stays_in_force: bool = True
    stops_run: bool = False
    rewinds_step: bool = False
    diagnoses: bool = False
    revertible: bool = False
    undoes: bool = False
    releases: bool = False
    reapplies: bool = False


_REVERT_TRAITS = Traits(stays_in_force=False, undoes=True)
_PSEUDO = {  # the decisions that act on earlier interventions rather than being one
    REVERT: _REVERT_TRAITS,
    RELEASE: Traits(stays_in_force=False, releases=True),
    REAPPLY: Traits(reapplies=True),
}
_BY_CLASS: dict[type[Intervention], Traits] = {}  # read on every record of an open incident: built once per class


def traits_of(action: str) -> Traits:
    """The traits of the intervention registered as ``action`` (or of :data:`REVERT`); KeyError if unknown."""
    pseudo = _PSEUDO.get(action)
    if pseudo is not None:
        return pseudo
    cls = get_intervention(action)  # a KeyError names the known actions
    traits = _BY_CLASS.get(cls)
    if traits is None:
        traits = _BY_CLASS[cls] = Traits(
            changes_training=cls.changes_training, stays_in_force=cls.stays_in_force, stops_run=cls.stops_run,
            rewinds_step=cls.rewinds_step, diagnoses=cls.diagnoses, revertible=cls.revertible)
    return traits


def levers_of(action: str, params: Mapping[str, Any]) -> frozenset[str]:
    """What a rung of ``action`` with ``params`` pulls on (its class's ``levers``); none for the pseudo-actions.

    >>> sorted(levers_of("scale_lr", {"factor": 0.5})), sorted(levers_of("rollback", {"skip_batches": 200}))
    (['lr'], ['data'])
    """
    if action in _PSEUDO:
        return frozenset()
    cls = get_intervention(action)  # a KeyError names the known actions
    return cls.levers(params)


def recorded_traits(action: str) -> Traits:
    """The traits of an action read from a record: one this process has not registered (a custom intervention
    of the run that recorded it) counts as a change that stays in force."""
    try:
        return traits_of(action)
    except KeyError:
        return Traits()


def changed_training(record: InterventionRecord) -> bool:
    """Whether this record acted on the run: its action changes training, it did not fail and it was not skipped
    (a rung not applicable changed nothing)."""
    return record.error is None and record.not_applied is None and traits_of(record.action).changes_training
