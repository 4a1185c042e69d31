"""Megatron-LM / Megatron-DeepSpeed ``training_log`` text lines.

One line per logged iteration::

    [rank prefix] iteration N/ TOTAL | consumed samples: ... | elapsed time per iteration (ms): ... |
    learning rate: ... | global batch size: ... | lm loss: ... | loss scale: ... | grad norm: ... | ...

What real logs do, and how it is read:

- rank prefixes (``[default7]:``) and leading blanks are ignored;
- lines hard-wrapped at a fixed width (BigScience tr11's throughput chronicle) are joined back until the
  record ends with ``|``; field names are compared without whitespace, so ``number of nan`` / ``iterations``
  still match;
- a missing field (tr8-104B exp12 it9027 has no ``lm loss``) leaves the metric absent;
- DeepSpeed ``OVERFLOW!`` lines mark the next iteration as skipped (``overflow = 1``); on a skipped step
  Megatron repeats the previous grad norm, so a grad norm equal to the previous one on an overflow step (or on
  a step whose loss scale fell) is dropped as stale, and the latter is marked ``overflow = 1`` too;
- ``grad norm: 0.000`` means the run did not compute it (tr1-13B) and is dropped;
- ``elapsed time per iteration (ms|s)`` becomes ``step_time`` in seconds; validation lines become
  ``val_loss``;
- tracebacks, watchdog ALERT/PULSE lines, checkpoint saves and exits are kept in ``events``.

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "log.txt"
>>> _ = p.write_text(" iteration 5/ 10 | elapsed time per iteration (ms): 1500.0 | lm loss: 2.5E+00 | "
...                  "loss scale: 4096.0 | grad norm: 0.7 |\\n")
>>> r = read(p)
>>> r.records[0].step, dict(r.records[0].metrics)
(5, {'step_time': 1.5, 'loss': 2.5, 'loss_scale': 4096.0, 'grad_norm': 0.7})
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from stabmon.events import Metric
from stabmon.replay.importers.base import ImportResult
from stabmon.replay.importers.table import StepTable

FORMAT = "megatron"
PRIORITY = 10  # before deepspeed: Megatron-DeepSpeed logs also carry DeepSpeed OVERFLOW lines

_ITER = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_VALID = re.compile(r"valid(?:ation)? loss at iteration\s+(\d+)\s*\|\s*lm loss value:\s*([-+0-9.eEnaif]+)",
                    re.I)
_OVERFLOW = re.compile(r"OVERFLOW!.*?Attempted loss scale:\s*([-+0-9.eE]+)", re.I)
_EVENT = re.compile(r"Traceback|Error|ALERT|PULSE|saving checkpoint|exiting program|diverged", re.I)
_MAX_WRAP = 6

# whitespace-free lower-case field name -> (metric, factor)
FIELDS: dict[str, tuple[str, float]] = {
    "lmloss": (Metric.LOSS, 1.0),
    "lossscale": (Metric.LOSS_SCALE, 1.0),
    "gradnorm": (Metric.GRAD_NORM, 1.0),
    "elapsedtimeperiteration(ms)": (Metric.STEP_TIME, 1e-3),
    "elapsedtimeperiteration(s)": (Metric.STEP_TIME, 1.0),
    "learningrate": (Metric.LR, 1.0),
    "samplespersecond": ("samples_per_sec", 1.0),
    "tflops": ("tflops", 1.0),
    "globalbatchsize": ("batch_size", 1.0),
    "numberofskippediterations": ("skipped_iterations", 1.0),
    "numberofnaniterations": ("nan_iterations", 1.0),
}


def sniff(head: str) -> bool:
    return bool(_ITER.search(head)) and ("lm loss" in head or "consumed samples" in head)


def _key(text: str) -> str:
    return re.sub(r"\s+", "", text).lower()


def parse_fields(text: str) -> tuple[dict[str, float], list[str]]:
    """Metrics from the ``key: value |`` fields after the iteration counter, and the fields that were
    unreadable."""
    metrics: dict[str, float] = {}
    bad: list[str] = []
    for field in text.split("|"):
        if ":" not in field:
            continue
        name, _, raw = field.rpartition(":")
        spec = FIELDS.get(_key(name))
        if spec is None:
            continue
        try:
            value = float(_key(raw))
        except ValueError:
            bad.append(field.strip())
            continue
        metrics[spec[0]] = value * spec[1]
    return metrics, bad


def _logical_lines(lines: Iterable[str]) -> Iterator[tuple[int, str]]:
    """Join hard-wrapped iteration records back into one line each (with the first physical line number);
    reads ``lines`` one at a time with one line of look-ahead."""
    it = enumerate(lines, 1)
    ahead = next(it, None)
    while ahead is not None:
        line_no, line = ahead[0], ahead[1].rstrip("\n")
        ahead = next(it, None)
        if _ITER.search(line):
            wraps = 0
            while not line.rstrip().endswith("|") and ahead is not None and wraps < _MAX_WRAP:
                nxt = ahead[1].rstrip("\n")
                if _ITER.search(nxt) or _OVERFLOW.search(nxt) or not nxt.strip():
                    break
                line += nxt
                ahead = next(it, None)
                wraps += 1
        yield line_no, line


def _stale(metrics: dict[str, float], prev: dict[str, float] | None, overflow: bool) -> bool:
    if prev is None or metrics.get(Metric.GRAD_NORM) is None:
        return False
    if metrics[Metric.GRAD_NORM] != prev.get(Metric.GRAD_NORM):
        return False
    scale, old = metrics.get(Metric.LOSS_SCALE), prev.get(Metric.LOSS_SCALE)
    return overflow or (scale is not None and old is not None and scale < old)


def read(path: Path, **options: Any) -> ImportResult:
    """Read a Megatron(-DeepSpeed) log, one line at a time; ``options`` are accepted for a uniform signature
    and ignored."""
    steps = StepTable()
    result = ImportResult(FORMAT, steps=steps)
    with open(path, encoding="utf-8", errors="replace") as fh:
        _read_lines(Path(path).name, fh, steps, result)
    return result


def _read_lines(name: str, lines: Iterable[str], steps: StepTable, result: ImportResult) -> None:
    prev: dict[str, float] | None = None
    last_step: int | None = None
    pending_overflow = False
    for line_no, line in _logical_lines(lines):
        where = f"{name}:{line_no}"
        if _OVERFLOW.search(line):
            pending_overflow = True
            result.event(last_step, line.strip())
            continue
        valid = _VALID.search(line)
        if valid:
            try:
                val_loss = float(valid.group(2))
                steps.merge(int(valid.group(1)), {Metric.VAL_LOSS: val_loss})
            except ValueError:
                result.problem(where, "unreadable validation loss")
            continue
        m = _ITER.search(line)
        if m is None:
            if _EVENT.search(line):
                result.event(last_step, line.strip())
            continue
        step = int(m.group(1))
        metrics, bad = parse_fields(line[m.end():])
        if bad:
            result.problem(where, f"unreadable field(s): {'; '.join(bad)[:120]}")
        if not line.rstrip().endswith("|"):
            result.problem(where, "iteration record cut short")
        if not metrics:
            continue
        if metrics.get(Metric.GRAD_NORM) == 0.0:
            del metrics[Metric.GRAD_NORM]
        if _stale(metrics, prev, pending_overflow):
            del metrics[Metric.GRAD_NORM]
            pending_overflow = True
        if pending_overflow:
            metrics[Metric.OVERFLOW] = 1.0
        pending_overflow = False
        if last_step is not None and step <= last_step:
            result.restarts.append(step)
            steps.drop_from(step)
        steps.merge(step, metrics)
        prev = {**(prev or {}), **metrics}
        last_step = step
