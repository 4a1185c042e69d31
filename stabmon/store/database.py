"""Database URLs, SQLAlchemy engines, schema upgrades and schema checks.

:func:`resolve_url` is the one place the default store URL is decided; :func:`safe_url` the one redaction of a
store URL for messages and logs.

The schema is created only by Alembic. :func:`upgrade` runs ``alembic upgrade head`` programmatically from the
migrations shipped with the package (:func:`stabmon.resources.migrations_dir`), so it works from a wheel.
SQLite connections run in WAL mode with a busy timeout, so the CLI can read while a run writes.

>>> import tempfile, os
>>> url = "sqlite:///" + os.path.join(tempfile.mkdtemp(), "s.db")
>>> upgrade(url); schema_revision(url) == head_revision()
True
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.pool import NullPool, StaticPool

from stabmon.resources import migrations_dir

DEFAULT_URL = "sqlite:///stabmon.db"


def resolve_url(url: str | None = None) -> str:
    """``url``, else ``$STABMON_DB_URL``, else ``sqlite:///stabmon.db`` (in the working directory)."""
    return url or os.environ.get("STABMON_DB_URL") or DEFAULT_URL


class StoreError(ValueError):
    """A user-facing store problem (bad URL, schema not upgraded, unknown run or decision); one clear line."""


class SchemaNotReadyError(StoreError):
    pass


def safe_url(url: str | URL) -> str:
    """The URL with any password hidden (in the user part or the query), for messages and logs."""
    from stabmon.redaction import hide_db_secrets

    text = url.render_as_string(hide_password=False) if isinstance(url, URL) else str(url)
    return hide_db_secrets(text)


def parse_url(url: str | URL) -> URL:
    """``url`` parsed, or a one-line :class:`StoreError` saying what a store URL looks like.

    >>> parse_url("notaurl")
    Traceback (most recent call last):
    ...
    stabmon.store.database.StoreError: store: cannot parse 'notaurl' as a database URL (e.g. sqlite:///stabmon.db or postgresql+psycopg://user@host:5432/db)
    """
    try:
        return make_url(url)
    except Exception:  # noqa: BLE001 - sqlalchemy raises ArgumentError (and others for odd types)
        raise StoreError(
            f"store: cannot parse {safe_url(url)!r} as a database URL "
            "(e.g. sqlite:///stabmon.db or postgresql+psycopg://user@host:5432/db)"
        ) from None


def is_memory(url: str | URL) -> bool:
    """True for an in-memory SQLite URL (``sqlite://``), which lives only as long as its engine."""
    u = parse_url(url)
    return u.get_backend_name() == "sqlite" and (not u.database or u.database == ":memory:")


def sqlite_path(url: str | URL) -> Path | None:
    """The file behind a SQLite URL, or None for other databases and in-memory SQLite."""
    u = parse_url(url)
    if u.get_backend_name() != "sqlite" or not u.database or u.database == ":memory:":
        return None
    return Path(u.database)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()


_UNAVAILABLE = {"OperationalError", "InterfaceError", "TimeoutError", "ConnectionError"}
_NOT_AN_OUTAGE = ("authentication", "password", "does not exist", "no such", "unable to open", "permission")


def is_unavailable(exc: BaseException) -> bool:
    """True when ``exc`` means "the database cannot be reached right now" rather than "this data is bad"."""
    if isinstance(exc, (OSError, sa.exc.TimeoutError)):
        return True
    if isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated:
        return True
    return any(cls.__name__ in _UNAVAILABLE for cls in type(exc).__mro__)


def is_down(exc: StoreError) -> bool:
    """True when :func:`make_engine` failed because the server is down or unreachable (worth waiting for),
    not because of the URL, the credentials or a missing database (worth telling the user at once)."""
    cause = exc.__cause__
    if cause is None or not is_unavailable(cause):
        return False
    text = str(cause).lower()
    return not any(word in text for word in _NOT_AN_OUTAGE)


def make_engine(url: str | URL, *, pooled: bool = True, probe: bool = True) -> Engine:
    """An engine for ``url``; raises ``ValueError`` ("store: cannot open ...") when it cannot connect.

    ``pooled=False`` opens a fresh connection per use (the background writer uses it for SQLite so that a file
    that went away is noticed instead of written through a stale handle). ``probe=False`` skips the test
    connection (a store starting while its database is down).
    """
    try:
        u = make_url(url)
        kwargs: dict[str, Any] = {}
        if is_memory(u):  # one connection shared by every thread, or each would see its own empty database
            kwargs["poolclass"] = StaticPool
            kwargs["connect_args"] = {"check_same_thread": False}
        elif not pooled:
            kwargs["poolclass"] = NullPool
        elif u.get_backend_name() != "sqlite":
            kwargs["pool_pre_ping"] = True
        if u.get_backend_name() == "postgresql" and "connect_timeout" not in u.query:
            kwargs["connect_args"] = {"connect_timeout": 10}  # a vanished server must not hang the writer
        engine = sa.create_engine(u, **kwargs)
        if u.get_backend_name() == "sqlite":
            sa.event.listen(engine, "connect", _sqlite_pragmas)
        if probe:
            with engine.connect() as conn:
                conn.execute(sa.text("select 1"))
    except Exception as exc:  # noqa: BLE001 - any failure to open is the user's URL problem
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reason = safe_url(reason)
        raise StoreError(f"store: cannot open {safe_url(url)!r}: {reason}") from exc
    return engine


def alembic_config(url: str | URL | None = None, connection: sa.Connection | None = None) -> Any:
    from alembic.config import Config

    cfg = Config(stdout=sys.stdout)  # the stream of now: alembic's default is the one of its import time
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["url"] = url
    cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "migrations have no head revision"
    return head


def upgrade(url: str | URL | Engine, revision: str = "head") -> None:
    """Bring the database at ``url`` (or behind an engine) to ``revision`` (default: the newest schema).
    Idempotent. A SQLite file is created where its folder exists; a missing folder is a :class:`StoreError`
    (a mistyped path does not become a new directory tree)."""
    from alembic import command

    if not isinstance(url, Engine) and (path := sqlite_path(url)) is not None and not path.parent.is_dir():
        raise StoreError(f"no folder {str(path.parent)!r} for the SQLite database {path.name!r}: create it first")
    engine = url if isinstance(url, Engine) else make_engine(url)
    try:
        with engine.begin() as conn:
            command.upgrade(alembic_config(connection=conn), revision)
    finally:
        if engine is not url:
            engine.dispose()


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def schema_revision(url: str | URL) -> str | None:
    """The Alembic revision the database at ``url`` is at (None when never upgraded)."""
    engine = make_engine(url)
    try:
        return current_revision(engine)
    finally:
        engine.dispose()


def require_schema(engine: Engine) -> None:
    """Raise :class:`SchemaNotReadyError` unless the database is at the newest schema."""
    rev, head = current_revision(engine), head_revision()
    if rev != head:
        state = "has no stabmon schema" if rev is None else f"is at schema {rev}, not {head}"
        url = safe_url(engine.url)
        raise SchemaNotReadyError(f"store: database {url!r} {state}; run `stabmon db upgrade --db {url}`")
