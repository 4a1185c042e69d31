"""Alembic environment for stabmon's store.

The URL (or an open connection) is passed programmatically by :func:`stabmon.store.upgrade` through
``config.attributes``; there is no alembic.ini. ``render_as_batch=True`` lets ALTERs run on SQLite.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from stabmon.store.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def run_migrations_offline() -> None:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            _configure(conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
