"""Where two runs part: environment-fingerprint differences and the first step at which their metric
trajectories diverge beyond a tolerance (the OPT lesson: a dependency bump silently changed numerics).

Values ``a`` and ``b`` agree when ``|a - b| <= atol + rtol * max(|a|, |b|)``; non-finite values compare by
identity under every tolerance: NaN agrees only with NaN, an infinity only with the same infinity. Two runs
without a shared (metric, step) have nothing to compare: their verdict is ``no-overlap``, not agreement. Each
run's trajectory is what it kept: a step re-trained after a rollback is compared by its last value. Timing metrics
(step time, tokens per second) differ between any two runs and are left out unless named.

>>> from stabmon.events import StepRecord
>>> from stabmon.report.series import records_frame
>>> a = records_frame([StepRecord(step=s, metrics={"loss": 1.0}) for s in range(5)])
>>> b = records_frame([StepRecord(step=s, metrics={"loss": 1.0 if s < 3 else 1.1}) for s in range(5)])
>>> d = diff_trajectories(a, b, tolerance=TIGHT)
>>> d.first_divergence, d.metrics["loss"].a, d.metrics["loss"].b
(3, 1.0, 1.1)
>>> diff_trajectories(a, b, tolerance=Tolerance(rtol=0.2)).verdict
'agree'
>>> inf = records_frame([StepRecord(step=0, metrics={"loss": float("inf")})])
>>> diff_trajectories(inf, a, tolerance=Tolerance(rtol=1.0)).verdict
'diverge'
>>> diff_trajectories(a, records_frame([StepRecord(step=9, metrics={"loss": 1.0})])).verdict
'no-overlap'
>>> [x.path for x in environment_differences({"torch": {"v": "2.1"}}, {"torch": {"v": "2.2"}})]
['torch.v']
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from stabmon.events import Metric


@dataclass(frozen=True)
class Tolerance:
    """How far two values may be apart and still agree: ``atol + rtol * max(|a|, |b|)``."""

    rtol: float = 0.0
    atol: float = 0.0
    name: str = "custom"

    def __post_init__(self) -> None:
        for f in ("rtol", "atol"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"diff.tolerance.{f} must be a finite number >= 0, got {v!r}")


TIGHT = Tolerance(rtol=0.0, atol=0.0, name="tight")
"""Bit-identical: for two runs that should compute the very same numbers (same seed, same everything)."""
LOOSE = Tolerance(rtol=0.05, atol=1e-3, name="loose")
"""Same recipe: within 5% (or 1e-3) of each other, step by step."""
PRESETS = {"tight": TIGHT, "loose": LOOSE}
TIMING = (Metric.STEP_TIME, Metric.TOKENS_PER_SEC, Metric.SEGMENT_START, Metric.CHECKPOINT_TIME, Metric.OUTSIDE_TIME,
          Metric.MONITOR_TIME, Metric.STARTUP_TIME)


@dataclass(frozen=True)
class EnvDifference:
    path: str
    a: Any
    b: Any


@dataclass(frozen=True)
class MetricDivergence:
    """One metric compared over the steps both runs have: its first divergent step (None: none) and values."""

    name: str
    compared: int
    first_divergence: int | None = None
    a: float | None = None
    b: float | None = None
    abs_diff: float | None = None
    rel_diff: float | None = None


@dataclass(frozen=True)
class TrajectoryDiff:
    tolerance: Tolerance
    metrics: dict[str, MetricDivergence]
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    steps_a: tuple[int, int] | None = None
    steps_b: tuple[int, int] | None = None

    @property
    def first_divergence(self) -> int | None:
        """The first step at which any compared metric diverges; None when all agree."""
        steps = [m.first_divergence for m in self.metrics.values() if m.first_divergence is not None]
        return min(steps) if steps else None

    @property
    def compared(self) -> int:
        """(metric, step) pairs both runs have, over every compared metric."""
        return sum(m.compared for m in self.metrics.values())

    @property
    def verdict(self) -> str:
        """``diverge`` (some metric parts), ``agree`` (every shared value agrees) or ``no-overlap`` (the runs share
        no (metric, step) pair: nothing was compared, which is not agreement)."""
        if self.first_divergence is not None:
            return "diverge"
        return "agree" if self.compared else "no-overlap"


def _flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, Mapping) and obj:
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, list(obj) if isinstance(obj, tuple) else obj


def environment_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[EnvDifference]:
    """Every leaf of two environment fingerprints that differs (or that only one of them has), by dotted path."""
    fa, fb = dict(_flatten(a)), dict(_flatten(b))
    return [EnvDifference(k, fa.get(k), fb.get(k)) for k in sorted(fa.keys() | fb.keys()) if fa.get(k) != fb.get(k)]


def kept_trajectory(df: pl.DataFrame) -> pl.DataFrame:
    """``step, name, value`` of what a run kept: the last value of each (step, metric), rollbacks resolved."""
    from stabmon.report.series import mark_abandoned

    if df.is_empty():
        return df.select("step", "name", "value")
    kept = mark_abandoned(df).filter(~pl.col("abandoned")).sort("seq")
    return kept.group_by("name", "step", maintain_order=True).agg(pl.col("value").last())


def _disagree(a: pl.Expr, b: pl.Expr, tol: Tolerance) -> pl.Expr:
    both_nan = a.is_nan() & b.is_nan()
    same = (a == b) | both_nan
    finite = a.is_finite() & b.is_finite()  # a tolerance scaled by an infinity would be inf or NaN
    close = finite & ((a - b).abs() <= tol.atol + tol.rtol * pl.max_horizontal(a.abs(), b.abs()))
    return ~(same | close.fill_null(False))


def _compare(name: str, joined: pl.DataFrame, tol: Tolerance) -> MetricDivergence:
    bad = joined.filter(_disagree(pl.col("a"), pl.col("b"), tol)).sort("step")
    if bad.is_empty():
        return MetricDivergence(name, joined.height)
    step, va, vb = bad.row(0)[:3]
    diff = abs(va - vb) if math.isfinite(va) and math.isfinite(vb) else math.inf
    scale = max(abs(va), abs(vb))
    rel = diff / scale if scale and math.isfinite(scale) else math.inf  # never inf / inf
    return MetricDivergence(name, joined.height, int(step), va, vb, diff, rel)


def _range(df: pl.DataFrame) -> tuple[int, int] | None:
    return None if df.is_empty() else (int(df["step"].min()), int(df["step"].max()))  # type: ignore[arg-type]


def diff_trajectories(
    a: pl.DataFrame, b: pl.DataFrame, *, tolerance: Tolerance = TIGHT, metrics: Sequence[str] | None = None
) -> TrajectoryDiff:
    """Compare two runs' long metric tables (``seq, step, name, value``) step by step."""
    ka, kb = kept_trajectory(a), kept_trajectory(b)
    names_a, names_b = set(ka["name"].to_list()), set(kb["name"].to_list())
    if metrics:
        wanted = list(metrics)
        unknown = [m for m in wanted if m not in names_a and m not in names_b]
        if unknown:
            raise ValueError(f"diff.metrics: neither run recorded {', '.join(unknown)}")
    else:
        wanted = sorted((names_a & names_b) - set(TIMING))
    out = {}
    for name in wanted:
        joined = (
            ka.filter(pl.col("name") == name).select("step", a=pl.col("value"))
            .join(kb.filter(pl.col("name") == name).select("step", b=pl.col("value")), on="step", how="inner")
        )
        out[name] = _compare(name, joined, tolerance)
    return TrajectoryDiff(
        tolerance=tolerance,
        metrics=out,
        only_in_a=sorted(names_a - names_b),
        only_in_b=sorted(names_b - names_a),
        steps_a=_range(ka),
        steps_b=_range(kb),
    )
