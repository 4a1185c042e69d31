"""Generic tabular logs: CSV / TSV / JSON lines / Parquet, with a column mapping.

``read(path, mapping={"train/loss": "loss"}, step_column="step")`` reads the file with polars, takes the step
from ``step_column`` (default: the first of ``step``, ``_step``, ``global_step``, ``trainer/global_step``,
``iteration`` present; else the row number) and renames columns through ``mapping`` (column -> stabmon metric
name). Columns the mapping does not name are matched against :data:`KNOWN_COLUMNS` (common W&B / HF /
Lightning names); other columns are kept under their own names (their non-numeric cells silently skipped)
unless ``keep_unmapped=False``. Every value is read as text first and converted here, so a malformed cell is
counted (``ImportResult.malformed``) instead of failing the file.

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "log.csv"
>>> _ = p.write_text("step,train/loss,acc\\n1,2.5,0.1\\n2,oops,0.2\\n3,2.4,0.3\\n")
>>> r = read(p, mapping={"train/loss": "loss"}, keep_unmapped=False)
>>> [(x.step, dict(x.metrics)) for x in r.records], r.malformed
([(1, {'loss': 2.5}), (2, {}), (3, {'loss': 2.4})], 1)
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import polars as pl

from stabmon.events import Metric, StepRecord
from stabmon.replay.importers.base import ImportResult

FORMAT = "generic"
PRIORITY = 90  # tried last by auto-detection: it accepts almost any table

STEP_COLUMNS = (
    "step",
    "_step",
    "global_step",
    "trainer/global_step",
    "train/global_step",
    "iteration",
    "iter",
)
TIME_COLUMNS = ("_timestamp", "timestamp", "time")
IGNORED = frozenset({"_runtime", "epoch", "train/epoch", "_wandb"})

KNOWN_COLUMNS: dict[str, str] = {
    "loss": Metric.LOSS,
    "train/loss": Metric.LOSS,
    "train/lm_loss": Metric.LOSS,
    "train_loss": Metric.LOSS,
    "lm_loss": Metric.LOSS,
    "lm loss": Metric.LOSS,
    "train/ce_loss": Metric.LOSS,
    "val_loss": Metric.VAL_LOSS,
    "val/loss": Metric.VAL_LOSS,
    "eval/loss": Metric.VAL_LOSS,
    "eval_loss": Metric.VAL_LOSS,
    "validation/lm_loss": Metric.VAL_LOSS,
    "grad_norm": Metric.GRAD_NORM,
    "gnorm": Metric.GRAD_NORM,
    "train/grad_norm": Metric.GRAD_NORM,
    "train/gnorm": Metric.GRAD_NORM,
    "optim/total_grad_norm": Metric.GRAD_NORM,
    "grad_norm_total": Metric.GRAD_NORM,
    "loss_scale": Metric.LOSS_SCALE,
    "train/loss_scale": Metric.LOSS_SCALE,
    "lr": Metric.LR,
    "learning_rate": Metric.LR,
    "train/lr": Metric.LR,
    "train/learning_rate": Metric.LR,
    "lr-adamw": Metric.LR,
    "step_time": Metric.STEP_TIME,
    "tokens_per_sec": Metric.TOKENS_PER_SEC,
}


def sniff(head: str) -> bool:
    """A Parquet magic number, a JSON object on the first line, or a header row followed by a data row with
    the same number of fields, at least one of them numeric."""
    if head.startswith("PAR1"):
        return True
    lines = [ln.strip() for ln in head.lstrip("\ufeff").split("\n", 3)[:3]]
    first = lines[0]
    if first.startswith("{") and first.endswith("}"):
        try:
            return isinstance(json.loads(first), dict)
        except ValueError:
            return False
    if len(lines) < 2 or first.startswith("#"):
        return False
    sep = "\t" if "\t" in first else ","
    header, row = first.split(sep), lines[1].split(sep)
    if len(header) < 2 or len(header) != len(row) or any(_is_number(h) for h in header):
        return False
    return any(_is_number(v) for v in row)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_mapping(items: list[str] | tuple[str, ...] | None) -> dict[str, str]:
    """``["train/loss=loss", ...]`` -> ``{"train/loss": "loss"}``; raises ValueError naming the bad item."""
    out: dict[str, str] = {}
    for item in items or ():
        col, sep, metric = item.rpartition("=")
        if not sep or not col.strip() or not metric.strip():
            raise ValueError(f"import.map: expected COLUMN=METRIC, got {item!r}")
        out[col.strip()] = metric.strip()
    return out


def read_frame(path: Path) -> pl.DataFrame:
    """The table in ``path``: Parquet by its magic bytes, JSON lines, else CSV or TSV."""
    head = Path(path).open("rb").read(4)
    if head == b"PAR1":
        return pl.read_parquet(path)
    with open(path, encoding="utf-8", errors="replace") as fh:
        first = fh.readline().lstrip("\ufeff").strip()
    if first.startswith("{"):
        return _read_jsonl(path)
    sep = "\t" if first.count("\t") >= first.count(",") and "\t" in first else ","
    with warnings.catch_warnings():  # ragged rows are handled (truncated), not worth a warning per chunk
        warnings.simplefilter("ignore")
        return pl.read_csv(
            path,
            separator=sep,
            infer_schema=False,
            truncate_ragged_lines=True,
            encoding="utf8-lossy",
            ignore_errors=True,
            quote_char='"',
        )


def _read_jsonl(path: Path) -> pl.DataFrame:
    rows: list[dict[str, str | None]] = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                obj = None
            if not isinstance(obj, dict):
                rows.append({"__malformed__": line[:80]})
                continue
            rows.append({str(k): None if v is None else str(v) for k, v in obj.items()})
    return pl.DataFrame(rows, infer_schema_length=None) if rows else pl.DataFrame()


def _to_float(text: Any) -> float:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    s = str(text).strip()
    if s.lower() in {"nan", "inf", "-inf", "+inf", "infinity", "-infinity"}:
        return float(s)
    return float(s)


def table_to_result(
    df: pl.DataFrame,
    *,
    fmt: str,
    name: str,
    mapping: Mapping[str, str] | None = None,
    step_column: str | None = None,
    keep_unmapped: bool = True,
) -> ImportResult:
    """Convert an all-text (or numeric) frame to StepRecords; shared by the W&B importer."""
    result = ImportResult(format=fmt, records=[])
    if "__malformed__" in df.columns:
        bad = df.get_column("__malformed__").drop_nulls()
        for text in bad.to_list():
            result.problem(f"{name}:?", f"not a JSON object: {text!r}"[:120])
        df = df.filter(pl.col("__malformed__").is_null()).drop("__malformed__")
    mapping = dict(mapping or {})
    step_col = step_column or next((c for c in STEP_COLUMNS if c in df.columns), None)
    if step_column and step_column not in df.columns:
        result.problem(
            name, f"step column {step_column!r} not found (columns: {', '.join(df.columns)[:200]})"
        )
        return result
    time_col = next((c for c in TIME_COLUMNS if c in df.columns and c not in mapping), None)
    columns: dict[str, str] = {}
    strict: set[str] = set()  # mapped or well-known columns: an unreadable cell there is a malformed row
    for col in df.columns:
        if col in (step_col, time_col) or col in IGNORED:
            continue
        if col in mapping or col in KNOWN_COLUMNS:
            columns[col] = mapping.get(col) or KNOWN_COLUMNS[col]
            strict.add(col)
        elif keep_unmapped:
            columns[col] = col
    by_step: dict[int, StepRecord] = {}
    for row_no, row in enumerate(df.iter_rows(named=True), 2):
        where = f"{name}:{row_no}"
        try:
            step = row_no - 2 if step_col is None else int(_to_float(row[step_col]))
        except (TypeError, ValueError, OverflowError):
            result.problem(where, f"unreadable step {row.get(step_col or '')!r}"[:120])
            continue
        metrics: dict[str, float] = {}
        for col, metric in columns.items():
            value = row[col]
            if value is None or (isinstance(value, str) and not value.strip()):
                continue
            try:
                metrics[metric] = _to_float(value)
            except (TypeError, ValueError):
                if col in strict:
                    result.problem(where, f"{col}: not a number {value!r}"[:120])
        when = None
        if time_col is not None and row[time_col] not in (None, ""):
            try:
                when = _to_float(row[time_col])
                when = when if math.isfinite(when) else None
            except (TypeError, ValueError):
                when = None
        if step in by_step:
            merged = dict(by_step[step].metrics)
            merged.update(metrics)
            metrics = merged
        by_step[step] = StepRecord(step=step, metrics=metrics, time=when)
    result.records = [by_step[s] for s in sorted(by_step)]
    return result


def read(
    path: Path,
    *,
    mapping: Mapping[str, str] | None = None,
    step_column: str | None = None,
    keep_unmapped: bool = True,
    **_: Any,
) -> ImportResult:
    """Read a CSV/TSV/JSONL/Parquet file; see the module docstring for the options."""
    name = Path(path).name
    try:
        df = read_frame(Path(path))
    except Exception as exc:  # noqa: BLE001 - polars raises many types on garbage; the file is reported, not fatal
        result = ImportResult(format=FORMAT, records=[])
        result.problem(name, f"unreadable table ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
        return result
    return table_to_result(
        df, fmt=FORMAT, name=name, mapping=mapping, step_column=step_column, keep_unmapped=keep_unmapped
    )
