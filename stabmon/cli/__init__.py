"""The ``stabmon`` command line. Each command group lives in its own module and registers itself on ``app``.

Commands are thin: they parse options, call library functions and print. Nothing in the library imports the CLI.
"""

from __future__ import annotations

import importlib
from typing import Annotated

import typer

import stabmon
from stabmon.cli._common import echo

app = typer.Typer(
    name="stabmon",
    help="Training-stability monitor with an intervention runbook engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Each module defines ``register(app: typer.Typer) -> None``.
COMMAND_MODULES = [
    "alert",
    "db",
    "runs",
    "importing",
    "replay",
    "eval",
    "tune",
    "runbook",
    "decisions",
    "trace",
    "report",
    "diff",
    "goodput",
    "events",
    "demo",
]


def _version(value: bool) -> None:
    if value:
        echo(f"stabmon {stabmon.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """Training-stability monitor with an intervention runbook engine."""


for _name in COMMAND_MODULES:
    importlib.import_module(f"stabmon.cli.{_name}").register(app)


def main() -> None:
    app()
