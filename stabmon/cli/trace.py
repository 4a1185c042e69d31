"""``stabmon trace RUN [--json]``: the causal chain of every incident of a run."""

from __future__ import annotations

from typing import Annotated

import typer

from stabmon.cli._common import DbOption, RunArg, fail, print_json, store_session


def trace(run: RunArg, db: DbOption = None,
          as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False) -> None:
    """Evidence -> anomaly -> decision -> intervention -> outcome, per incident."""
    from stabmon.runbook.trace import build_trace, format_trace
    from stabmon.store import RunNotFoundError, repo

    with store_session(db) as s:
        try:
            found = repo.resolve_run(session=s, ref=run)
        except RunNotFoundError as exc:
            fail(str(exc))
        run_id, name = found.id, found.name
        events = repo.load_events(session=s, run_id=run_id)
        positions = repo.batch_positions(session=s, run_id=run_id)
    result = {"run_id": run_id, "run_name": name, **build_trace(events, positions)}
    if as_json:
        print_json(result)
        return
    typer.echo(f"run {run_id} ({name})")
    for line in format_trace(result):
        typer.echo(line)


def register(app: typer.Typer) -> None:
    app.command("trace")(trace)
