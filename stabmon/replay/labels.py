"""Labelled incidents (``LABELS.csv``) and the runs they refer to.

Columns: ``file, step_start, step_end, kind, label_source, note``, and optionally ``format``, ``pattern`` and
``run``. ``file`` is relative to the labels file and may be a glob (``410m-seed5_*.tsv``). Each label is put in
one of three categories by its ``kind``:

- ``numeric``: a numeric instability a detector should catch (spikes, divergence, loss-scale collapse or drop,
  collapse after resume, grad-norm blips); these make up recall.
- ``control``: a stretch known to be healthy (``none_control``, ``benign_*``, ``rollbacks_without_instability``);
  alerts inside it are false alarms, and it is reported on its own.
- ``other``: incidents that are not numeric (crash, exit, hang, throughput, rollback/data-skip records);
  reported separately, not counted in recall, and alerts inside their window are not false alarms.

How each file is read: the ``format`` column names an importer (``llmc``, ``nanogpt``, ``generic``,
``hf_trainer``, ...: :func:`stabmon.replay.importers.sniff.formats`); the ``pattern`` column holds a regular
expression as ``stabmon import --pattern`` takes it (several: one per line of the quoted cell) and reads the file
as format ``pattern``. A file whose row names neither is read with the command's ``--pattern`` when one is
given, else its format is sniffed. So one labels file can hold a corpus of mixed formats.

Which files are one run: a label's files (every file its glob matches, stitched as the segments of one
history), and the files of every label with the same ``run`` value. Nothing is guessed from a file name unless
it is asked for: with ``group_wandb`` (``--group-wandb``) a label's files are also joined with every file in the
same directory with the same run prefix (the name before a W&B run id, :func:`stabmon.replay.stitch.run_key`),
the behaviour of earlier releases.

>>> Label("a.log", 10, 12, "loss_spike_then_divergence", "author").category
'numeric'
>>> Label("a.log", 1, 9, "benign_overflow", "observed_by_us").category, Label("a", 5, 5, "hang", "x").category
('control', 'other')
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stabmon.replay.importers.base import ImportResult
from stabmon.replay.importers.pattern import compile_patterns
from stabmon.replay.importers.sniff import formats, import_file
from stabmon.replay.stitch import run_key, stitch

NUMERIC_WORDS = ("spike", "diverg", "collapse", "loss_scale_drop", "loss_jump", "blip", "nan")
CONTROL_PREFIXES = ("none", "benign", "rollbacks_without_instability")


@dataclass(frozen=True)
class Label:
    """One labelled incident (a row of LABELS.csv); ``format``, ``patterns`` and ``run`` are the optional
    columns (empty: sniffed, no pattern, the label's own run)."""

    file: str
    step_start: int
    step_end: int
    kind: str
    label_source: str
    note: str = ""
    format: str = ""
    patterns: tuple[str, ...] = ()
    run: str = ""
    where: str = ""  # "<labels file>:<line>", for errors found after parsing

    @property
    def category(self) -> str:
        kind = self.kind.lower()
        if kind.startswith(CONTROL_PREFIXES):
            return "control"
        if any(w in kind for w in NUMERIC_WORDS):
            return "numeric"
        return "other"


def read_labels(path: str | Path) -> list[Label]:
    """Parse a LABELS.csv; a malformed row raises ValueError naming ``<file>:<line>`` (and the column)."""
    labels = []
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = {"file", "step_start", "step_end", "kind"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(sorted(missing))}")
        for row in reader:
            where = f"{Path(path).name}:{reader.line_num}"
            try:
                start, end = int(row["step_start"]), int(row["step_end"])
            except (TypeError, ValueError):
                raise ValueError(f"{where}: step_start/step_end must be integers") from None
            if end < start:
                raise ValueError(f"{where}: step_end {end} < step_start {start}")
            fmt, patterns = _reading(row, f"{where} ({(row.get('file') or '').strip()})")
            labels.append(
                Label(
                    row["file"].strip(),
                    start,
                    end,
                    row["kind"].strip(),
                    (row.get("label_source") or "").strip(),
                    (row.get("note") or "").strip(),
                    format=fmt,
                    patterns=patterns,
                    run=(row.get("run") or "").strip(),
                    where=where,
                )
            )
    return labels


def _reading(row: dict[str, str], where: str) -> tuple[str, tuple[str, ...]]:
    """The row's ``format`` and ``pattern`` columns, checked: (format, patterns); a one-line ValueError naming
    the labels file and line, the row's file and the column.

    >>> _reading({"format": "llmc"}, "L.csv:2 (a.log)"), _reading({"pattern": "s=(?P<step>[0-9]+) l=(?P<loss>.+)"}, "")
    (('llmc', ()), ('pattern', ('s=(?P<step>[0-9]+) l=(?P<loss>.+)',)))
    >>> _reading({"format": "llmcc"}, "L.csv:2 (a.log)")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: L.csv:2 (a.log): column format: unknown format 'llmcc' (known: hf_trainer, llmc, ...)
    """
    fmt = (row.get("format") or "").strip()
    patterns = tuple(p.strip() for p in (row.get("pattern") or "").splitlines() if p.strip())
    if fmt and fmt not in (known := formats()):
        raise ValueError(f"{where}: column format: unknown format {fmt!r} (known: {', '.join(known)})")
    if patterns:
        if fmt not in ("", "pattern"):
            raise ValueError(f"{where}: column pattern: a pattern reads the file as format pattern, but column "
                             f"format says {fmt!r}")
        try:
            compile_patterns(patterns)
        except ValueError as exc:
            raise ValueError(f"{where}: column pattern: {str(exc).removeprefix('--pattern ')}") from None
        fmt = "pattern"
    elif fmt == "pattern":
        raise ValueError(f"{where}: column format: format pattern needs a regular expression in column pattern")
    return fmt, patterns


def label_files(label: Label, base: Path) -> list[Path]:
    """The files a label names (its glob, relative to ``base``)."""
    return sorted(p for p in base.glob(label.file) if p.is_file())


def run_files(label: Label, base: Path, *, group_wandb: bool = False) -> tuple[str, list[Path]]:
    """(run name, files) for a label on its own (the ``run`` column aside, see :func:`runs_of`): the files its
    glob matches, named by the label's ``file``. With ``group_wandb`` the same-prefix segments beside them are
    added and a multi-segment run is named ``<dir>/<prefix>`` (the grouping earlier releases guessed)."""
    files = label_files(label, base)
    if not group_wandb or not files:
        return label.file, files
    keys = {(p.parent, run_key(p)) for p in files}
    segments = sorted(
        {
            q
            for parent, key in keys
            for q in parent.iterdir()
            if q.is_file() and run_key(q) == key and q.suffix == files[0].suffix
        }
    )
    if len(segments) <= 1:
        return label.file, files
    parent, key = sorted(keys)[0]
    return str((parent / key).relative_to(base)), segments


@dataclass(frozen=True)
class RunSpec:
    """One run to evaluate: its files and how each is read (plain values: it crosses to worker processes and
    Ray tasks). ``readers`` holds, per file, ``(format, patterns)``; ``("", ())`` sniffs the format.
    ``error`` says why the run cannot be read at all (no file matches).

    >>> RunSpec("r", ()).error
    """

    name: str
    files: tuple[Path, ...]
    readers: tuple[tuple[str, tuple[str, ...]], ...] = ()
    error: str | None = None

    def read(self) -> ImportResult:
        """Import every file with its reader and stitch them into one run (one file: as read)."""
        if not self.files:
            raise ValueError("import: no files given")
        readers = self.readers or tuple(("", ()) for _ in self.files)
        results = [import_file(p, format=fmt or None, patterns=pats)
                   for p, (fmt, pats) in zip(self.files, readers, strict=True)]
        if len(results) == 1:
            return results[0]
        return stitch(results, [p.name for p in self.files])


def runs_of(
    labels: Sequence[Label], base: Path, *, patterns: Sequence[str] = (), group_wandb: bool = False
) -> tuple[dict[int, str], dict[str, RunSpec]]:
    """(label index -> run name, run name -> RunSpec) for labels relative to ``base``, runs in order of first
    label. A file is read as the rows naming it say (``format`` / ``pattern``), else with ``patterns`` when given,
    else sniffed; a file two rows say to read differently raises a ValueError naming the later row."""
    label_runs: dict[int, str] = {}
    members: dict[str, list[tuple[Label, list[Path]]]] = {}
    declared: dict[Path, Label] = {}  # file -> the first row that says how to read it
    for i, lb in enumerate(labels):
        name, files = run_files(lb, base, group_wandb=group_wandb)
        name = lb.run or name
        label_runs[i] = name
        members.setdefault(name, []).append((lb, files))
        for p in files if lb.format else ():
            first = declared.setdefault(p, lb)
            if (first.format, first.patterns) != (lb.format, lb.patterns):
                column = "pattern" if first.format == lb.format else "format"
                raise ValueError(f"{lb.where} ({lb.file}): column {column}: {lb.format}, but {first.where} reads "
                                 f"{p.name} as {first.format}"
                                 + (" with other patterns" if column == "pattern" else ""))
    default = ("pattern", tuple(patterns)) if patterns else ("", ())
    specs: dict[str, RunSpec] = {}
    for name, rows in members.items():
        # a label's own run is its first label's files, as before; a run column's run is all of its rows' files
        rows = rows if any(lb.run for lb, _ in rows) else rows[:1]
        files = sorted({p for _, fs in rows for p in fs})
        readers = tuple((declared[p].format, declared[p].patterns) if p in declared else default for p in files)
        empty = [lb.file for lb, fs in rows if not fs]
        error = f"no file matches {empty[0]!r} under the labels' directory" if empty else None
        specs[name] = RunSpec(name, tuple(files), readers, error)
    return label_runs, specs
