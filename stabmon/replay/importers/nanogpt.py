"""nanoGPT's ``train.py`` output: ``iter 310: loss 2.6061, time 21.30ms, mfu 0.05%`` per logged iteration and
``step 250: train loss 2.4012, val loss 2.4987`` per evaluation.

The iteration line gives ``loss``, ``step_time`` (seconds) and ``mfu`` (a fraction; nanoGPT prints -100% until
its estimate starts, which is left out); the evaluation line gives ``val_loss`` and ``eval_train_loss`` (the
training loss averaged over the evaluation batches, not the step's loss). Both carry nanoGPT's ``iter_num``, so
an evaluation and the iteration that follows it share a step. Other lines are skipped. The reading is that of
:mod:`stabmon.replay.importers.pattern` with these two patterns.

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "out.txt"
>>> _ = p.write_text("step 0: train loss 4.2874, val loss 4.2823\\n"
...                  "iter 0: loss 4.2654, time 29.12ms, mfu -100.00%\\n"
...                  "iter 10: loss 3.2431, time 20.00ms, mfu 0.05%\\n")
>>> [(x.step, sorted(x.metrics)) for x in read(p).records]
[(0, ['eval_train_loss', 'loss', 'step_time', 'val_loss']), (10, ['loss', 'mfu', 'step_time'])]
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from stabmon.replay.importers.base import ImportResult
from stabmon.replay.importers.pattern import compile_patterns, read_lines

FORMAT = "nanogpt"
PRIORITY = 30

_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf)"
PATTERNS = (
    rf"^iter (?P<step>\d+): loss (?P<loss>{_NUM}), time (?P<step_time_ms>{_NUM})ms"
    rf"(?:, mfu (?:(?P<mfu_pct>\d[\d.]*)|{_NUM})%)?",
    rf"^step (?P<step>\d+): train loss (?P<eval_train_loss>{_NUM}), val loss (?P<val_loss>{_NUM})",
)
_SNIFF = re.compile(r"^iter \d+: loss \S+, time \S+ms", re.M)


def sniff(head: str) -> bool:
    return bool(_SNIFF.search(head))


def read(path: Path, **_: Any) -> ImportResult:
    """Read nanoGPT's printed output; options are accepted for a uniform signature and ignored."""
    return read_lines(path, compile_patterns(PATTERNS), FORMAT)
