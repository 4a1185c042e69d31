"""A local JSONL file of batches that could not be written while the database was unavailable.

One file per :class:`~stabmon.store.Store` (``spool-<id>.jsonl`` in the spool directory), held under an
exclusive ``flock`` while its store lives, so a later store can adopt files left behind by a process that died
(see :func:`orphans`) without ever taking a live one. Batches are appended in queue order and replayed in that
order; replay is idempotent, so a crash in the middle of a replay loses nothing and duplicates nothing.

>>> import tempfile
>>> from stabmon.store.batch import Batch
>>> sp = Spool(tempfile.mkdtemp()); sp.append(Batch(hi=1)); [b.hi for b in sp.read()]
[1]
>>> sp.clear(); sp.pending, sp.read()
(0, [])
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from stabmon.store.batch import Batch

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX: no cross-process adoption
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)


def _try_lock(fd: int) -> bool:
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


class Spool:
    """Append-only batch file owned by one store. ``pending`` counts the batches in it."""

    def __init__(self, directory: str | os.PathLike[str], path: Path | None = None) -> None:
        self.dir = Path(directory)
        self.path = path or self.dir / f"spool-{uuid.uuid4().hex[:12]}.jsonl"
        self.pending = 0
        self._fh: object | None = None

    def _open(self) -> None:
        if self._fh is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            fh = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the lock
            if not _try_lock(fh.fileno()):
                fh.close()
                raise OSError(f"spool file {self.path} is locked by another process")
            self._fh = fh

    def append(self, batch: Batch) -> None:
        """Add one batch (one line) and flush it to the OS."""
        self._open()
        fh = self._fh
        assert fh is not None
        fh.write(batch.to_json() + "\n")  # type: ignore[attr-defined]
        fh.flush()  # type: ignore[attr-defined]
        self.pending += 1

    def read(self) -> list[Batch]:
        """Every complete batch in the file, oldest first (a torn last line from a crash is skipped)."""
        if not self.path.exists():
            return []
        out = []
        with open(self.path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.endswith("\n"):
                    log.warning("spool %s: ignoring incomplete line %d", self.path, n)
                    continue
                out.append(Batch.from_json(line))
        return out

    def clear(self) -> None:
        """Empty the file after its batches were written."""
        if self._fh is not None:
            self._fh.truncate(0)  # type: ignore[attr-defined]
        elif self.path.exists():
            self.path.write_text("")
        self.pending = 0

    def close(self, *, remove_if_empty: bool = True) -> None:
        if self._fh is not None:
            self._fh.close()  # type: ignore[attr-defined]
            self._fh = None
        if remove_if_empty and self.pending == 0 and self.path.exists() and self.path.stat().st_size == 0:
            self.path.unlink()


def orphans(directory: str | os.PathLike[str]) -> list[Spool]:
    """Spool files in ``directory`` whose owning store is gone (their lock is free), locked for the caller."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = []
    for path in sorted(d.glob("spool-*.jsonl")):
        sp = Spool(d, path)
        try:
            sp._open()
        except OSError:
            continue  # a live store owns it
        with open(path, encoding="utf-8") as fh:
            sp.pending = sum(1 for _ in fh)
        found.append(sp)
    return found
