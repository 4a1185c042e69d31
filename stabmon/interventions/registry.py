"""The actions a runbook can name: :data:`INTERVENTIONS`, filled by :func:`register`.

Each intervention module registers its class with ``@register`` where the class is defined, so an intervention
is one module (and its test); ``stabmon.interventions`` imports the shipped ones. A custom intervention is
registered the same way from the user's own code, before the runbooks that name it are loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from stabmon.interventions.base import Intervention

REVERT = "revert"
"""The action of a decision that undoes an earlier change (``params["intervention_id"]``): no class of its own."""

INTERVENTIONS: dict[str, type[Intervention]] = {}
_LISTENERS: list[Callable[[type[Intervention]], None]] = []

C = TypeVar("C", bound="type[Intervention]")


def register(cls: C) -> C:
    """Register an intervention class under its ``name`` (usable as a decorator)."""
    if not cls.name or cls.name == REVERT:
        raise ValueError(f"intervention.name must be a non-empty name other than {REVERT!r}, got {cls.name!r}")
    INTERVENTIONS[cls.name] = cls
    for listener in _LISTENERS:
        listener(cls)
    return cls


def on_register(listener: Callable[[type[Intervention]], None]) -> None:
    """Call ``listener(cls)`` for every class registered from now on (the runbook schema takes each in)."""
    _LISTENERS.append(listener)


def get_intervention(name: str) -> type[Intervention]:
    """The intervention class registered under ``name``."""
    try:
        return INTERVENTIONS[name]
    except KeyError:
        raise KeyError(f"unknown intervention {name!r}; known: {', '.join(sorted(INTERVENTIONS))}") from None
