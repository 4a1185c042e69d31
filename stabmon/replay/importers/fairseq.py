"""fairseq / metaseq ``train_inner`` JSON log lines.

fairseq's progress bar in ``--log-format json`` mode prints one JSON object per logged update, every value as
a string (``"loss": "16.475"``), after a ``| INFO | train_inner |`` prefix. fp16 overflows are printed between
them as ``NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: 2.0``; the skipped
attempt does not advance ``num_updates``, so the overflow is attached to the next logged update (``overflow =
1.0`` and the new ``loss_scale``) and the raw line is kept in ``events``. metaseq prints the same dicts
(sometimes with a ``| train_inner |`` prefix and no level); both are read.

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "train.log"
>>> _ = p.write_text('x | INFO | train_inner | {"loss": "2.5", "num_updates": "1", "gnorm": "0.7"}\\n'
...                  'x | INFO | fairseq.trainer | NOTE: gradient overflow detected, ignoring gradient, '
...                  'setting loss scale to: 2.0\\n'
...                  'x | INFO | train_inner | {"loss": "3.5", "num_updates": "2", "loss_scale": "2"}\\n')
>>> r = read(p)
>>> [(x.step, dict(x.metrics)) for x in r.records]
[(1, {'loss': 2.5, 'grad_norm': 0.7}), (2, {'loss': 3.5, 'loss_scale': 2.0, 'overflow': 1.0})]
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from stabmon.events import Metric
from stabmon.replay.importers.base import ImportResult
from stabmon.replay.importers.table import StepTable

FORMAT = "fairseq"

_TRAIN_INNER = re.compile(r"\|\s*train_inner\s*\|\s*(.*?)\s*$")
_OVERFLOW = re.compile(r"gradient overflow detected.*?loss scale to:\s*([-+0-9.eE]+|inf|nan)", re.IGNORECASE)

# fairseq key -> stabmon metric; keys not listed are ignored (epoch, ups, wpb, bsz, gb_free, wall...).
FIELDS = {
    "loss": Metric.LOSS,
    "gnorm": Metric.GRAD_NORM,
    "loss_scale": Metric.LOSS_SCALE,
    "lr": Metric.LR,
    "wps": Metric.TOKENS_PER_SEC,
}


def sniff(head: str) -> bool:
    return "| train_inner |" in head or "gradient overflow detected, ignoring gradient" in head


def _number(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"not a number: {value!r}")
    return float(value)


def _parse_update(obj: dict[str, Any]) -> tuple[int, dict[str, float]]:
    step = int(_number(obj["num_updates"]))
    metrics: dict[str, float] = {}
    for key, metric in FIELDS.items():
        if key in obj:
            metrics[metric] = _number(obj[key])
    return step, metrics


def read(path: Path, **options: Any) -> ImportResult:
    """Read a fairseq/metaseq log; ``options`` are accepted for a uniform call signature and ignored."""
    steps = StepTable()
    result = ImportResult(FORMAT, steps=steps)
    pending_overflow: float | None = None
    last_step: int | None = None
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line_no, line in enumerate(fh, 1):
            where = f"{Path(path).name}:{line_no}"
            over = _OVERFLOW.search(line)
            if over:
                result.event(last_step, line.strip())
                try:
                    pending_overflow = float(over.group(1))
                except ValueError:
                    result.problem(where, "unreadable loss scale in overflow note")
                continue
            m = _TRAIN_INNER.search(line)
            if not m:
                continue
            try:
                obj = json.loads(m.group(1))
                step, metrics = _parse_update(obj)
            except (ValueError, KeyError, TypeError) as exc:
                result.problem(where, f"unreadable train_inner record ({type(exc).__name__}: {exc})")
                continue
            if pending_overflow is not None:
                metrics[Metric.OVERFLOW] = 1.0
                metrics.setdefault(Metric.LOSS_SCALE, pending_overflow)
                pending_overflow = None
            if last_step is not None and step <= last_step:  # a resume from an older checkpoint
                result.restarts.append(step)
                steps.drop_from(step)
            steps.put(step, metrics)
            last_step = step
    if pending_overflow is not None and math.isfinite(pending_overflow):
        steps.put((last_step or 0) + 1, {Metric.OVERFLOW: 1.0, Metric.LOSS_SCALE: pending_overflow})
    return result
