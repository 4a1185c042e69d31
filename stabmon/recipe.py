"""A run's recipe, stored with the run so that ``stabmon diff`` can say where two runs' settings part.

The recipe is what the run was asked to do, beside the environment fingerprint (what it ran on): the optimizer
and its hyper-parameters at the start, the runbook (its name and a digest of its rules, so an edited threshold
shows), and the loop's own settings handed to ``Monitor(recipe=...)`` (a nanoGPT config dict, ``vars(args)``,
an HF ``TrainingArguments``; the demo's scenario). The monitor's config and mode are stored beside it in the
run's config, and :func:`recipe_differences` compares all of it. Torch- and polars-free: the monitor imports it.

>>> r = run_recipe(optimizer="AdamW", hparams={"lr": 3e-4}, runbook=None, user={"batch_size": 12, "out": None})
>>> r["optimizer"], r["user"]
({'class': 'AdamW', 'lr': 0.0003}, {'batch_size': 12, 'out': None})
>>> check_recipe(["lr"])
Traceback (most recent call last):
...
ValueError: recipe: expected a mapping of setting names to values (a dict, vars(args)), got list
>>> [(d.path, d.a, d.b) for d in recipe_differences({"recipe": {"user": {"lr": 1}}}, {"recipe": {"user": {"lr": 2}}})]
[('recipe.user.lr', 1, 2)]
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stabmon.diff import EnvDifference


def check_recipe(recipe: Any) -> dict[str, Any] | None:
    """``recipe`` as a plain dict (None stays None); a one-line ``ValueError`` when it is not a mapping."""
    if recipe is None:
        return None
    if not isinstance(recipe, Mapping):
        raise ValueError(
            f"recipe: expected a mapping of setting names to values (a dict, vars(args)), got {type(recipe).__name__}"
        )
    return {str(k): _plain(v) for k, v in recipe.items()}


def _plain(value: Any) -> Any:
    """JSON-ready: numbers, strings, booleans and None as they are, mappings and sequences walked, the rest as
    its ``str`` (an enum, a path, a dtype)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def runbook_summary(runbook: Any) -> dict[str, Any] | None:
    """Name, mode and a 12-character digest of a runbook's validated content (None: no runbook)."""
    if runbook is None:
        return None
    dumped = json.dumps(runbook.model_dump(mode="json"), sort_keys=True, default=str)
    return {"name": runbook.name, "mode": runbook.mode, "digest": hashlib.sha256(dumped.encode()).hexdigest()[:12]}


def run_recipe(
    *, optimizer: str, hparams: Mapping[str, float], runbook: Any, user: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The recipe stored under ``config["recipe"]`` of a live run."""
    return {
        "optimizer": {"class": optimizer, **{k: _plain(v) for k, v in hparams.items()}},
        "runbook": runbook_summary(runbook),
        "user": check_recipe(user) or {},
    }


DERIVED = ("ladder",)
"""Entries of a stored config that follow from the others (the rungs a runbook dropped in the run's loop follow
from the runbook and the loop): not settings of their own, so not compared."""


def recipe_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[EnvDifference]:
    """Every setting of two runs' stored configs (recipe, monitor config, mode) that differs, by dotted path."""
    from stabmon.diff import environment_differences  # polars: not on the live monitor's import path

    return environment_differences({k: v for k, v in a.items() if k not in DERIVED},
                                   {k: v for k, v in b.items() if k not in DERIVED})
