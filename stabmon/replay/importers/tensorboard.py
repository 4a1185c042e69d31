"""TensorBoard event files (``events.out.tfevents.*``), through the ``tensorboard`` package's reader.

``tensorboard`` is an optional extra (``pip install 'stabmon[tensorboard]'``); without it :func:`read` reports
one clear problem instead of failing. Scalar tags are mapped like table columns
(:data:`stabmon.replay.importers.generic.KNOWN_COLUMNS` plus ``mapping``; Megatron's ``lm loss``,
``grad-norm``, ``loss-scale``, ``learning-rate`` tags are known too); a path that is a directory reads every
event file in it. Overflow steps are marked as in the table importers
(:mod:`stabmon.replay.importers.overflow`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stabmon.events import Metric, StepRecord
from stabmon.replay.importers.base import ImportResult
from stabmon.replay.importers.generic import KNOWN_COLUMNS
from stabmon.replay.importers.overflow import mark_records

FORMAT = "tensorboard"
PRIORITY = 10

TAGS: dict[str, str] = {
    **KNOWN_COLUMNS,
    "lm-loss-training/lm loss": Metric.LOSS,
    "train/lm loss": Metric.LOSS,
    "grad-norm/grad-norm": Metric.GRAD_NORM,
    "grad-norm": Metric.GRAD_NORM,
    "loss-scale/loss-scale": Metric.LOSS_SCALE,
    "loss-scale": Metric.LOSS_SCALE,
    "learning-rate/learning-rate": Metric.LR,
    "learning-rate": Metric.LR,
    "train/grad_norm": Metric.GRAD_NORM,
}

MISSING = "the tensorboard package is not installed; install it with: pip install 'stabmon[tensorboard]'"


def sniff(head: str) -> bool:
    return "brain.Event" in head[:200]


def read(path: Path, *, mapping: Mapping[str, str] | None = None, **_: Any) -> ImportResult:
    """Read the scalars of one event file (or a directory of them)."""
    result = ImportResult(format=FORMAT, records=[])
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        result.problem(Path(path).name, MISSING)
        return result
    tags = {**TAGS, **dict(mapping or {})}
    try:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        scalar_tags = acc.Tags().get("scalars", [])
    except Exception as exc:  # noqa: BLE001 - a corrupt file is reported, never raised
        result.problem(Path(path).name, f"unreadable event file ({type(exc).__name__}: {exc})"[:200])
        return result
    by_step: dict[int, dict[str, float]] = {}
    times: dict[int, float] = {}
    for tag in scalar_tags:
        metric = tags.get(tag, tag)
        for ev in acc.Scalars(tag):
            by_step.setdefault(int(ev.step), {})[metric] = float(ev.value)
            times[int(ev.step)] = float(ev.wall_time)
    records = [StepRecord(step=s, metrics=by_step[s], time=times.get(s)) for s in sorted(by_step)]
    result.records = mark_records(records)
    return result
