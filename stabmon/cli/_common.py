"""Helpers shared by CLI modules: the store URL option, JSON output and one-line user errors."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, NoReturn

import typer

DbOption = Annotated[
    str | None,
    typer.Option("--db", help="Store URL (default: $STABMON_DB_URL, else sqlite:///stabmon.db)."),
]


RunArg = Annotated[str, typer.Argument(help="Run id, unique id prefix, name, or 'latest'.")]


def db_url(value: str | None) -> str:
    """``--db``, else the default store URL (:func:`stabmon.store.database.resolve_url`)."""
    from stabmon.store.database import resolve_url

    return resolve_url(value)


def fail(message: str) -> NoReturn:
    """Print one clear line to stderr and exit with code 1."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=1)


def _strict(obj: Any) -> Any:
    """Non-finite floats as the strings "nan", "inf", "-inf" (strict JSON has no NaN/Infinity)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def print_json(obj: Any) -> None:
    """Strict JSON on stdout: non-finite floats become "nan" / "inf" / "-inf", as in ``stabmon metrics --json``."""
    json.dump(_strict(obj), sys.stdout, default=str, allow_nan=False)
    sys.stdout.write("\n")


@contextmanager
def store_session(db: str | None) -> Iterator[Any]:
    """A session on an existing, upgraded store, committed on success; store errors become one-line exits."""
    from sqlalchemy.orm import Session

    from stabmon.store import StoreError, make_engine
    from stabmon.store.database import require_schema, safe_url, sqlite_path

    url = db_url(db)
    try:
        path = sqlite_path(url)
    except StoreError as exc:
        fail(str(exc))
    if path is not None and not path.exists():
        fail(f"no stabmon database at {path} (run `stabmon db upgrade --db {safe_url(url)}` or pass --db)")
    try:
        engine = make_engine(url)
        require_schema(engine)
    except StoreError as exc:
        fail(str(exc))
    try:
        with Session(engine, expire_on_commit=False) as session, session.begin():
            yield session
    except StoreError as exc:
        fail(str(exc))
    finally:
        engine.dispose()


def run_events(db: str | None, ref: str) -> tuple[str, str, list[Any]]:
    """(id, name, events in causal order) of the run ``ref`` names; an unknown run is a one-line exit."""
    from stabmon.store import repo

    with store_session(db) as s:
        run = repo.resolve_run(session=s, ref=ref)
        return run.id, run.name, repo.load_events(session=s, run_id=run.id)


def console() -> Any:
    """A rich console for tables: the terminal's width on a terminal (or ``$COLUMNS``); piped into a file or
    another program, wide enough that no row wraps."""
    from rich.console import Console

    piped = not sys.stdout.isatty() and not os.environ.get("COLUMNS")
    return Console(width=1000 if piped else None)
