"""``stabmon goodput RUN``: where the run's wall time went, productive steps and badput by cause."""

from __future__ import annotations

from typing import Annotated

import typer

from stabmon.cli._common import DbOption, LatestRunArg, echo, fail, print_json, store_session


def goodput(
    run: LatestRunArg = "latest",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
    db: DbOption = None,
) -> None:
    """Wall time split into productive steps and badput by cause (rollbacks, skipped updates, checkpoints,
    work between steps, hangs, restarts), as seconds, steps and percent."""
    from stabmon.goodput import compute_ledger, format_ledger, load_input
    from stabmon.store import RunNotFoundError, repo

    with store_session(db) as s:
        try:
            run_id = repo.resolve_run(session=s, ref=run).id
        except RunNotFoundError as exc:
            fail(str(exc))
        ledger = compute_ledger(load_input(session=s, run_id=run_id))
    if as_json:
        print_json(ledger.to_dict())
        return
    for line in format_ledger(ledger):
        echo(line)


def register(app: typer.Typer) -> None:
    app.command("goodput")(goodput)
