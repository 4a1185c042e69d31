"""Importers: recorded training logs -> the same StepRecords the live hook produces.

Each format has a module here exposing ``FORMAT: str``, ``sniff(head: str) -> bool`` (does the file's first few KB
look like this format) and ``read(path: Path, **options) -> ImportResult``. Malformed lines are counted and
described in the result, never raised.
"""
