"""Per-step metrics as drawable series: re-trained stretches told apart, large runs cut down without losing spikes.

Input is the store's long metric table (``seq, step, name, value``, in record order). A record is *abandoned*
when a later record (after a rollback) trained the same step again; its points are drawn apart from the
trajectory the run kept. Each series is cut down with min/max per bucket: the step range is split into
``buckets`` equal parts and each part keeps its smallest and largest value (in step order), so a one-step spike
in a million steps is still drawn. Non-finite values cannot be drawn on an axis; their steps are kept apart.

Steps 1-2 trained, then a rollback to step 1 trained them again:

>>> rows = [(0, 0, "loss", 2.0), (1, 1, "loss", 9.0), (2, 2, "loss", 2.0), (3, 1, "loss", 1.5), (4, 2, "loss", 1.4)]
>>> df = metrics_frame(rows)
>>> [(s.name, s.steps, s.values) for s in build_series(df, buckets=100)]
[('loss', [0, 1, 2], [2.0, 1.5, 1.4])]
>>> build_series(df, buckets=100)[0].abandoned
([1, 2], [9.0, 2.0])
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import polars as pl

from stabmon.events import StepRecord

SCHEMA = {"seq": pl.Int64, "step": pl.Int64, "name": pl.Utf8, "value": pl.Float64}


@dataclass(frozen=True)
class Series:
    """One metric ready to draw: the kept trajectory, the abandoned points and the non-finite steps."""

    name: str
    steps: list[int]
    values: list[float]
    abandoned: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []))
    nonfinite: list[int] = field(default_factory=list)
    points: int = 0
    """Points the series had before it was cut down."""


def metrics_frame(rows: Iterable[tuple[int, int, str, float]]) -> pl.DataFrame:
    """A long metric table from ``(seq, step, name, value)`` tuples."""
    return pl.DataFrame(list(rows), schema=SCHEMA, orient="row")


def records_frame(records: Sequence[StepRecord]) -> pl.DataFrame:
    """The long metric table of in-memory StepRecords, in their order (what the store's ``get_metrics`` gives)."""
    return metrics_frame((i, r.step, k, float(v)) for i, r in enumerate(records) for k, v in r.metrics.items())


def mark_abandoned(df: pl.DataFrame) -> pl.DataFrame:
    """``df`` with a boolean ``abandoned`` column: a later record trained the same step (or an earlier one)."""
    per_record = df.select("seq", "step").unique("seq").sort("seq")
    later_min = pl.col("step").reverse().cum_min().reverse().shift(-1)
    per_record = per_record.with_columns(abandoned=(pl.col("step") >= later_min).fill_null(False))
    return df.join(per_record.select("seq", "abandoned"), on="seq", how="left")


def _minmax(df: pl.DataFrame, lo: int, hi: int, buckets: int) -> pl.DataFrame:
    """Rows of ``df`` (finite values of one series) kept by min/max per step bucket, in step order."""
    if df.height <= 2 * buckets:
        return df.sort("step", "seq")
    width = max(1, hi - lo + 1)
    keyed = df.with_row_index("_i").with_columns(_b=((pl.col("step") - lo) * buckets // width))
    picks = keyed.group_by("_b").agg(
        pl.col("_i").get(pl.col("value").arg_min()).alias("lo"),
        pl.col("_i").get(pl.col("value").arg_max()).alias("hi"),
    )
    keep = pl.concat([picks["lo"], picks["hi"]]).unique()
    return keyed.filter(pl.col("_i").is_in(keep.implode())).drop("_i", "_b").sort("step", "seq")


def _nonfinite_steps(df: pl.DataFrame, lo: int, hi: int, buckets: int) -> list[int]:
    """Steps of non-finite values, at most one per bucket."""
    if df.is_empty():
        return []
    width = max(1, hi - lo + 1)
    firsts = df.with_columns(_b=((pl.col("step") - lo) * buckets // width)).group_by("_b").agg(pl.col("step").min())
    return sorted(firsts["step"].to_list())


def build_series(df: pl.DataFrame, *, buckets: int = 1000, names: Sequence[str] | None = None) -> list[Series]:
    """Every metric of ``df`` (or those in ``names``, in that order) as a drawable :class:`Series`."""
    if df.is_empty():
        return []
    lo, hi = int(df["step"].min()), int(df["step"].max())  # type: ignore[arg-type]
    if "abandoned" not in df.columns:
        df = mark_abandoned(df)
    wanted = list(names) if names is not None else list(dict.fromkeys(df["name"].to_list()))
    parts = df.filter(pl.col("name").is_in(wanted)).partition_by("name", as_dict=True)
    out = []
    for name in wanted:
        part = parts.get((name,))
        if part is None:
            continue
        out.append(_one(name, part, lo, hi, buckets))
    return out


def _one(name: str, df: pl.DataFrame, lo: int, hi: int, buckets: int) -> Series:
    finite = df.filter(pl.col("value").is_finite())
    kept = _minmax(finite.filter(~pl.col("abandoned")), lo, hi, buckets)
    gone = _minmax(finite.filter(pl.col("abandoned")), lo, hi, buckets)
    return Series(
        name=name,
        steps=kept["step"].to_list(),
        values=kept["value"].to_list(),
        abandoned=(gone["step"].to_list(), gone["value"].to_list()),
        nonfinite=_nonfinite_steps(df.filter(~pl.col("value").is_finite()), lo, hi, buckets),
        points=df.height,
    )
