"""Any text log, read with regular expressions the user gives (``stabmon import --pattern REGEX``).

Each pattern is a Python regex with named groups: ``step`` is required, every other named group becomes a
metric of that name. A group named ``<metric>_ms`` or ``<metric>_us`` holds milliseconds or microseconds and is
stored as ``<metric>`` in seconds (``step_time_ms`` -> ``step_time``, the unit the live monitor records). A line
is searched with each pattern in turn and the first that matches is used; lines no pattern matches are not
data (a text log is mostly other text) and are skipped. A matched value that is not a number is a malformed
line. Lines for the same step are merged; a step lower than the last one read starts a new segment (a resume
from an older checkpoint), which supersedes the earlier steps from there on (listed in ``restarts``).

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "train.log"
>>> _ = p.write_text("booting\\niter 10: loss 2.61, time 21.3ms\\niter 20: loss oops, time 20.0ms\\n")
>>> r = read(p, patterns=[r"iter (?P<step>\\d+): loss (?P<loss>\\S+), time (?P<step_time_ms>[\\d.]+)ms"])
>>> [(x.step, dict(x.metrics)) for x in r.records], r.malformed
([(10, {'loss': 2.61, 'step_time': 0.0213})], 1)
>>> compile_patterns(["loss (?P<loss>\\\\S+)"])
Traceback (most recent call last):
...
ValueError: --pattern 'loss (?P<loss>\\S+)': no (?P<step>...) group
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stabmon.replay.importers.base import ImportResult
from stabmon.replay.importers.table import StepTable

FORMAT = "pattern"
PRIORITY = 80  # never sniffed: chosen by --pattern

UNITS = {"_ms": 1e-3, "_us": 1e-6, "_pct": 1e-2}
"""Group-name suffixes naming the unit of the value, with the factor to the stored unit (seconds, fraction)."""


@dataclass(frozen=True)
class LinePattern:
    """One compiled pattern: the regex, and per metric group the stored name and the unit factor."""

    regex: re.Pattern[str]
    metrics: tuple[tuple[str, str, float], ...]  # (group, metric name, factor)


def sniff(head: str) -> bool:
    """Never: a pattern is given, not guessed."""
    return False


def compile_patterns(patterns: Sequence[str]) -> list[LinePattern]:
    """Compile ``--pattern`` values; a bad regex, or one without a ``step`` group or any metric group, raises
    ValueError naming it."""
    if not patterns:
        raise ValueError("--pattern: no pattern given")
    return [_compile(p) for p in patterns]


def _compile(pattern: str) -> LinePattern:
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"--pattern '{pattern}': not a regular expression ({exc})") from None
    if "step" not in regex.groupindex:
        raise ValueError(f"--pattern '{pattern}': no (?P<step>...) group")
    metrics = tuple(_metric(g) for g in regex.groupindex if g != "step")
    if not metrics:
        raise ValueError(f"--pattern '{pattern}': no metric group besides step (e.g. (?P<loss>[-+.\\w]+))")
    return LinePattern(regex, metrics)


def _metric(group: str) -> tuple[str, str, float]:
    for suffix, factor in UNITS.items():
        if group.endswith(suffix) and len(group) > len(suffix):
            return group, group[: -len(suffix)], factor
    return group, group, 1.0


def read(path: Path, *, patterns: Sequence[str] | Sequence[LinePattern] = (), **_: Any) -> ImportResult:
    """Read a text log line by line with ``patterns`` (strings or compiled); see the module docstring."""
    compiled = [p if isinstance(p, LinePattern) else _compile(p) for p in patterns] or compile_patterns([])
    return read_lines(path, compiled, FORMAT)


def read_lines(path: Path, patterns: Sequence[LinePattern], fmt: str) -> ImportResult:
    """The shared reader of the pattern-based formats (``pattern`` and ``nanogpt``)."""
    steps = StepTable()
    result = ImportResult(fmt, steps=steps)
    name = Path(path).name
    last: int | None = None
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line_no, line in enumerate(fh, 1):
            parsed = _parse(line, patterns, f"{name}:{line_no}", result)
            if parsed is None:
                continue
            step, metrics = parsed
            if last is not None and step < last:
                result.restarts.append(step)
                steps.drop_from(step)
            last = step
            steps.merge(step, metrics)
    return result


def _parse(line: str, patterns: Sequence[LinePattern], where: str,
           result: ImportResult) -> tuple[int, dict[str, float]] | None:
    """(step, metrics) of a line the first matching pattern reads; None for other text or a malformed line
    (counted)."""
    for pattern in patterns:
        m = pattern.regex.search(line)
        if m is None:
            continue
        try:
            step = int(m.group("step"))
            metrics = {metric: float(m.group(g)) * factor for g, metric, factor in pattern.metrics
                       if m.group(g) is not None}
        except (TypeError, ValueError):
            result.problem(where, f"not a number in {line.strip()[:60]!r}")
            return None
        return step, metrics
    return None
