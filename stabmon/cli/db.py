"""``stabmon db``: manage the store's schema."""

from __future__ import annotations

import typer

from stabmon.cli._common import DbOption, db_url, fail

db_app = typer.Typer(help="Manage the store's database schema.", no_args_is_help=True)


@db_app.command("upgrade")
def upgrade_cmd(db: DbOption = None) -> None:
    """Create or upgrade the store's schema to the newest version (safe to run again)."""
    from stabmon.store import StoreError, upgrade
    from stabmon.store.engine import head_revision, safe_url

    url = db_url(db)
    try:
        upgrade(url)
    except StoreError as exc:
        fail(str(exc))
    typer.echo(f"database {safe_url(url)} is at schema {head_revision()}")


@db_app.command("current")
def current_cmd(db: DbOption = None) -> None:
    """Print the schema revision the database is at, and the newest one."""
    from stabmon.store import StoreError
    from stabmon.store.engine import head_revision, safe_url, schema_revision

    url = db_url(db)
    try:
        rev = schema_revision(url)
    except StoreError as exc:
        fail(str(exc))
    typer.echo(f"{safe_url(url)}: schema {rev or 'none'} (newest {head_revision()})")


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
