"""llm.c ``main.log`` lines: ``s:<step> trl:<train loss> lr:<lr> norm:<grad norm>``, ``s:<step> tel:<val
loss>``, ``s:<step> eval:<HellaSwag accuracy>``.

Lines for the same step are merged into one record (llm.c writes the validation loss of step N before its
training line). A step lower than the last training step starts a new segment (a resume from an older
checkpoint): the later segment supersedes the earlier one from that step on, and the step is listed in
``restarts``.

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "main.log"
>>> _ = p.write_text("s:0 tel:11.0\\ns:0 trl:11.01 lr:0.000001 norm:14.96\\n"
...                  "s:1 trl:10.9 lr:0.000002 norm:oops\\n")
>>> r = read(p)
>>> [(x.step, dict(x.metrics)) for x in r.records], r.malformed
([(0, {'val_loss': 11.0, 'loss': 11.01, 'lr': 1e-06, 'grad_norm': 14.96})], 1)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from stabmon.events import Metric
from stabmon.replay.importers.base import ImportResult
from stabmon.replay.importers.table import StepTable

FORMAT = "llmc"
PRIORITY = 10

_LINE = re.compile(r"^s:(\d+)((?:\s+[a-z]+:\S+)+)\s*$")
_HEAD = re.compile(r"^s:\d+ (?:trl|tel|eval):", re.M)
FIELDS = {
    "trl": Metric.LOSS,
    "lr": Metric.LR,
    "norm": Metric.GRAD_NORM,
    "tel": Metric.VAL_LOSS,
    "eval": "hellaswag",
}


def sniff(head: str) -> bool:
    return bool(_HEAD.search(head))


def read(path: Path, **options: Any) -> ImportResult:
    """Read an llm.c main.log; ``options`` are accepted for a uniform signature and ignored."""
    steps = StepTable()
    result = ImportResult(FORMAT, steps=steps)
    name = Path(path).name
    last_train: int | None = None
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line_no, line in enumerate(fh, 1):
            text = line.strip()
            if not text:
                continue
            m = _LINE.match(text)
            if m is None:
                result.problem(f"{name}:{line_no}", f"not an llm.c log line: {text[:60]!r}")
                continue
            step = int(m.group(1))
            try:
                metrics = {FIELDS[k]: float(v) for k, v in (t.split(":", 1) for t in m.group(2).split())
                           if k in FIELDS}
            except ValueError:
                result.problem(f"{name}:{line_no}", f"unreadable value in {text[:60]!r}")
                continue
            if not metrics:
                result.problem(f"{name}:{line_no}", f"no known field in {text[:60]!r}")
                continue
            if Metric.LOSS in metrics:
                if last_train is not None and step <= last_train:
                    result.restarts.append(step)
                    steps.drop_from(step)
                last_train = step
            steps.merge(step, metrics)
    return result
