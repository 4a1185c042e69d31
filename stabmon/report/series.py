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
    """``df`` sorted by ``seq`` with a boolean ``abandoned`` column: a later record trained the same step (or an
    earlier one). A run that never stepped back (no rollback) is checked in one pass, without a join."""
    if not df["seq"].is_sorted():
        df = df.sort("seq", maintain_order=True)
    first = pl.col("seq") != pl.col("seq").shift(1)
    per_record = df.select("seq", "step").filter(first.fill_null(True))
    if per_record["step"].is_sorted():
        return df.with_columns(abandoned=pl.lit(False))
    later_min = pl.col("step").reverse().cum_min().reverse().shift(-1)
    per_record = per_record.with_columns(abandoned=(pl.col("step") >= later_min).fill_null(False))
    return df.join(per_record.select("seq", "abandoned"), on="seq", how="left")


def _bucket(lo: int, hi: int, buckets: int) -> pl.Expr:
    return (pl.col("step") - lo) * buckets // max(1, hi - lo + 1)


def _minmax(df: pl.DataFrame, lo: int, hi: int, buckets: int) -> pl.DataFrame:
    """``name, abandoned, step, value`` kept of ``df`` (finite values): every row of a series with at most
    ``2 * buckets`` points, else the smallest and the largest value of each (series, abandoned, step bucket)."""
    groups = ["name", "abandoned"]
    cols = [*groups, "step", "value"]
    if df.height <= 2 * buckets:
        return df.select(cols)
    sized = df.select(cols).with_columns(_n=pl.len().over(groups))
    small = sized.filter(pl.col("_n") <= 2 * buckets).drop("_n")
    picked = (
        sized.filter(pl.col("_n") > 2 * buckets)
        .group_by([*groups, _bucket(lo, hi, buckets).alias("_b")])
        .agg(
            pl.col("step").get(pl.col("value").arg_min()).alias("step_lo"),
            pl.col("value").min().alias("value_lo"),
            pl.col("step").get(pl.col("value").arg_max()).alias("step_hi"),
            pl.col("value").max().alias("value_hi"),
        )
    )
    ends = [picked.select(*groups, step=f"step_{end}", value=f"value_{end}") for end in ("lo", "hi")]
    return pl.concat([small, *ends]).unique(subset=["name", "abandoned", "step", "value"])


def build_series(df: pl.DataFrame, *, buckets: int = 1000, names: Sequence[str] | None = None) -> list[Series]:
    """Every metric of ``df`` (or those in ``names``, in that order) as a drawable :class:`Series`."""
    if df.is_empty():
        return []
    lo, hi = int(df["step"].min()), int(df["step"].max())  # type: ignore[arg-type]
    if "abandoned" not in df.columns:
        df = mark_abandoned(df)
    wanted = list(names) if names is not None else list(dict.fromkeys(df["name"].to_list()))
    df = df.filter(pl.col("name").is_in(wanted))
    finite = pl.col("value").is_finite()
    kept = _minmax(df.filter(finite), lo, hi, buckets).sort("name", "step")
    bad = (df.filter(~finite).with_columns(_b=_bucket(lo, hi, buckets))
           .group_by("name", "_b").agg(pl.col("step").min()).sort("name", "step"))
    counts = dict(df.group_by("name").len().iter_rows())
    parts = kept.partition_by("name", "abandoned", as_dict=True)
    nonfinite = {k[0]: g["step"].to_list() for k, g in bad.partition_by("name", as_dict=True).items()}
    out = []
    for name in wanted:
        if name not in counts:
            continue
        main, gone = parts.get((name, False)), parts.get((name, True))
        out.append(Series(
            name=name,
            steps=main["step"].to_list() if main is not None else [],
            values=main["value"].to_list() if main is not None else [],
            abandoned=(gone["step"].to_list(), gone["value"].to_list()) if gone is not None else ([], []),
            nonfinite=nonfinite.get(name, []),
            points=counts[name],
        ))
    return out
