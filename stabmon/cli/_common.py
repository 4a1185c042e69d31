"""Helpers shared by CLI modules: the store URL option, JSON output and one-line user errors."""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated, Any, NoReturn

import typer

DEFAULT_DB_URL = "sqlite:///stabmon.db"

DbOption = Annotated[
    str | None,
    typer.Option("--db", help="Store URL (default: $STABMON_DB_URL, else sqlite:///stabmon.db)."),
]


def db_url(value: str | None) -> str:
    return value or os.environ.get("STABMON_DB_URL") or DEFAULT_DB_URL


def fail(message: str) -> NoReturn:
    """Print one clear line to stderr and exit with code 1."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=1)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, default=str)
    sys.stdout.write("\n")
