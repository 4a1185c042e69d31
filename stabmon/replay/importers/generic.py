"""Generic tabular logs: CSV / TSV / JSON lines / Parquet, with a column mapping.

``read(path, mapping={"train/loss": "loss"}, step_column="step")`` reads the file with polars, takes the step
from ``step_column`` (default: the first of ``step``, ``_step``, ``global_step``, ``trainer/global_step``,
``iteration`` present; else the row number) and renames columns through ``mapping`` (column -> stabmon metric
name). Columns the mapping does not name are matched against :data:`KNOWN_COLUMNS` (common W&B / HF /
Lightning names); other columns are kept under their own names (their non-numeric cells silently skipped)
unless ``keep_unmapped=False``. Every value is read as text first and converted here, so a malformed cell is
counted (``ImportResult.malformed``) instead of failing the file.

fp16 overflow steps: a column saying whether the loss scaler skipped the step (``overflow``, ``found_inf``,
``skipped_step``, as 0/1 or true/false; ``--map COLUMN=overflow`` for another name) becomes ``overflow``. A
table with a loss scale and no such column gets ``overflow = 1`` on the step of each loss-scale backoff
(:mod:`stabmon.replay.importers.overflow`), so an ``inf`` grad norm logged there reads as the routine skip
it is, not as a non-finite training state.

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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stabmon.events import Metric
from stabmon.replay.importers.base import ImportResult
from stabmon.replay.importers.overflow import mark_table
from stabmon.replay.importers.table import StepTable
from stabmon.replay.importers.tabular import Table, open_table

FORMAT = "generic"
PRIORITY = 90  # tried last by sniffing: it accepts almost any table

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
    **{f"{prefix}{name}": Metric.OVERFLOW for prefix in ("", "train/")
       for name in ("overflow", "found_inf", "skipped_step", "step_skipped")},
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


_FLAGS = {"true": 1.0, "false": 0.0}


def _to_flag(text: Any) -> float:
    """An overflow flag cell (0/1, true/false) as 1.0 or 0.0."""
    word = str(text).strip().lower()
    if word in _FLAGS:
        return _FLAGS[word]
    value = _to_float(text)
    if not math.isfinite(value):
        raise ValueError(f"not a flag: {text!r}")
    return 1.0 if value else 0.0


def _to_float(text: Any) -> float:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    s = str(text).strip()
    if s.lower() in {"nan", "inf", "-inf", "+inf", "infinity", "-infinity"}:
        return float(s)
    return float(s)


@dataclass
class _Plan:
    """Which column holds the step and the time, and which metric each other column feeds."""

    step: str | None
    time: str | None
    columns: dict[str, str]
    strict: set[str]  # mapped or well-known columns: an unreadable cell there is a malformed row


def _plan(names: list[str], mapping: Mapping[str, str], step_column: str | None, keep_unmapped: bool) -> _Plan:
    step_col = step_column or next((c for c in STEP_COLUMNS if c in names), None)
    time_col = next((c for c in TIME_COLUMNS if c in names and c not in mapping), None)
    plan = _Plan(step_col, time_col, {}, set())
    for col in names:
        if col in (step_col, time_col) or col in IGNORED:
            continue
        if col in mapping or col in KNOWN_COLUMNS:
            plan.columns[col] = mapping.get(col) or KNOWN_COLUMNS[col]
            plan.strict.add(col)
        elif keep_unmapped:
            plan.columns[col] = col
    return plan


def table_to_result(
    table: Table,
    *,
    fmt: str,
    name: str,
    mapping: Mapping[str, str] | None = None,
    step_column: str | None = None,
    keep_unmapped: bool = True,
) -> ImportResult:
    """Convert a table of text (or numeric) cells to StepRecords, one row at a time; shared by the W&B
    importer."""
    steps = StepTable()
    result = ImportResult(fmt, steps=steps)
    for line, what in table.malformed:
        result.problem(f"{name}:{line}", what[:120])
    if step_column and step_column not in table.columns:
        result.problem(
            name, f"step column {step_column!r} not found (columns: {', '.join(table.columns)[:200]})"
        )
        return result
    plan = _plan(table.columns, dict(mapping or {}), step_column, keep_unmapped)
    for row_no, row in enumerate(table.rows, 2):  # a CSV's header is line 1
        _add_row(row, f"{name}:{table.line or row_no}", row_no - 2, plan, steps, result)
    for line, what in table.skipped:
        result.problem(f"{name}:{line}", what)
    mark_table(steps)
    return result


def _add_row(row: dict[str, Any], where: str, index: int, plan: _Plan, steps: StepTable,
             result: ImportResult) -> None:
    try:
        step = index if plan.step is None else int(_to_float(row[plan.step]))
    except (TypeError, ValueError, OverflowError):
        result.problem(where, f"unreadable step {row.get(plan.step or '')!r}"[:120])
        return
    metrics: dict[str, float] = {}
    for col, metric in plan.columns.items():
        value = row[col]
        if value is None or (isinstance(value, str) and not value.strip()):
            continue
        try:
            metrics[metric] = _to_flag(value) if metric == Metric.OVERFLOW else _to_float(value)
        except (TypeError, ValueError):
            if col in plan.strict:
                result.problem(where, f"{col}: not a number {value!r}"[:120])
    steps.merge(step, metrics, _time(row[plan.time]) if plan.time is not None else None)


def _time(value: Any) -> float | None:
    if value in (None, ""):
        return None
    try:
        when = _to_float(value)
    except (TypeError, ValueError):
        return None
    return when if math.isfinite(when) else None


def read(
    path: Path,
    *,
    mapping: Mapping[str, str] | None = None,
    step_column: str | None = None,
    keep_unmapped: bool = True,
    **_: Any,
) -> ImportResult:
    """Read a CSV/TSV/JSONL/Parquet file in bounded batches; see the module docstring for the options."""
    name = Path(path).name
    try:
        table = open_table(Path(path))
        return table_to_result(
            table, fmt=FORMAT, name=name, mapping=mapping, step_column=step_column, keep_unmapped=keep_unmapped
        )
    except Exception as exc:  # noqa: BLE001 - polars raises many types on garbage; the file is reported, not fatal
        return unreadable(FORMAT, name, exc)


def unreadable(fmt: str, name: str, exc: Exception) -> ImportResult:
    """The result for a table polars could not read: no records, one problem naming the error."""
    result = ImportResult(fmt)
    result.problem(name, f"unreadable table ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
    return result
