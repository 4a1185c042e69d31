"""Which rank hung a fleet: read from the hang reports every rank stored (pure: anomalies in, dicts out).

Each rank's watchdog stores a ``hang`` anomaly whose message starts ``rank N: no step for W s after step S``
and holds every thread's Python stack (:func:`stabmon.detect.hang.dump_stacks`, faulthandler's format: the
watchdog's own thread is ``Current thread``, the main thread is listed last). A rank whose main thread waits
in a collective (DDP's all-reduce inside ``backward``, ``all_reduce``, ``barrier``, ...) is a victim; the
*culprit* is the rank whose main thread is somewhere else (a dead-locked data loader, an endless loop). When
every rank waits in a collective, or none does, the culprit is the rank with the lowest last completed step
(it stopped first), if only one has it; else none is named. A rank that sent no report at all (rank 0 says so:
``rank N: no hang report within ...``; a stopped or frozen process writes nothing) is the culprit when the reporting
ranks all wait in a collective.

>>> victim = "rank 0: no step for 2.1 s after step 11 (...)\\n\\nstacks of every thread:\\n" \\
...     "Thread 0x1 (most recent call first):\\n  File \\"torch/autograd/graph.py\\", line 8 in _engine_run_backward\\n"
>>> culprit = "rank 1: no step for 0.5 s after step 11 (...)\\n\\nstacks of every thread:\\n" \\
...     "Thread 0x2 (most recent call first):\\n  File \\"job.py\\", line 30 in <module>\\n"
>>> from stabmon.events import Anomaly, Severity
>>> found = [Anomaly("hang", "step", 11, w, Severity.ERROR, "hang", message=m)
...          for w, m in ((2.1, victim), (0.5, culprit))]
>>> summary = hang_summary(found)
>>> summary["culprit"], [(r["rank"], r["in_collective"]) for r in summary["ranks"]]
(1, [(0, True), (1, False)])
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from stabmon.events import Anomaly

COLLECTIVE_FRAMES = ("_engine_run_backward", "backward", "all_reduce", "all_gather", "broadcast", "barrier",
                     "reduce_scatter", "all_to_all", "wait", "recv", "send")
"""Function names that mean a thread waits for its peers (a hang there is another rank's doing)."""

_HEAD = re.compile(r"^(?:rank (\d+): )?no step for ([0-9.e+-]+) s after step (-?\d+)")
_SILENT = re.compile(r"^rank (\d+): no hang report")
_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def main_stack(message: str) -> list[str]:
    """The main thread's frames (``file:line in function``, innermost first) of a hang report."""
    _, _, stacks = message.partition("stacks of every thread:")
    blocks = [b for b in re.split(r"\n(?=(?:Current thread|Thread) 0x)", stacks.strip()) if b.strip()]
    if not blocks:
        return []
    return [f"{f}:{line} in {fn}" for f, line, fn in _FRAME.findall(blocks[-1])]  # the main thread is last


def in_collective(frames: list[str]) -> bool:
    return any(frame.rsplit(" in ", 1)[-1] in COLLECTIVE_FRAMES for frame in frames)


def hang_summary(anomalies: Iterable[Any]) -> dict[str, Any] | None:
    """``{"ranks": [...], "culprit": rank or None, "why": str}`` of a run's hang reports (None: none)."""
    ranks: list[dict[str, Any]] = []
    for a in anomalies:
        if not isinstance(a, Anomaly) or a.kind != "hang":
            continue
        silent = _SILENT.match(a.message)
        head = _HEAD.match(a.message)
        frames = main_stack(a.message)
        rank = int(silent.group(1)) if silent else int(head.group(1)) if head and head.group(1) else 0
        ranks.append({"rank": rank, "step": a.step, "waited": a.score, "deadline": a.threshold,
                      "in_collective": in_collective(frames), "where": frames[:3], "id": a.id,
                      "silent": silent is not None})
    if not ranks:
        return None
    ranks.sort(key=lambda r: r["rank"])
    culprit, why = _culprit(ranks)
    return {"ranks": ranks, "culprit": culprit, "why": why}


def _culprit(ranks: list[dict[str, Any]]) -> tuple[int | None, str]:
    silent = [r for r in ranks if r["silent"]]
    if len(silent) == 1 and all(r["in_collective"] for r in ranks if not r["silent"]):
        return silent[0]["rank"], "it sent no hang report (stopped, frozen or dead); the others wait in a collective"
    ranks = [r for r in ranks if not r["silent"]] or ranks
    outside = [r for r in ranks if not r["in_collective"] and r["where"]]
    if len(outside) == 1 and len(ranks) > 1:
        return outside[0]["rank"], "its main thread is not in a collective; the others wait in one"
    lowest = min(r["step"] for r in ranks)
    first = [r for r in ranks if r["step"] == lowest]
    if len(first) == 1 and len(ranks) > 1:
        return first[0]["rank"], f"it stopped first (last step {lowest}, the others later)"
    return None, f"not told apart by {len(ranks)} report(s): every reporting rank stopped after step {lowest}"
