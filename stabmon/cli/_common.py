"""Helpers shared by CLI modules: the store URL option, JSON output and one-line user errors."""

from __future__ import annotations

import json
import math
import os
import re
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
LatestRunArg = Annotated[str, typer.Argument(
    help="Run id, unique id prefix, name, or 'latest' (the default: the newest run in the database).")]
"""A run argument that may be left out: the commands that read one run (trace, goodput, events, report)."""


def db_url(value: str | None) -> str:
    """``--db``, else the default store URL (:func:`stabmon.store.database.resolve_url`)."""
    from stabmon.store.database import resolve_url

    return resolve_url(value)


_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def safe(text: str, *, lines: bool = True) -> str:
    r"""``text`` with every control character (and every bidirectional override) written out as an escape
    (``\x1b``, ``\u202e``): a run or metric name from the store or a log cannot move the cursor, retitle or
    recolour the terminal, or reorder what it shows. ``lines``: newlines and tabs are kept.

    >>> safe("run\x1b]0;owned\x07"), safe("a\nb"), safe("a\nb", lines=False)
    ('run\\x1b]0;owned\\x07', 'a\nb', 'a\\x0ab')
    """
    out = _UNSAFE.sub(_escape, text)
    return out if lines else out.replace("\n", "\\x0a").replace("\t", "\\x09")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def echo(message: Any = "", **kwargs: Any) -> None:
    """``typer.echo`` of a line that may hold names from the store or a log: :func:`safe` first."""
    typer.echo(safe(str(message)), **kwargs)


def fail(message: str) -> NoReturn:
    """Print one clear line to stderr and exit with code 1."""
    typer.echo(f"error: {safe(message, lines=False)}", err=True)
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
    another program, wide enough that no row wraps. Every string it is given is shown as it is: no markup is
    read in it, and control characters are escaped (:func:`safe`); style with ``rich.text.Text``."""
    from rich.console import Console

    class SafeConsole(Console):
        def render_str(self, text: str, **kwargs: Any) -> Any:
            return super().render_str(safe(text, lines=False), **kwargs)

    piped = not sys.stdout.isatty() and not os.environ.get("COLUMNS")
    return SafeConsole(width=1000 if piped else None, markup=False, highlight=False)
