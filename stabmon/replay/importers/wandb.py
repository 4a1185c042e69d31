"""Weights & Biases history exports: CSV or TSV with a step column.

What ``wandb.Api().run(...).scan_history(keys=[...])`` or the UI's "Export CSV" produces: a header naming the
logged keys (``train/lm_loss``, ``train/grad_norm``...) and ``_step`` or ``step``, one row per logged step.
One file is one W&B run, i.e. one job segment; :func:`stabmon.replay.stitch.stitch` joins the segments of a
resumed run. Column names are mapped through :data:`stabmon.replay.importers.generic.KNOWN_COLUMNS` plus
``mapping``.

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "410m-seed2_abcd1234.tsv"
>>> _ = p.write_text("train/lm_loss\\tstep\\n3.40\\t1\\n3.38\\t2\\n")
>>> sniff(p.read_text()), [(r.step, r.get("loss")) for r in read(p).records]
(True, [(1, 3.4), (2, 3.38)])
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stabmon.replay.importers import generic
from stabmon.replay.importers.base import ImportResult

FORMAT = "wandb"
PRIORITY = 80  # after the log-line formats, before the catch-all generic table

_STEP_HEADERS = {"_step", "step", "trainer/global_step", "train/global_step", "global_step"}


def sniff(head: str) -> bool:
    first = head.lstrip("\ufeff").split("\n", 1)[0].strip()
    sep = "\t" if "\t" in first else ","
    cols = [c.strip().strip('"') for c in first.split(sep)]
    if len(cols) < 2 or not _STEP_HEADERS.intersection(cols):
        return False
    return "_step" in cols or any("/" in c for c in cols) or any(c in generic.KNOWN_COLUMNS for c in cols)


def read(
    path: Path, *, mapping: Mapping[str, str] | None = None, step_column: str | None = None, **_: Any
) -> ImportResult:
    """Read one exported W&B history file (one segment)."""
    name = Path(path).name
    try:
        df = generic.read_frame(Path(path))
    except Exception as exc:  # noqa: BLE001 - reported, never raised
        result = ImportResult(format=FORMAT, records=[])
        result.problem(name, f"unreadable table ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
        return result
    return generic.table_to_result(df, fmt=FORMAT, name=name, mapping=mapping, step_column=step_column)
