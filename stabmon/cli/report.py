"""``stabmon report RUN -o report.html``: one self-contained HTML file to look at a run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stabmon.cli._common import DbOption, LatestRunArg, echo, fail, store_session

OutOption = Annotated[Path, typer.Option("-o", "--output", help="Where to write the HTML file.")]
BucketsOption = Annotated[
    int, typer.Option("--buckets", help="Step buckets per series; each keeps its min and max (spikes survive).")
]


def report(run: LatestRunArg = "latest", output: OutOption = Path("report.html"), buckets: BucketsOption = 1000,
           db: DbOption = None) -> None:
    """Write charts, event marks, the causal trace and the environment of RUN to one offline HTML file."""
    from stabmon.report import load_report, write_report
    from stabmon.store import RunNotFoundError, repo

    if buckets < 10:
        fail(f"--buckets must be >= 10, got {buckets}")
    with store_session(db) as s:
        try:
            run_id = repo.resolve_run(session=s, ref=run).id
        except RunNotFoundError as exc:
            fail(str(exc))
        data = load_report(session=s, run_id=run_id, buckets=buckets)
    try:
        path = write_report(data, output)
    except OSError as exc:
        fail(f"cannot write {output}: {exc.strerror or exc}")
    echo(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB): {len(data.charts)} charts, "
               f"{len(data.marks)} marks, {len(data.trace)} trace rows")


def register(app: typer.Typer) -> None:
    app.command("report")(report)
