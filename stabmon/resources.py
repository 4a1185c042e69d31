"""Locate files shipped beside the package: Alembic migrations and the bundled runbooks.

In a wheel they live inside the package (``stabmon/_migrations``, ``stabmon/_runbooks``); in a source checkout or
an editable install they are the repository's top-level ``migrations/`` and ``runbooks/``.
"""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def _find(name: str) -> Path:
    for candidate in (_PKG / f"_{name}", _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"stabmon's {name}/ directory is missing from the installation (looked in {_PKG})")


def migrations_dir() -> Path:
    return _find("migrations")


def runbooks_dir() -> Path:
    return _find("runbooks")
