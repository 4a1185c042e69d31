"""A local file of batches that could not be written while the database was unavailable.

One file per :class:`~stabmon.store.Store` (``spool-<database>-<id>.jsonl`` in the spool directory), held
under an exclusive ``flock`` while its store lives, so a later store can adopt files left behind by a process
that died (see :func:`orphans`) without ever taking a live one. A file's name carries the identity of the
database its rows were meant for (:func:`database_identity`), and only a store on that database adopts it: a
run meant for an unreachable PostgreSQL never lands in a SQLite file that happens to share the directory.
Batches are appended in queue order and replayed in that order; replay is idempotent, so a crash in the middle
of a replay loses nothing and duplicates nothing.

Each line is framed as ``S1 <crc32> <json>``: a line torn by a full disk or a crash, or garbled later, fails
its checksum and is moved to ``quarantine-<id>.jsonl`` beside the spool (counted and logged), so it can never
stop the lines after it from being replayed. An append that fails part-way is cut back off the file.

>>> import tempfile
>>> from stabmon.store.batch import Batch
>>> sp = Spool(tempfile.mkdtemp()); sp.append(Batch(hi=1)); [b.hi for b in sp.read()]
[1]
>>> sp.clear(); sp.pending, sp.read()
(0, [])
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import uuid
import zlib
from pathlib import Path

from stabmon.store.batch import Batch

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX: no cross-process adoption
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

_MAGIC = b"S1 "


def _try_lock(fd: int) -> bool:
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def _write(fd: int, data: bytes) -> int:
    """One ``os.write`` (a seam: the fault suite replaces it to fill the disk part-way through a line)."""
    return os.write(fd, data)


def frame(batch: Batch) -> bytes:
    """One spool line: magic, CRC-32 of the JSON, the JSON, newline."""
    payload = batch.to_json().encode("utf-8")
    return b"%s%08x %s\n" % (_MAGIC, zlib.crc32(payload), payload)


def unframe(line: bytes) -> Batch:
    """The batch in one spool line; ``ValueError`` when the line is torn or garbled."""
    if not line.endswith(b"\n"):
        raise ValueError("incomplete line (no newline)")
    body = line[:-1]
    if body.startswith(b"{"):  # unframed line written by an older version
        return Batch.from_json(body.decode("utf-8"))
    if not body.startswith(_MAGIC) or len(body) < len(_MAGIC) + 9:
        raise ValueError("not a spool record")
    crc, payload = body[len(_MAGIC) : len(_MAGIC) + 8], body[len(_MAGIC) + 9 :]
    if int(crc, 16) != zlib.crc32(payload):
        raise ValueError("checksum mismatch")
    return Batch.from_json(payload.decode("utf-8"))


class Spool:
    """Append-only batch file owned by one store. ``pending`` counts the batches in it; ``quarantined`` counts
    the lines :meth:`read` had to set aside."""

    def __init__(self, directory: str | os.PathLike[str], path: Path | None = None, *, database: str = "") -> None:
        self.dir = Path(directory)
        named = f"{database}-" if database else ""
        self.path = path or self.dir / f"spool-{named}{uuid.uuid4().hex[:12]}.jsonl"
        self.pending = 0
        self.quarantined = 0
        self._fd: int | None = None
        self._torn = False  # a failed append left bytes that could not be cut off
        self._lock = threading.Lock()

    @property
    def quarantine_path(self) -> Path:
        return self.dir / f"quarantine-{self.path.stem.removeprefix('spool-')}.jsonl"

    def open_locked(self) -> int:
        """The spool file's descriptor, opened and locked for this process (``OSError`` when another process
        holds the lock)."""
        if self._fd is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            if not _try_lock(fd):
                os.close(fd)
                raise OSError(f"spool file {self.path} is locked by another process")
            self._fd = fd
        return self._fd

    def append(self, batch: Batch) -> None:
        """Add one batch (one line) and hand it to the OS; on failure the file is left as it was."""
        data = frame(batch)
        with self._lock:
            fd = self.open_locked()
            start = os.lseek(fd, 0, os.SEEK_END)
            if self._torn:
                data = b"\n" + data  # end the fragment a failed append left, so it stays one bad line
            try:
                view = memoryview(data)
                while view:
                    view = view[_write(fd, bytes(view)) :]
            except BaseException:
                self._cut(fd, start)
                raise
            self._torn = False
            self.pending += 1

    def _cut(self, fd: int, size: int) -> None:
        try:
            os.ftruncate(fd, size)
        except OSError:
            self._torn = True
            log.exception("stabmon spool %s: cannot cut off a failed append", self.path)

    def read(self, *, quarantine: bool = True) -> list[Batch]:
        """Every intact batch in the file, oldest first. Torn or garbled lines go to the quarantine file
        (with ``quarantine=False`` they are only skipped: a look that changes nothing)."""
        if not self.path.exists():
            return []
        out, bad = [], []
        with open(self.path, "rb") as fh:
            for n, line in enumerate(fh, 1):
                if line == b"\n":
                    continue
                try:
                    out.append(unframe(line))
                except (ValueError, TypeError, KeyError) as exc:
                    if not quarantine:
                        continue
                    bad.append(line)
                    log.error("stabmon spool %s: line %d is damaged (%s); moved to %s", self.path, n, exc,
                              self.quarantine_path)
        if bad:
            self._quarantine(bad)
        return out

    def _quarantine(self, lines: list[bytes]) -> None:
        self.quarantined += len(lines)
        try:
            with open(self.quarantine_path, "ab") as fh:
                fh.writelines(line if line.endswith(b"\n") else line + b"\n" for line in lines)
        except OSError:
            log.exception("stabmon spool: cannot keep %d damaged lines in %s", len(lines), self.quarantine_path)

    def clear(self) -> None:
        """Empty the file after its batches were written."""
        with self._lock:
            if self._fd is not None:
                os.ftruncate(self._fd, 0)
            elif self.path.exists():
                self.path.write_bytes(b"")
            self.pending = 0
            self._torn = False

    def close(self, *, remove_if_empty: bool = True) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if remove_if_empty and self.pending == 0 and self.path.exists() and self.path.stat().st_size == 0:
                self.path.unlink()


def database_identity(url: str) -> str:
    """A short name for the database ``url`` points at, the same for every URL of it: a SQLite file's resolved
    path, else driver family, user, host, port and database name (no password, no options)."""
    from sqlalchemy.engine import make_url

    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        where = "sqlite:" + (str(Path(u.database).resolve()) if u.database and u.database != ":memory:"
                             else f":memory:{uuid.uuid4().hex}")
    else:
        where = f"{u.get_backend_name()}://{u.username or ''}@{u.host or ''}:{u.port or ''}/{u.database or ''}"
    return hashlib.sha256(where.encode()).hexdigest()[:12]


_NAMED = re.compile(r"^spool-(?P<db>[0-9a-f]{12})-[0-9a-f]{12}\.jsonl$")


def orphans(directory: str | os.PathLike[str], *, database: str, any_database: bool = False) -> list[Spool]:
    """Spool files in ``directory`` meant for ``database`` whose owning store is gone (their lock is free),
    locked for the caller; with ``any_database``, every one, whichever database it names or if it names none (an
    earlier release's): ``stabmon db recover --any-database``, whose user says where they go."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = []
    for path in sorted(d.glob("spool-*.jsonl")):
        named = _NAMED.match(path.name)
        if not any_database and named is not None and named["db"] != database:
            continue  # another database's rows
        if not any_database and named is None:
            log.warning("stabmon store: %s names no database (an earlier release wrote it): not adopted; "
                        "`stabmon db recover --db URL --any-database` writes it to the database you name", path)
            continue
        sp = Spool(d, path)
        try:
            sp.open_locked()
        except OSError:
            continue  # a live store owns it
        with open(path, "rb") as fh:
            sp.pending = sum(1 for line in fh if line.strip())
        found.append(sp)
    return found
