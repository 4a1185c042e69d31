"""Tables (CSV / TSV / JSON lines / Parquet) read in bounded batches, for the generic and W&B importers.

:func:`open_table` returns the column names at once and the rows as a lazy iterator of dicts, so a table of
any length costs memory for one block of it:

- CSV / TSV: ``BLOCK_BYTES`` of text at a time, cut after a line end outside any quoted field, each block
  parsed by polars with the file's header line in front (every cell as text, ragged lines truncated, bytes that
  are not UTF-8 replaced - the options a whole-file ``pl.read_csv`` had, so the rows are the same). A line end
  is taken to be outside quotes when an even number of quote characters precede it, which holds for valid
  CSV; a quote in the middle of an unquoted field (not valid CSV, read by polars as a plain character) can
  move a cut into a quoted field, so such a file may be read differently than in one piece;
- Parquet: ``BATCH_ROWS`` rows at a time through ``pl.scan_parquet(...).slice``;
- JSON lines: two passes, one line at a time - first the columns (every key, in order of first appearance)
  and the lines that are not JSON objects (nested too deep for the parser included: each costs only itself),
  then the rows with every value as text. ``Table.line`` is the file line of the row last yielded, so a
  problem is reported at its own line.

A record (a CSV line, a JSON line) longer than :data:`MAX_LINE_BYTES` is skipped and counted, never held whole:
``Table.skipped`` lists ``(line number, what)`` for each, and the importer reports them as malformed lines. A CSV
header line over it makes the table unreadable (one-line error).

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "log.csv"
>>> _ = p.write_text('step,note\\n1,"two\\nlines"\\n2,x\\n')
>>> t = open_table(p, block_bytes=12)
>>> t.columns, list(t.rows)
(['step', 'note'], [{'step': '1', 'note': 'two\\nlines'}, {'step': '2', 'note': 'x'}])
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

BLOCK_BYTES = 8 << 20
"""CSV text parsed at a time."""
BATCH_ROWS = 50_000
"""Parquet rows read at a time."""
MAX_LINE_BYTES = BLOCK_BYTES
"""Longest record (CSV line, JSON line) imported; a longer one is skipped and counted (a 100 MB field would
otherwise be held, copied and parsed whole: 587 MB peak for one 100 MB field)."""


@dataclass
class Table:
    """A table being read: its column names, and the rows as dicts of cell values (read as iterated).

    ``malformed`` lists the rows that were not rows at all (a JSON line that is not an object, or one longer than
    :data:`MAX_LINE_BYTES`), as (line number, what is wrong). ``skipped`` lists the CSV records longer than
    :data:`MAX_LINE_BYTES` the same way, filled as the rows are read. ``line`` is the file line (from 1) of the
    row last yielded, where the format knows it (JSON lines); None where it does not (CSV: a quoted field may
    span lines)."""

    columns: list[str]
    rows: Iterator[dict[str, Any]]
    malformed: list[tuple[int, str]] = field(default_factory=list)
    line: int | None = None
    skipped: list[tuple[int, str]] = field(default_factory=list)


def open_table(path: Path, *, block_bytes: int = BLOCK_BYTES) -> Table:
    """The table in a CSV / TSV / JSON-lines / Parquet file; raises what polars raises on an unreadable one."""
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head == b"PAR1":
        return _parquet(path)
    with open(path, encoding="utf-8", errors="replace") as fh:
        first = fh.readline(MAX_LINE_BYTES).lstrip("\ufeff").strip()  # enough to tell the format
    if first.startswith("{"):
        return _json_lines(path)
    sep = "\t" if first.count("\t") >= first.count(",") and "\t" in first else ","
    return _csv(path, sep, block_bytes)


def _parse_csv(text: bytes, sep: str) -> pl.DataFrame:
    with warnings.catch_warnings():  # ragged rows are handled (truncated), not worth a warning per block
        warnings.simplefilter("ignore")
        return pl.read_csv(io.BytesIO(text), separator=sep, infer_schema=False, truncate_ragged_lines=True,
                           encoding="utf8-lossy", ignore_errors=True, quote_char='"')


def _csv(path: Path, sep: str, block_bytes: int) -> Table:
    skipped: list[tuple[int, str]] = []
    blocks = _csv_blocks(path, block_bytes, skipped)
    header = next(blocks, b"")
    first = _parse_csv(header, sep)  # the header line alone: the column names (raises on an empty file)

    def rows() -> Iterator[dict[str, Any]]:
        for block in blocks:
            yield from _parse_csv(header + block, sep).iter_rows(named=True)

    return Table(first.columns, rows(), skipped=skipped)


def _csv_blocks(path: Path, block_bytes: int, skipped: list[tuple[int, str]]) -> Iterator[bytes]:
    """The file's first record (the header line), then blocks of about ``block_bytes`` of whole records; a
    record longer than :data:`MAX_LINE_BYTES` is read past (to its line end) and listed in ``skipped``."""
    header: bytes | None = None
    rest = b""
    line = 1  # the file line ``rest`` starts at
    with open(path, "rb") as fh:
        while chunk := fh.read(block_bytes):
            rest += chunk
            if header is None:
                if not (cut := _first_record_end(rest)):
                    if len(rest) > MAX_LINE_BYTES:
                        raise ValueError(f"the header line is longer than the {MAX_LINE_BYTES} bytes a line may hold")
                    continue
                header, rest = rest[:cut], rest[cut:]
                line += header.count(b"\n")
                yield header
            if cut := _last_record_end(rest):
                line += rest.count(b"\n", 0, cut)
                yield rest[:cut]
                rest = rest[cut:]
            elif len(rest) > MAX_LINE_BYTES:
                rest, size = _past_line_end(fh, rest, block_bytes)
                skipped.append((line, f"a line of {size:,} bytes skipped (more than the {MAX_LINE_BYTES:,} a line "
                                      "may hold)"))
                line += 1
    if rest:
        yield rest


def _past_line_end(fh: Any, rest: bytes, block_bytes: int) -> tuple[bytes, int]:
    """Read past the end of the over-long line ``rest`` begins, a block at a time: (what follows it, its size)."""
    size = len(rest)
    while (end := rest.find(b"\n")) < 0:
        rest = fh.read(block_bytes)
        if not rest:
            return b"", size
        size += len(rest)
    return rest[end + 1:], size - len(rest) + end + 1


def _first_record_end(text: bytes) -> int:
    """Just after the first line end outside a quoted field (an even number of quotes before it) that ends a
    line with something on it (polars skips blank lines before the header); 0: none."""
    start = len(text) - len(text.lstrip(b"\r\n"))
    cut = text.find(b"\n", start) + 1 if start < len(text) else 0
    quotes = text.count(b'"', 0, cut)
    while cut and quotes % 2:
        nxt = text.find(b"\n", cut) + 1
        quotes += text.count(b'"', cut, nxt) if nxt else 0
        cut = nxt
    return cut


def _last_record_end(text: bytes) -> int:
    """Just after the last line end outside a quoted field; 0: none."""
    cut = text.rfind(b"\n") + 1
    quotes = text.count(b'"', 0, cut)
    while cut and quotes % 2:
        prev = text.rfind(b"\n", 0, cut - 1) + 1
        quotes -= text.count(b'"', prev, cut)
        cut = prev
    return cut


def _parquet(path: Path) -> Table:
    lazy = pl.scan_parquet(path)

    def rows() -> Iterator[dict[str, Any]]:
        offset = 0
        while True:
            frame = lazy.slice(offset, BATCH_ROWS).collect()
            yield from frame.iter_rows(named=True)
            if frame.height < BATCH_ROWS:
                return
            offset += BATCH_ROWS

    return Table(lazy.collect_schema().names(), rows())


def _json_lines(path: Path) -> Table:
    columns: dict[str, None] = {}
    malformed: list[tuple[int, str]] = []
    for number, obj, line in _json_objects(path):
        if obj is None:
            malformed.append((number, line))
        else:
            columns.update(dict.fromkeys(map(str, obj)))

    def rows() -> Iterator[dict[str, Any]]:
        for number, obj, _ in _json_objects(path):
            if obj is not None:
                values = {str(k): None if v is None else str(v) for k, v in obj.items()}
                table.line = number
                yield {c: values.get(c) for c in columns}

    table = Table(list(columns), rows(), malformed)
    return table


def _json_objects(path: Path) -> Iterator[tuple[int, dict[str, Any] | None, str]]:
    """(line number from 1, the line's object or None when it is not a JSON object, what is wrong or the
    line) of each line with something on it."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in _bounded_lines(fh):
            if line is None:
                yield number, None, f"a line longer than the {MAX_LINE_BYTES:,} characters a line may hold, skipped"
                continue
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
                obj = None
            yield number, (obj if isinstance(obj, dict) else None), f"not a JSON object: {line[:80]!r}"


def _bounded_lines(fh: Any) -> Iterator[tuple[int, str | None]]:
    """(number from 1, line) of each line of a text file; None (read past, never held) for a line longer than
    :data:`MAX_LINE_BYTES` characters."""
    number = 0
    while line := fh.readline(MAX_LINE_BYTES + 1):
        number += 1
        if len(line) > MAX_LINE_BYTES and not line.endswith("\n"):
            while (more := fh.readline(MAX_LINE_BYTES)) and not more.endswith("\n"):
                pass
            yield number, None
        else:
            yield number, line
