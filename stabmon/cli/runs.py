"""``stabmon runs`` and ``stabmon metrics``: what the store holds."""

from __future__ import annotations

import math
from typing import Annotated, Any

import typer

from stabmon.cli._common import DbOption, console, fail, print_json, store_session

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")]


def _fmt(v: float | None) -> str:
    if v is None:
        return ""
    return f"{v:.4g}" if math.isfinite(v) else str(v)


def runs(db: DbOption = None, as_json: JsonOption = False) -> None:
    """List recorded runs, newest first."""
    from rich.table import Table

    from stabmon.store import repo

    with store_session(db) as s:
        found = repo.list_runs(session=s)
    if as_json:
        print_json([r.to_json() for r in found])
        return
    table = Table()
    table.add_column("id", no_wrap=True, min_width=12)
    table.add_column("name", overflow="fold", min_width=10)
    for col in ("kind", "status", "steps", "anomalies"):
        table.add_column(col, no_wrap=True, justify="right" if col in ("steps", "anomalies") else "left")
    table.add_column("started (UTC)")
    for r in found:
        started = r.started_at.strftime("%Y-%m-%d %H:%M")
        table.add_row(r.id, r.name, r.kind, r.status, str(r.steps), str(r.anomalies), started)
    console().print(table)


def summarize(df: Any) -> list[dict[str, Any]]:
    """Per metric: points, non-finite count, last step and value, min / max / mean of the finite values."""
    import polars as pl

    if df.is_empty():
        return []
    finite = pl.col("value").is_finite()
    out = (
        df.group_by("name", maintain_order=True)
        .agg(
            pl.len().alias("points"),
            (~finite).sum().alias("nonfinite"),
            pl.col("step").last().alias("last_step"),
            pl.col("value").last().alias("last"),
            pl.col("value").filter(finite).min().alias("min"),
            pl.col("value").filter(finite).max().alias("max"),
            pl.col("value").filter(finite).mean().alias("mean"),
        )
        .sort("name")
    )
    return out.to_dicts()


def metrics(
    run: Annotated[str, typer.Argument(help="Run id, unique name or id prefix, or 'latest'.")],
    name: Annotated[list[str] | None, typer.Option("--name", help="Only these metrics (repeatable).")] = None,
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """Summarise a run's metrics: values recorded (n), non-finite count, last step and value, and min / max /
    mean of the finite values. --json prints every row instead."""
    from rich.table import Table

    from stabmon.store import repo

    with store_session(db) as s:
        r = repo.resolve_run(session=s, ref=run)
        df = repo.get_metrics(session=s, run_id=r.id, names=name or None)
    if name and df.is_empty():
        fail(f"run {r.id} has no metric named {', '.join(name)}")
    if as_json:
        rows = [
            {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in row.items()}
            for row in df.to_dicts()
        ]
        print_json({"run_id": r.id, "name": r.name, "rows": rows})
        return
    table = Table(title=f"{r.name} ({r.id})")
    table.add_column("metric", overflow="fold", min_width=10)
    for col in ("n", "nan/inf", "last step", "last", "min", "max", "mean"):
        table.add_column(col, justify="right", no_wrap=True)
    for m in summarize(df):
        values = [_fmt(m[k]) for k in ("last", "min", "max", "mean")]
        table.add_row(m["name"], str(m["points"]), str(m["nonfinite"]), str(m["last_step"]), *values)
    console().print(table)


def register(app: typer.Typer) -> None:
    app.command("runs")(runs)
    app.command("metrics")(metrics)
