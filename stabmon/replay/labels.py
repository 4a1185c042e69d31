"""Labelled incidents (``LABELS.csv``) and the runs they refer to.

Columns: ``file, step_start, step_end, kind, label_source, note``. ``file`` is relative to the labels file and
may be a glob (``410m-seed5_*.tsv``). Each label is put in one of three categories by its ``kind``:

- ``numeric``: a numeric instability a detector should catch (spikes, divergence, loss-scale collapse or drop,
  collapse after resume, grad-norm blips); these make up recall.
- ``control``: a stretch known to be healthy (``none_control``, ``benign_*``, ``rollbacks_without_instability``);
  alerts inside it are false alarms, and it is reported on its own.
- ``other``: incidents that are not numeric (crash, exit, hang, throughput, rollback/data-skip records);
  reported separately, not counted in recall, and alerts inside their window are not false alarms.

A run is a set of files: a label's files plus every file in the same directory with the same run prefix (the
name before a W&B run id), so the segments of a resumed run are evaluated stitched, as one history.

>>> Label("a.log", 10, 12, "loss_spike_then_divergence", "author").category
'numeric'
>>> Label("a.log", 1, 9, "benign_overflow", "observed_by_us").category, Label("a", 5, 5, "hang", "x").category
('control', 'other')
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from stabmon.replay.stitch import run_key

NUMERIC_WORDS = ("spike", "diverg", "collapse", "loss_scale_drop", "loss_jump", "blip", "nan")
CONTROL_PREFIXES = ("none", "benign", "rollbacks_without_instability")


@dataclass(frozen=True)
class Label:
    """One labelled incident (a row of LABELS.csv)."""

    file: str
    step_start: int
    step_end: int
    kind: str
    label_source: str
    note: str = ""

    @property
    def category(self) -> str:
        kind = self.kind.lower()
        if kind.startswith(CONTROL_PREFIXES):
            return "control"
        if any(w in kind for w in NUMERIC_WORDS):
            return "numeric"
        return "other"


def read_labels(path: str | Path) -> list[Label]:
    """Parse a LABELS.csv; a malformed row raises ValueError naming ``<file>:<line>``."""
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
            labels.append(
                Label(
                    row["file"].strip(),
                    start,
                    end,
                    row["kind"].strip(),
                    (row.get("label_source") or "").strip(),
                    (row.get("note") or "").strip(),
                )
            )
    return labels


def label_files(label: Label, base: Path) -> list[Path]:
    """The files a label names (its glob, relative to ``base``)."""
    return sorted(p for p in base.glob(label.file) if p.is_file())


def run_files(label: Label, base: Path) -> tuple[str, list[Path]]:
    """(run name, files) for a label: its files plus same-prefix segments beside them. The run name is the
    relative ``<dir>/<prefix>`` for multi-segment runs, else the label's file."""
    files = label_files(label, base)
    if not files:
        return label.file, []
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
