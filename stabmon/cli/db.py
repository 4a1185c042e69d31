"""``stabmon db``: manage the store's schema."""

from __future__ import annotations

from typing import Annotated

import typer

from stabmon.cli._common import DbOption, db_url, echo, fail

db_app = typer.Typer(help="Manage the store's database schema.", no_args_is_help=True)


@db_app.command("upgrade")
def upgrade_cmd(db: DbOption = None) -> None:
    """Create or upgrade the store's schema to the newest version (safe to run again)."""
    from stabmon.store import StoreError, upgrade
    from stabmon.store.database import head_revision, safe_url

    url = db_url(db)
    try:
        upgrade(url)
    except StoreError as exc:
        fail(str(exc))
    echo(f"database {safe_url(url)} is at schema {head_revision()}")


@db_app.command("current")
def current_cmd(db: DbOption = None) -> None:
    """Print the schema revision the database is at, and the newest one."""
    from stabmon.store import StoreError
    from stabmon.store.database import head_revision, safe_url, schema_revision

    url = db_url(db)
    try:
        rev = schema_revision(url)
    except StoreError as exc:
        fail(str(exc))
    echo(f"{safe_url(url)}: schema {rev or 'none'} (newest {head_revision()})")


@db_app.command("recover")
def recover_cmd(
    db: DbOption = None,
    spool_dir: Annotated[
        str | None, typer.Option("--spool-dir", help="Spool directory (default: the store's own default).")
    ] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the database.")] = 60.0,
    any_database: Annotated[bool, typer.Option(
        "--any-database", help="Write every spool file there to this database, whichever it names (or none).")
    ] = False,
) -> None:
    """Write what stores left in the spool directory (after an outage, a full disk or a crash) to the database
    they were meant for (a spool file names its database; files of other databases are left alone).

    Damaged spool lines are moved to quarantine-*.jsonl and counted; exits 1 if anything is left unwritten."""
    from stabmon.store import StoreConfig, open_store
    from stabmon.store.database import safe_url

    url = db_url(db)
    try:
        store = open_store(url, config=StoreConfig(spool_dir=spool_dir, fail_fast=True, close_timeout=timeout,
                                                   adopt_any=any_database))
    except ValueError as exc:
        fail(str(exc))
    with store:
        done = store.flush(timeout)
        stats = store.stats
    echo(
        f"{safe_url(url)}: {stats.replayed_batches} spooled batch(es) written, "
        f"{stats.quarantined_lines} damaged line(s) quarantined, {stats.rejected_batches} refused"
    )
    if not done or stats.kept_rows or stats.dropped_rows:
        fail(f"{stats.kept_rows} row(s) are still in the spool: the database did not take them within {timeout}s")


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
