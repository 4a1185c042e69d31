"""Limits the store holds on both backends (SQLite would accept more; PostgreSQL would refuse the whole row).

>>> check_name("run name", "ok")
>>> check_name("metric name", "x" * 300)
Traceback (most recent call last):
...
ValueError: metric name is 300 characters long, more than the store's 255: 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'...
>>> check_name("run name", "a" + chr(0) + "b")
Traceback (most recent call last):
...
ValueError: run name contains a NUL character at position 1, which the store cannot hold: 'a\\x00b'

The rules are the same on every backend: SQLite would store a NUL, PostgreSQL refuses any text holding one, and
a name must mean the same run or metric on both.
"""

from __future__ import annotations

MAX_NAME = 255
"""Longest run or metric name (the ``String(255)`` columns of :mod:`stabmon.store.models`)."""


def name_problem(what: str, name: object) -> str | None:
    """Why ``name`` cannot be stored as a ``what``, or None when it can."""
    if not isinstance(name, str):
        return f"{what} must be a string, got {type(name).__name__}"
    if not name:
        return f"{what} must not be empty"
    if len(name) > MAX_NAME:
        return f"{what} is {len(name)} characters long, more than the store's {MAX_NAME}: {name[:40]!r}..."
    if "\x00" in name:
        at = name.index("\x00")
        return f"{what} contains a NUL character at position {at}, which the store cannot hold: {name[:40]!r}"
    return None


def check_name(what: str, name: object) -> None:
    """Raise ``ValueError`` (one line naming ``what``) unless ``name`` can be stored."""
    problem = name_problem(what, name)
    if problem is not None:
        raise ValueError(problem)
