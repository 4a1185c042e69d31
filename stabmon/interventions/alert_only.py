"""``alert_only``: change nothing; the decision itself is announced by the notifier and kept on the record."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stabmon.interventions.base import Intervention, Params
from stabmon.interventions.registry import register


class AlertOnlyParams(Params):
    """``message``: optional text for the alert."""

    message: str = ""


@register
class AlertOnly(Intervention):
    """Tell a human, touch nothing.

    >>> from stabmon.interventions.handle import Handle
    >>> from stabmon.overrides import Overrides
    >>> def T(): return Handle(Overrides(), clock=lambda: 5, hparams=lambda: {})
    >>> dict(AlertOnly(T(), {"message": "look"}, decision_id="d").apply().after)
    {'message': 'look'}
    """

    name = "alert_only"
    Params = AlertOnlyParams
    revertible = False
    changes_training = False  # it only tells people
    stays_in_force = False

    def _apply(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        assert isinstance(self.params, AlertOnlyParams)
        return {}, {"message": self.params.message} if self.params.message else {}
