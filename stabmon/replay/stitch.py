"""Join the segments of one run (W&B runs of a resumed job) into one step series.

A job that restarts from a checkpoint logs a new W&B run (a new segment). When it resumed from an *older*
checkpoint than where the previous segment stopped, the segments overlap; the later segment is what the model
actually became, so it supersedes the earlier one from its first step on, and that step is recorded as a
restart. Segments are ordered by (first step, last step): of two segments starting at the same step, the one
that ended first was the aborted attempt.

Which files are one run is said, never guessed: a labels file's glob or ``run`` column
(:mod:`stabmon.replay.labels`), or the files given to one ``stabmon replay``. Only when it is asked for
(``--group-wandb``) are files joined because they share the prefix before a W&B run id
(:func:`run_key`: ``410m-seed5_4cpv52gc.tsv`` and ``410m-seed5_i8jjatq1.tsv`` are run ``410m-seed5``); a name
that merely ends in ``_`` and 8 letters or digits is otherwise just a name.

>>> from stabmon.events import StepRecord
>>> from stabmon.replay.importers.base import ImportResult
>>> a = ImportResult("wandb", [StepRecord(s, {"loss": 1.0}) for s in range(1, 6)])
>>> b = ImportResult("wandb", [StepRecord(s, {"loss": 2.0}) for s in range(4, 8)])
>>> r = stitch([b, a])
>>> [(x.step, x.get("loss")) for x in r.records], r.restarts
([(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0), (6, 2.0), (7, 2.0)], [4])
>>> run_key("410m-seed5_4cpv52gc.tsv"), run_key("main.log")
('410m-seed5', 'main')
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from stabmon.replay.importers.base import ImportResult

_WANDB_ID = re.compile(r"^(?P<prefix>.+)_(?P<id>[a-z0-9]{8})$")


def run_key(path: str | Path) -> str:
    """The run a file belongs to when grouping by W&B run id is asked for: the stem without a trailing
    ``_<8-character W&B run id>``."""
    stem = Path(path).name.split(".")[0]
    m = _WANDB_ID.match(stem)
    return m.group("prefix") if m else stem


def group_segments(paths: Iterable[Path]) -> dict[str, list[Path]]:
    """Group files by (directory, :func:`run_key`); keys are ``"<dir>/<run key>"`` strings, files sorted."""
    groups: dict[str, list[Path]] = {}
    for p in sorted(set(Path(x) for x in paths)):
        groups.setdefault(str(p.parent / run_key(p)), []).append(p)
    return groups


def stitch(segments: Sequence[ImportResult], names: Sequence[str] | None = None) -> ImportResult:
    """One ImportResult from several segments; malformed counts, problems and events are summed."""
    if not segments:
        raise ValueError("stitch: no segments given")
    labelled = list(zip(segments, names or [f"segment {i}" for i in range(len(segments))], strict=True))
    labelled = [(s, n) for s, n in labelled if s.records] + [(s, n) for s, n in labelled if not s.records]
    labelled.sort(
        key=lambda sn: (sn[0].records[0].step, sn[0].records[-1].step) if sn[0].records else (1 << 62, 0)
    )
    formats = sorted({s.format for s in segments})
    out = ImportResult(format=formats[0] if len(formats) == 1 else "+".join(formats), records=[])
    for seg, name in labelled:
        out.malformed += seg.malformed
        out.problems.extend(seg.problems[: max(0, out.MAX_PROBLEMS - len(out.problems))])
        out.events.extend(seg.events[: max(0, out.MAX_EVENTS - len(out.events))])
        out.events_total += seg.events_total
        out.restarts.extend(seg.restarts)
        if not seg.records:
            continue
        first = seg.records[0].step
        if out.records and first <= out.records[-1].step:
            out.restarts.append(first)
            out.event(
                first,
                f"{name}: resumed at step {first}, superseding steps "
                f"{first}..{out.records[-1].step} of the previous segment",
            )
            out.records = [r for r in out.records if r.step < first]
        elif out.records:
            out.event(first, f"{name}: resumed at step {first}")
        out.records.extend(seg.records)
    out.restarts = sorted(set(out.restarts))
    return out
