"""Format sniffing over every importer module in this package.

An importer module exposes ``FORMAT``, ``sniff(head) -> bool`` and ``read(path, **options) -> ImportResult``
and may set ``PRIORITY`` (lower is tried first; default 50). :func:`importers` discovers them all, so a new
module needs no registration. :func:`sniff_format` sniffs the first 64 KB of a file; :func:`import_file`
reads one file with the sniffed (or given) format and :func:`import_files` stitches several into one run.

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "history.tsv"
>>> _ = p.write_text("train/lm_loss\\tstep\\n3.40\\t1\\n")
>>> sniff_format(p).FORMAT, import_file(p).records[0].get("loss")
('wandb', 3.4)
>>> formats()[-1]
'generic'
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import stat
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import stabmon.replay.importers as _pkg
from stabmon.replay.importers.base import ImportResult

log = logging.getLogger(__name__)

HEAD_BYTES = 64 * 1024
_SKIP = {"base", "sniff", "table", "tabular"}


class UnknownFormatError(ValueError):
    """No importer recognised the file (or the named format does not exist)."""


def importers() -> list[ModuleType]:
    """Every importer module, in sniffing order (PRIORITY, then name)."""
    mods = []
    for info in pkgutil.iter_modules(_pkg.__path__):
        if info.name in _SKIP or info.name.startswith("_"):
            continue
        try:
            mod = importlib.import_module(f"{_pkg.__name__}.{info.name}")
        except Exception:  # noqa: BLE001 - one broken importer must not hide the others
            log.exception("importer module %s failed to import", info.name)
            continue
        if all(hasattr(mod, a) for a in ("FORMAT", "sniff", "read")):
            mods.append(mod)
    return sorted(mods, key=lambda m: (getattr(m, "PRIORITY", 50), m.FORMAT))


def formats() -> list[str]:
    return [m.FORMAT for m in importers()]


def _head(path: Path) -> str:
    if path.is_dir():  # a TensorBoard log folder or a Hugging Face checkpoint folder
        files = sorted(path.glob("events.out.tfevents.*")) + sorted(path.glob("trainer_state.json"))
        if not files:
            return ""
        path = files[0]
    with open(path, "rb") as fh:
        return fh.read(HEAD_BYTES).decode("utf-8", errors="replace")


def sniff_format(path: str | Path) -> ModuleType:
    """The importer module whose ``sniff`` accepts the file's head; raises UnknownFormatError."""
    head = _head(Path(path))
    for mod in importers():
        try:
            if mod.sniff(head):
                return mod
        except Exception:  # noqa: BLE001 - a sniffer bug means "not mine"
            log.exception("sniff of %s failed on %s", mod.FORMAT, path)
    raise UnknownFormatError(f"{path}: format not recognised (known: {', '.join(formats())}); pass --format")


def importer(fmt: str) -> ModuleType:
    for mod in importers():
        if mod.FORMAT == fmt:
            return mod
    raise UnknownFormatError(f"unknown format {fmt!r} (known: {', '.join(formats())})")


def import_file(path: str | Path, *, format: str | None = None, **options: Any) -> ImportResult:
    """Read one file with the given or sniffed format."""
    check_readable(Path(path))
    mod = importer(format) if format else sniff_format(path)
    return mod.read(Path(path), **options)


def check_readable(path: Path) -> None:
    """A ``ValueError`` (one line) for what no importer may read: a FIFO, a device (``/dev/zero`` would fill
    the memory, a FIFO block for ever) or a socket. Regular files and folders (a TensorBoard log, a Trainer
    checkpoint) pass; a missing path is the importer's to report."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) \
            else "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
        raise ValueError(f"{path}: {kind}, not a file: stabmon imports regular files and log folders")


def import_files(paths: Sequence[str | Path], *, format: str | None = None, **options: Any) -> ImportResult:
    """Read several files as the segments of one run and stitch them (see :mod:`stabmon.replay.stitch`)."""
    from stabmon.replay.stitch import stitch

    if not paths:
        raise ValueError("import: no files given")
    results = [import_file(p, format=format, **options) for p in paths]
    if len(results) == 1:
        return results[0]
    return stitch(results, [Path(p).name for p in paths])


def nothing_read(result: ImportResult, files: Sequence[str | Path]) -> str | None:
    """Why an import holds nothing to monitor (no step, or steps without a single metric value), or None."""
    where = ", ".join(map(str, files))
    if not len(result) and result.format == "pattern":
        return f"no line of {where} matched --pattern ({result.malformed} matched with a value that is not a number)"
    if not len(result):
        first = f"; first: {result.problems[0]}" if result.problems else ""
        return (f"no step records found in {where} (format {result.format}, {result.malformed} malformed line(s)"
                f"{first})")
    if not any(r.metrics for batch in result.batches(4096) for r in batch):
        return (f"no metric found in {where}: {len(result)} step(s) read as {result.format}, none with a value "
                "(for a text log pass --pattern with named groups; for a table, --map COLUMN=METRIC)")
    return None
