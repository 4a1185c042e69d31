"""Reset Adam/AdamW moments of chosen tensors in place (the ``reset_moments`` intervention's live work).

Tensors are named as the monitor names parameters (:func:`~stabmon.collect.cluster.sharding.clean_name`: no DDP/FSDP
wrapper prefixes) or by a layer prefix (``blocks.1`` names every parameter under it), so the names in an
anomaly's metric (``grad_norm/blocks.1``) select them. Under FSDP each rank zeroes its own shards of the same
tensors, so every rank makes the same change.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
>>> opt = torch.optim.AdamW(model.parameters(), lr=0.1)
>>> model(torch.ones(1, 2)).sum().backward(); opt.step()
>>> reset_moments(model, opt, names=("1",), second=False)
['1.bias', '1.weight']
>>> float(opt.state[model[1].weight]["exp_avg"].abs().sum()), bool(opt.state[model[0].weight]["exp_avg"].any())
(0.0, True)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from stabmon.collect.cluster.sharding import clean_name, local

ADAM_FAMILY = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.SparseAdam)
"""torch's optimizers that keep ``exp_avg`` and ``exp_avg_sq`` from their first step on."""

RUNNING_MAX = "max_exp_avg_sq"
"""amsgrad's running max of ``exp_avg_sq``: reset with it, or the step stays divided by the old maximum."""


def select(model: nn.Module, names: Sequence[str]) -> dict[str, nn.Parameter]:
    """The parameters named (or under a named layer); all of them when ``names`` is empty. Raises
    ``ValueError`` naming what matched nothing."""
    params = {clean_name(n): p for n, p in model.named_parameters()}
    if not names:
        return params
    out: dict[str, nn.Parameter] = {}
    for name in names:
        hits = {n: p for n, p in params.items() if n == name or n.startswith(name + ".")}
        if not hits:
            raise ValueError(f"tensors: {name!r} names no parameter or layer of the model")
        out.update(hits)
    return out


def missing_state(optimizer: torch.optim.Optimizer, key: str) -> str | None:
    """Why the optimizer holds no ``key`` moment (None: it does, or will after its first step)."""
    if not isinstance(optimizer, ADAM_FAMILY):
        if not any(key in st for st in optimizer.state.values()):
            return f"{type(optimizer).__name__} keeps no {key}"
    return None


def reset_moments(model: nn.Module, optimizer: torch.optim.Optimizer, *, names: Sequence[str],
                  second: bool) -> list[str]:
    """Zero ``exp_avg`` (and ``exp_avg_sq`` when ``second``, with amsgrad's running max ``max_exp_avg_sq``:
    an amsgrad step divides by that max, so a second moment reset without it would leave every step divided by
    the old, spiked maximum, ~1000x too small) of the selected parameters; returns the names of those whose
    state was reset (a parameter not stepped yet has none).

    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=0.1, amsgrad=True)
    >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
    >>> reset_moments(model, opt, names=(), second=True)
    ['bias', 'weight']
    >>> float(opt.state[model.weight]["max_exp_avg_sq"].abs().sum())
    0.0
    """
    problem = missing_state(optimizer, "exp_avg")
    if problem is not None:
        raise ValueError(f"reset_moments: {problem}")
    keys = ("exp_avg", "exp_avg_sq", RUNNING_MAX) if second else ("exp_avg",)
    done = []
    with torch.no_grad():
        for name, p in sorted(select(model, names).items()):
            state = optimizer.state.get(p)
            if not state or "exp_avg" not in state:
                continue
            for key in keys:
                if key in state:
                    local(state[key]).zero_()
            done.append(name)
    return done
