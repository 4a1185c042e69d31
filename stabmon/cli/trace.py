"""``stabmon trace RUN [--json]``: the causal chain of every incident of a run."""

from __future__ import annotations

from typing import Annotated

import typer

from stabmon.cli._common import DbOption, LatestRunArg, echo, print_json, run_events, store_session


def trace(run: LatestRunArg = "latest", db: DbOption = None,
          as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False) -> None:
    """Evidence -> anomaly -> decision -> intervention -> outcome, per incident."""
    from stabmon.runbook.trace import build_trace, format_trace
    from stabmon.store import repo

    run_id, name, events = run_events(db, run)
    with store_session(db) as s:
        positions = repo.batch_positions(session=s, run_id=run_id)
    result = {"run_id": run_id, "run_name": name, **build_trace(events, positions)}
    if as_json:
        print_json(result)
        return
    echo(f"run {run_id} ({name})")
    for line in format_trace(result):
        echo(line)


def register(app: typer.Typer) -> None:
    app.command("trace")(trace)
