"""fp16 overflow steps in logs that carry no overflow flag, found from the loss scale's backoffs.

A dynamic loss scaler that meets an inf/NaN gradient skips the update and lowers the scale; a log that keeps
the scale (a W&B export, a CSV, TensorBoard scalars) therefore shows every overflow as a *backoff*: the scale of
one record is lower than that of the record before. Many loops log their grad norm on those steps too, as
``inf`` or ``nan`` (HF Trainer does), which is healthy dynamic loss scaling, not a non-finite training state.
:func:`overflow_steps` names the step that overflowed at each backoff, so the importer can mark it
``overflow = 1`` as the DeepSpeed and Megatron importers mark their ``OVERFLOW!`` lines; the non-finite rule then
leaves that step's grad norm alone and the loss-scale collapse detector counts it.

Which of the two records around a backoff overflowed depends on when the loop logs the scale: the scale *in
force* for the step (the scale drops at the next record) or the scale after ``scaler.update()`` (it drops at
the overflow step itself). Each of the two whose grad norm is not finite overflowed (in a burst of overflows,
every one of them); when neither's is, the record before the drop did (the scale in force,
:data:`stabmon.events.Metric.LOSS_SCALE`'s meaning). A scale that
only rises, or a record without a scale, marks nothing. A log with an overflow (or skipped-step) column says it
itself and needs none of this.

>>> from stabmon.events import StepRecord
>>> inf = float("inf")
>>> rows = [(1, 1024.0, 0.3), (2, 1024.0, 0.3), (3, 512.0, inf), (4, 512.0, 0.3), (5, 256.0, 0.2),
...         (6, 256.0, inf), (7, 128.0, inf), (8, 64.0, 0.2)]
>>> overflow_steps(StepRecord(s, {"loss_scale": ls, "grad_norm": g}) for s, ls, g in rows)
[3, 4, 6, 7]
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

from stabmon.events import Metric, StepRecord
from stabmon.replay.importers.table import StepTable


def overflow_steps(records: Iterable[StepRecord]) -> list[int]:
    """The steps (in order) that overflowed, by the loss-scale backoffs of ``records`` (in step order)."""
    found: list[int] = []
    prev: StepRecord | None = None
    for record in records:
        scale = record.finite(Metric.LOSS_SCALE)
        if scale is None:
            prev = None  # a backoff is only read between two records that both carry the scale
            continue
        if prev is not None and scale < prev.metrics[Metric.LOSS_SCALE]:
            for step in _overflowed(prev, record):
                if not found or found[-1] < step:
                    found.append(step)
        prev = record
    return found


def _overflowed(before: StepRecord, after: StepRecord) -> list[int]:
    """The steps of the pair around a backoff that overflowed: those whose grad norm is not finite, else the
    one before the drop."""
    nonfinite = [r.step for r in (before, after) if _nonfinite_grad_norm(r)]
    return nonfinite or [before.step]


def _nonfinite_grad_norm(record: StepRecord) -> bool:
    value = record.get(Metric.GRAD_NORM)
    return value is not None and not math.isfinite(value)


def needs_marking(names: Iterable[str]) -> bool:
    """Does a log with these metric names need its overflows found: a loss scale and no overflow flag."""
    names = set(names)
    return Metric.LOSS_SCALE in names and Metric.OVERFLOW not in names


def mark_table(steps: StepTable) -> int:
    """Mark the overflow steps of an importer's table (``overflow = 1``); how many were marked."""
    if not needs_marking(steps.names_seen):
        return 0
    found = overflow_steps(r for batch in steps.batches(4096) for r in batch)
    for step in found:
        steps.merge(step, {Metric.OVERFLOW: 1.0})
    return len(found)


def mark_records(records: list[StepRecord]) -> list[StepRecord]:
    """``records`` (in step order) with their overflow steps marked (``overflow = 1``)."""
    if not needs_marking(n for r in records for n in r.metrics):
        return records
    found = set(overflow_steps(records))
    return [replace(r, metrics={**r.metrics, Metric.OVERFLOW: 1.0}) if r.step in found else r for r in records]
