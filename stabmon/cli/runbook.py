"""``stabmon runbook validate FILE | list | show NAME``: check and read runbooks."""

from __future__ import annotations

from typing import Annotated

import typer

from stabmon.cli._common import echo, fail, print_json

runbook_app = typer.Typer(help="Validate, list and show runbooks.", no_args_is_help=True)


@runbook_app.command("validate")
def validate(
    file: Annotated[str, typer.Argument(help="Runbook YAML file (or a bundled name).")],
    hparams: Annotated[
        str | None,
        typer.Option(
            "--hparams",
            help="The optimizer's values in force, e.g. clip=1.0,beta2=0.95,weight_decay=0.1: warn about rungs "
            "that would change nothing or move a value the harmful way (leave a key out if the optimizer "
            "has no such setting).",
        ),
    ] = None,
) -> None:
    """Validate a runbook; print every problem as FILE:LINE: field.path: message."""
    from stabmon.runbook import RunbookError, load_runbook
    from stabmon.runbook.fit import fit_warnings

    given = _parse_hparams(hparams) if hparams is not None else None
    try:
        rb = load_runbook(file)
    except RunbookError as exc:
        for issue in exc.issues:
            echo(str(issue), err=True)
        raise typer.Exit(code=1) from None
    rungs = sum(len(r.ladder) for r in rb.rules)
    echo(f"ok: {rb.name} ({rb.mode} mode, {len(rb.rules)} rules, {rungs} rungs)")
    for line in fit_warnings(rb, given) if given is not None else []:
        echo(f"warning: {line}", err=True)


def _parse_hparams(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not key.strip():
            fail(f"--hparams: expected name=number, got {item!r}")
    return out


@runbook_app.command("list")
def list_(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """List the runbooks shipped with stabmon."""
    from stabmon.runbook import bundled_runbooks, load_runbook

    rows = []
    for name, path in bundled_runbooks().items():
        rb = load_runbook(path)
        rows.append({"name": name, "mode": rb.mode, "rules": [r.name for r in rb.rules],
                     "description": rb.description, "path": str(path)})
    if as_json:
        print_json(rows)
        return
    for r in rows:
        echo(f"{r['name']:<16} {r['mode']:<8} {r['description']}")


@runbook_app.command("show")
def show(
    name: Annotated[str, typer.Argument(help="Bundled runbook name or a file.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the validated runbook as JSON.")] = False,
) -> None:
    """Print a runbook file (its header says where the numbers come from), or its validated form."""
    from stabmon.runbook import RunbookError, load_runbook
    from stabmon.runbook.loader import resolve

    try:
        path = resolve(name)
        rb = load_runbook(path)
    except RunbookError as exc:
        fail(str(exc.issues[0]))
    if as_json:
        print_json(rb.model_dump(mode="json"))
    else:
        echo(path.read_text(), nl=False)


def register(app: typer.Typer) -> None:
    app.add_typer(runbook_app, name="runbook")
