"""stabmon's SQL store: models, Alembic-managed schema, repository functions and the background-writing Store.

>>> import tempfile, os
>>> store = open_store("sqlite:///" + os.path.join(tempfile.mkdtemp(), "runs.db"))
>>> isinstance(store, Sink)
True
>>> store.close()
"""

from __future__ import annotations

from stabmon.sinks import Sink
from stabmon.store.database import SchemaNotReadyError, StoreError, make_engine, upgrade
from stabmon.store.lease import RunInUseError
from stabmon.store.repo import AnswerError, RunNotFoundError
from stabmon.store.store import Store, StoreConfig, open_store
from stabmon.store.writer import StoreStats

__all__ = [
    "AnswerError",
    "RunInUseError",
    "RunNotFoundError",
    "SchemaNotReadyError",
    "Store",
    "StoreConfig",
    "StoreError",
    "StoreStats",
    "Sink",
    "make_engine",
    "open_store",
    "upgrade",
]
