"""Checkpoints that are distrusted until checked: atomic saves, a registry, validation, last-known-good.

:class:`CheckpointManager` saves state dicts atomically (temporary file in the same directory, ``fsync``,
rename, ``fsync`` of the directory), keeps the newest ``keep`` of its own files, and records every checkpoint
(its own and the user's, via :meth:`CheckpointManager.register`) with step, path and byte count in
``registry.json`` beside the files, and in the store when a sink is given. Before a checkpoint is used it
is validated, in order: the file exists -> its size is the recorded byte count -> it loads
(``torch.load(weights_only=True)`` unless told otherwise) -> every floating-point tensor in it is finite.
:meth:`CheckpointManager.last_known_good` walks from the newest checkpoint saved before a step to older
ones and returns the first that passes.

:class:`UserCheckpoints` keeps the same registry and validation over the training loop's own checkpoint files:
the loop's ``save(step) -> path`` writes them and its ``load(path) -> dict`` reads them back, so a nanoGPT-style
loop that already ``torch.save``s its checkpoint dict needs no second checkpoint system.

:class:`KillSwitch` watches for a file whose appearance asks the run to checkpoint and stop; the process
then exits with :data:`STOP_EXIT_CODE`.

torch is imported only when a checkpoint is saved or loaded.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)

STOP_EXIT_CODE = 86
"""Exit code of a run stopped on purpose by stabmon (``checkpoint_and_stop`` or the kill switch)."""
HARDWARE_EXIT_CODE = 88
"""Suggested exit code of ``checkpoint_and_stop`` after ``diagnose`` found a step that did not reproduce
(``hardware_suspect``): the scheduler should restart the job on other machines (runbooks/default.yaml, when the
fault comes back after a restart; runbooks/diagnose-first.yaml, at once)."""

REGISTRY_NAME = "registry.json"


class NoValidCheckpointError(RuntimeError):
    """No registered checkpoint passed validation; ``reasons`` maps each candidate path to why it was
    refused."""

    def __init__(self, message: str, reasons: Mapping[str, str], *, later: Sequence[int] = ()) -> None:
        details = [f"{p}: {r}" for p, r in reasons.items()]
        if later:
            details.append(f"{len(later)} registered after it, steps {min(later)}-{max(later)}")
        super().__init__(f"{message} ({'; '.join(details) or 'no checkpoints registered'})")
        self.reasons = dict(reasons)


@runtime_checkable
class CheckpointStore(Protocol):
    """The one seam between the monitor and where checkpoints live: the monitor's own
    :class:`CheckpointManager` and the user's :class:`UserCheckpoints` both stand behind it (as torchtitan's
    checkpointer stands behind its storage). What the rollback, the stop, the periodic save, diagnose and a
    resume call; ``checkpoints=`` must be one (checked at start)."""

    directory: Path
    reader: bool
    hold_before: int | None

    @property
    def can_save(self) -> bool: ...

    @property
    def checkpoints(self) -> list[CheckpointInfo]: ...

    def save(self, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]], *, step: int) -> CheckpointInfo: ...

    def register(self, path: str | os.PathLike[str], *, step: int) -> CheckpointInfo: ...

    def candidates(self, before_step: int | None = None) -> list[CheckpointInfo]: ...

    def validate(self, info: CheckpointInfo, check: Callable[[dict[str, Any]], str | None] | None = None
                 ) -> tuple[dict[str, Any] | None, str | None]: ...

    def last_known_good(
        self, before_step: int | None = None, *, check: Callable[[dict[str, Any]], str | None] | None = None
    ) -> tuple[CheckpointInfo, dict[str, Any]]: ...

    def rolled_back(self, target: CheckpointInfo) -> str | None: ...

    def starts_at(self, step: int) -> list[CheckpointInfo]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def adopt(self, state: Mapping[str, Any]) -> int: ...

    def attach(self, *, sink: Any, run_id: str) -> None: ...


@dataclass(frozen=True)
class CheckpointInfo:
    """One registered checkpoint: the training step it holds, its path, its byte count at save time, and
    whether stabmon wrote it (``own``; only own files are pruned)."""

    step: int
    path: str
    nbytes: int
    own: bool = True
    timeline: int = 0
    """Which line of training saved it: a rollback starts a new timeline (see :meth:`CheckpointManager.rolled_back`)."""
    abandoned: bool = False
    """Saved after a checkpoint that a rollback went back to: its training was undone, never resume from it."""


class CheckpointManager:
    """Save, register, validate and choose checkpoints in one directory.

    ``every``: save interval in steps for :meth:`maybe_save` (None: only explicit saves).
    ``keep``: how many of its own checkpoints to keep (older ones are deleted; registered user files never
    are).
    ``sink``/``run_id``: also record checkpoints in the store. ``weights_only``: load with
    ``torch.load(weights_only=True)`` (safe; state dicts of tensors and plain Python values pass).

    >>> import tempfile, torch
    >>> d = tempfile.mkdtemp()
    >>> m = CheckpointManager(d, keep=2)
    >>> _ = m.save({"w": torch.ones(2)}, step=10); _ = m.save({"w": torch.full((2,), float("nan"))}, step=20)
    >>> info, state = m.last_known_good(before_step=100)
    >>> info.step, state["w"].tolist()
    (10, [1.0, 1.0])
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every: int | None = None,
        keep: int = 3,
        prefix: str = "ckpt",
        sink: Any = None,
        run_id: str | None = None,
        weights_only: bool = True,
    ) -> None:
        if every is not None and every <= 0:
            raise ValueError(f"checkpoints.every must be > 0, got {every}")
        if keep < 1:
            raise ValueError(f"checkpoints.keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.unwritable = unwritable(self.directory)
        """Why the directory cannot be written (None: it can), found at start and logged as an error: rollbacks
        will restore but not update the registry, and saves (checkpoint-and-stop's too) will fail."""
        if self.unwritable is not None:
            log.error("stabmon: checkpoint directory %s cannot be written (%s): checkpoints will not be saved and "
                      "a rollback will not be recorded in its registry", self.directory, self.unwritable)
        else:
            removed = remove_stale_temporaries(self.directory)
            if removed:
                log.warning("stabmon: removed %d temporary file(s) an interrupted save left in %s: %s", len(removed),
                            self.directory, ", ".join(removed))
        self.every, self.keep, self.prefix = every, keep, prefix
        self.sink, self.run_id, self.weights_only = sink, run_id, weights_only
        self.store_errors = 0
        self.reader = False
        self.hold_before: int | None = None
        """While an incident is open, its onset (the monitor sets it after each flush; None: none open): the
        newest of this manager's checkpoints at or before it is not pruned, whatever ``keep`` says, so that
        the checkpoints saved while the incident is being diagnosed and answered cannot push out the one its
        rollback needs."""
        """Another process (rank 0, in a directory every rank shares) keeps the registry: read it afresh before
        each use (set from the :class:`~stabmon.collect.cluster.rank_policy.RankPolicy`)."""
        self._entries: list[CheckpointInfo] = self._read_registry()
        self.timeline = max((e.timeline for e in self._entries), default=0)

    # -- registry --
    @property
    def checkpoints(self) -> list[CheckpointInfo]:
        """Registered checkpoints, oldest step first (the newer timeline first at equal steps)."""
        if self.reader:
            self.reload()
        return sorted(self._entries, key=lambda e: (e.step, e.timeline))

    def _read_registry(self) -> list[CheckpointInfo]:
        path = self.directory / REGISTRY_NAME
        if not path.is_file():
            return []
        try:
            return [CheckpointInfo(**e) for e in json.loads(path.read_text())["checkpoints"]]
        except (ValueError, KeyError, TypeError):
            log.exception("stabmon: unreadable checkpoint registry %s; starting a new one", path)
            return []

    def _write_registry(self) -> None:
        payload = json.dumps({"checkpoints": [asdict(e) for e in self.checkpoints]}, indent=1).encode()
        self._recreate()
        _atomic_write(self.directory / REGISTRY_NAME, lambda f: f.write(payload))

    def _recreate(self) -> None:
        """Make the directory again if it was deleted under the run (its registry is rewritten from memory)."""
        if not self.directory.is_dir():
            log.error("stabmon: checkpoint directory %s is gone; creating it again", self.directory)
            self.directory.mkdir(parents=True, exist_ok=True)

    def _record(self, info: CheckpointInfo, *, valid: bool = True) -> None:
        if self.sink is None or self.run_id is None:
            return
        try:
            self.sink.write_checkpoint(run_id=self.run_id, step=info.step, path=info.path, nbytes=info.nbytes,
                                       valid=valid)
        except Exception:  # noqa: BLE001 - store failures never reach training
            self.store_errors += 1
            log.exception("stabmon: could not record checkpoint %s in the store", info.path)

    def _add(self, info: CheckpointInfo) -> CheckpointInfo:
        """Register ``info`` and prune: the registry is written before old files are deleted, so that, stopped
        at any point (SIGTERM), it never lists a file that is gone."""
        self._entries = [e for e in self._entries if e.path != info.path] + [info]
        pruned = self._prune()
        self._write_registry()
        self._delete(pruned)
        self._record(info)
        return info

    def _prune(self) -> list[CheckpointInfo]:
        """Take the oldest of this manager's own checkpoints past ``keep`` out of the registry; returns them
        (their files are deleted once the registry is written)."""
        own = sorted((e for e in self._entries if e.own), key=lambda e: (not e.abandoned, e.step, e.timeline))
        if self.hold_before is not None:  # an open incident's rollback target stays (one file over keep)
            held = max((e for e in own if not e.abandoned and e.step <= self.hold_before),
                       key=lambda e: (e.step, e.timeline), default=None)
            own = [e for e in own if e is not held]
        pruned = own[: max(0, len(own) - self.keep)]
        for old in pruned:
            self._entries.remove(old)
        return pruned

    @staticmethod
    def _delete(pruned: list[CheckpointInfo]) -> None:
        for old in pruned:
            try:
                Path(old.path).unlink(missing_ok=True)
            except OSError:
                log.exception("stabmon: could not delete old checkpoint %s", old.path)

    # -- saving --
    def save(self, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]], *, step: int) -> CheckpointInfo:
        """Write ``state`` (or what ``state()`` returns) and register it with its byte count. Ctrl-C or SIGTERM
        during the write is raised as what it is (see :func:`interruption`), never as a failed save, and
        nothing is registered."""
        handled = sys.exc_info()[1]
        try:
            path = Path(self._save(state, step))
        except Exception as exc:
            interrupt = interruption(exc, handled=handled)
            if interrupt is None:
                raise
            log.warning("stabmon: the checkpoint save for step %d was interrupted (%s); nothing was registered",
                        step, type(interrupt).__name__)
            raise interrupt from None
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint save for step {step} wrote no file at {path}")
        info = CheckpointInfo(step=step, path=str(path), nbytes=path.stat().st_size, own=self.owns_saves,
                              timeline=self.timeline)
        return self._add(info)

    owns_saves = True
    """Whether the files :meth:`save` writes are this manager's to prune (``keep``)."""

    @property
    def can_save(self) -> bool:
        """Whether :meth:`save` can write a checkpoint."""
        return True

    def _save(self, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]], step: int) -> Path:
        """Write the file (atomically, with ``torch.save``) and return its path."""
        import torch

        payload = dict(state() if callable(state) else state)
        tag = f"-t{self.timeline}" if self.timeline else ""
        path = self.directory / f"{self.prefix}-{step:09d}{tag}.pt"
        self._recreate()
        _atomic_write(path, lambda f: torch.save(payload, f))
        return path

    def _load(self, path: Path) -> Any:
        """Read one checkpoint file back (``torch.load`` on the CPU)."""
        import torch

        return torch.load(path, map_location="cpu", weights_only=self.weights_only)

    def rolled_back(self, target: CheckpointInfo) -> str | None:
        """Record a rollback to ``target``: every checkpoint saved after it is abandoned (its training was
        undone) and later saves belong to a new timeline, so a resume continues the rolled-back line. Returns
        why the registry file could not be updated (None: it was); the rollback stands either way, and this
        manager keeps the new timeline in memory."""
        self._abandon_after(target.step)
        try:
            self._write_registry()
        except OSError as exc:
            log.error("stabmon: rolled back to step %d, but the registry %s could not be updated (%s: %s)",
                      target.step, self.directory / REGISTRY_NAME, type(exc).__name__, exc)
            return f"{type(exc).__name__}: {exc}"
        return None

    def starts_at(self, step: int) -> list[CheckpointInfo]:
        """This process's training starts at ``step`` (a fresh run, or a resume): the checkpoints registered after
        it are of a line it does not continue (an earlier run in this directory, or the steps after an older
        checkpoint a resume chose). They are set aside as a rollback abandons its undone steps (never restored,
        never resumed from; later saves go on a new timeline), and they no longer count against ``keep`` nor are
        they deleted: they are not this run's files. Returns them (none: the registry is not touched)."""
        later = [e for e in self._entries if e.step > step and not e.abandoned]
        if not later:
            return []
        self._abandon_after(step, own=False)
        self._write_registry()
        return later

    def _abandon_after(self, step: int, *, own: bool | None = None) -> None:
        """Every checkpoint after ``step`` not abandoned yet is (``own``: set it too, when not None); later saves
        go on a new timeline."""
        self.timeline += 1
        mark: dict[str, Any] = {"abandoned": True} if own is None else {"abandoned": True, "own": own}
        self._entries = [CheckpointInfo(**{**asdict(e), **mark}) if e.step > step and not e.abandoned else e
                         for e in self._entries]

    def maybe_save(self, state_fn: Callable[[], Mapping[str, Any]], *, step: int) -> CheckpointInfo | None:
        """Save ``state_fn()`` when ``step`` is a positive multiple of ``every``."""
        if self.every is None or step <= 0 or step % self.every:
            return None
        return self.save(state_fn, step=step)

    def latest(self) -> CheckpointInfo | None:
        """The checkpoint to resume from: the newest one on the current timeline (never one a rollback
        abandoned, even when its step is higher), or None."""
        alive = [e for e in self.checkpoints if not e.abandoned]
        return max(alive, key=lambda e: (e.timeline, e.step), default=None)

    def register(self, path: str | os.PathLike[str], *, step: int) -> CheckpointInfo:
        """Register a checkpoint the user saved themselves; its current byte count becomes the expected
        one."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"cannot register checkpoint {p}: no such file")
        return self._add(
            CheckpointInfo(step=step, path=str(p), nbytes=p.stat().st_size, own=False, timeline=self.timeline)
        )

    # -- validation and choice --
    def validate(
        self, info: CheckpointInfo, check: Callable[[dict[str, Any]], str | None] | None = None
    ) -> tuple[dict[str, Any] | None, str | None]:
        """``(state, None)`` when ``info`` passes every check, else ``(None, reason)``. ``check(state)`` is a
        last check of the caller's (does the state fit the model?) returning a reason to refuse, or None."""
        p = Path(info.path)
        if not p.is_file():
            return None, "file does not exist"
        size = p.stat().st_size
        if size != info.nbytes:
            return None, f"byte count {size} differs from the {info.nbytes} recorded at save"
        try:
            state = self._load(p)
        except Exception as exc:  # noqa: BLE001 - any load failure disqualifies the file
            first = (str(exc).splitlines() or [""])[0]
            return None, f"does not load: {type(exc).__name__}: {first}"
        bad = next(_nonfinite(state, ""), None)
        if bad is not None:
            return None, f"non-finite values in {bad or 'the state'}"
        problem = check(state) if check is not None else None
        if problem is not None:
            return None, problem
        return state, None

    def candidates(self, before_step: int | None = None) -> list[CheckpointInfo]:
        """What a rollback may choose, newest first (the newer timeline first at equal steps): every checkpoint
        saved at or before ``before_step`` that no rollback abandoned. Reads the registry only."""
        return [e for e in reversed(self.checkpoints)
                if not e.abandoned and (before_step is None or e.step <= before_step)]

    def last_known_good(
        self, before_step: int | None = None, *, check: Callable[[dict[str, Any]], str | None] | None = None
    ) -> tuple[CheckpointInfo, dict[str, Any]]:
        """The newest checkpoint saved at or before ``before_step`` that validates (and passes ``check``),
        with its loaded state. Abandoned checkpoints (saved on a timeline a rollback undid) are never chosen.

        Invalid candidates are logged and recorded in the store as invalid; raises
        :class:`NoValidCheckpointError` when none is left.
        """
        reasons: dict[str, str] = {}
        newer = [e.step for e in self.candidates() if before_step is not None and e.step > before_step]
        for info in self.candidates(before_step):
            state, reason = self.validate(info, check)
            if state is not None:
                return info, state
            reasons[info.path] = str(reason)
            log.warning("stabmon: checkpoint %s (step %d) refused: %s", info.path, info.step, reason)
            self._record(info, valid=False)
        where = f"at or before step {before_step}" if before_step is not None else "at all"
        raise NoValidCheckpointError(f"no valid checkpoint {where} in {self.directory}", reasons, later=newer)

    def state_dict(self) -> dict[str, Any]:
        return {"checkpoints": [asdict(e) for e in self.checkpoints]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._entries = [CheckpointInfo(**e) for e in state["checkpoints"]]
        self._write_registry()

    def adopt(self, state: Mapping[str, Any]) -> int:
        """Add the checkpoints of a :meth:`state_dict` this registry does not know yet (a resume into another
        directory must still reach the checkpoints saved before it); returns how many. Adopted files are
        never pruned: they are not this manager's."""
        known = {e.path for e in self._entries}
        new = [CheckpointInfo(**{**e, "own": False}) for e in state.get("checkpoints", ()) if e["path"] not in known]
        if new:
            before = self.registry_snapshot()
            self._entries = self._entries + new
            self.timeline = max(self.timeline, *(e.timeline for e in new))
            try:
                self._write_registry()
            except BaseException:
                self._entries, self.timeline = before
                raise
        return len(new)

    def registry_snapshot(self) -> tuple[list[CheckpointInfo], int]:
        """The registry as it is now (entries and timeline), for :meth:`restore_registry`."""
        return list(self._entries), self.timeline

    def restore_registry(self, snapshot: tuple[list[CheckpointInfo], int]) -> None:
        """The registry of a :meth:`registry_snapshot` (a resume that failed after adopting checkpoints),
        written back."""
        entries, self.timeline = snapshot
        self._entries = list(entries)
        self._write_registry()

    def reload(self) -> None:
        """Read the registry file again (another process, rank 0, keeps it)."""
        self._entries = self._read_registry()
        self.timeline = max((e.timeline for e in self._entries), default=0)

    def attach(self, *, sink: Any, run_id: str) -> None:
        """Record checkpoints in ``sink`` under ``run_id`` from now on (the monitor does this for a manager
        it was given)."""
        if self.sink is None:
            self.sink = sink
        self.run_id = run_id


DEFAULT_USER_KEEP = 3
"""How many of the files a :class:`UserCheckpoints` ``save=`` wrote are kept by default (the
:class:`CheckpointManager`'s own default): a run's disk use stays bounded, and with a checkpoint every N steps a
rollback can still reach 2N-3N steps back."""


class UserCheckpoints(CheckpointManager):
    """Rollback, resume and checkpoint-and-stop through the training loop's own checkpoint files.

    ``save(step) -> path``: write the loop's checkpoint for ``step`` (optimizer steps completed) and return where.
    The monitor calls it every ``config.checkpoint_every`` steps, when the run is interrupted (Ctrl-C, SIGTERM),
    right after a rollback and for ``checkpoint_and_stop``; ``monitor.save_checkpoint()`` calls it from the loop.
    None: the loop saves on its own and tells the monitor with :meth:`register`.
    ``load(path) -> dict``: read one back (default ``torch.load(path, map_location="cpu", weights_only=True)``).
    A rollback restores the dict's ``model``, ``optimizer`` (and ``scaler``, ``scheduler`` when the monitor has
    them) and ``monitor`` entries, so the dict must hold ``monitor.state_dict()`` under ``"monitor"``.
    ``existing() -> [(step, path), ...]``: checkpoints already on disk, registered at start (their byte count
    is taken as it is then); None: only the registry (``registry.json`` in ``directory``) and the monitor's state.
    ``keep``: how many of the files ``save`` wrote to keep (older ones deleted; default
    :data:`DEFAULT_USER_KEEP`); None: stabmon deletes nothing. Files the loop registered itself are never
    deleted.

    Every candidate is checked like the monitor's own: the file exists -> it has the byte count recorded at
    save -> ``load`` reads it -> its tensors are finite -> it fits the model and optimizer.

    >>> import tempfile, torch
    >>> d = tempfile.mkdtemp(); w = {"w": torch.ones(2)}
    >>> def save(step):
    ...     path = f"{d}/ckpt-{step}.pt"; torch.save({"model": w, "iter_num": step}, path); return path
    >>> ckpts = UserCheckpoints(d, save=save)
    >>> _ = ckpts.save(None, step=10); w["w"][0] = float("nan"); _ = ckpts.save(None, step=20)
    >>> info, state = ckpts.last_known_good(before_step=100)
    >>> info.step, state["iter_num"], ckpts.latest().step
    (10, 10, 20)
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        save: Callable[[int], str | os.PathLike[str]] | None = None,
        load: Callable[[str], Any] | None = None,
        existing: Callable[[], Iterable[tuple[int, str | os.PathLike[str]]]] | None = None,
        keep: int | None = DEFAULT_USER_KEEP,
        sink: Any = None,
        run_id: str | None = None,
    ) -> None:
        for name, fn in (("save", save), ("load", load), ("existing", existing)):
            if fn is not None and not callable(fn):
                raise ValueError(f"checkpoints.{name} must be callable, got {type(fn).__name__}")
        super().__init__(directory, keep=keep or 1, sink=sink, run_id=run_id)
        self.owns_saves = keep is not None
        self.user_save, self.user_load = save, load
        for step, path in existing() if existing is not None else ():
            if str(path) not in {e.path for e in self._entries}:
                self.register(path, step=int(step))

    @property
    def can_save(self) -> bool:
        return self.user_save is not None

    def _save(self, state: Any, step: int) -> Path:
        if self.user_save is None:
            raise RuntimeError(
                "checkpoints: UserCheckpoints has no save= callable; save in the loop and call register(path, step=)"
            )
        return Path(self.user_save(step))

    def _load(self, path: Path) -> Any:
        if self.user_load is None:
            return super()._load(path)
        return self.user_load(str(path))


class KillSwitch:
    """A file whose appearance asks the run to checkpoint and stop. :meth:`triggered` costs one ``stat``
    and is only performed every ``every`` calls (call it once per step).

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "STOP"
    >>> ks = KillSwitch(path, every=1)
    >>> ks.triggered()
    False
    >>> _ = path.write_text("maintenance"); ks.triggered(), ks.reason()  # doctest: +ELLIPSIS
    (True, 'kill switch file ... maintenance')
    """

    def __init__(self, path: str | os.PathLike[str], *, every: int = 10) -> None:
        if every < 1:
            raise ValueError(f"kill_switch.every must be >= 1, got {every}")
        self.path, self.every, self._calls = Path(path), every, 0

    def triggered(self) -> bool:
        self._calls += 1
        if self._calls % self.every:
            return False
        return self.path.exists()

    def reason(self) -> str:
        try:
            text = self.path.read_text(errors="replace").strip()[:200]
        except OSError:
            text = ""
        return f"kill switch file {self.path} appeared" + (f": {text}" if text else "")


def unwritable(directory: Path) -> str | None:
    """Why a file cannot be created in ``directory`` (tried, so that it holds for root and read-only mounts
    too), or None.

    >>> import tempfile
    >>> unwritable(Path(tempfile.mkdtemp())) is None
    True
    """
    try:
        fd, probe = tempfile.mkstemp(prefix=".stabmon-probe-", dir=directory)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    os.close(fd)
    Path(probe).unlink(missing_ok=True)
    return None


def interruption(exc: BaseException, *, handled: BaseException | None = None) -> BaseException | None:
    """The Ctrl-C (``KeyboardInterrupt``) or SIGTERM (``SystemExit``, from the monitor's handler) that ``exc``
    is or was raised while handling, else None. ``torch.save`` interrupted in the middle of writing closes its
    zip writer on the way out, and that raises a ``RuntimeError`` of its own ("unexpected pos ..."), which hides
    the interrupt from anyone who catches errors and carries on. ``handled``: the exception being handled when
    the call that raised ``exc`` began (``sys.exc_info()[1]`` then): an interrupt already on its way (the monitor
    closing as ``interrupted`` from ``__exit__``) is not a new one, and a failure during that close is only a
    failure.

    >>> try:
    ...     try:
    ...         raise KeyboardInterrupt
    ...     finally:
    ...         raise RuntimeError("unexpected pos 4004672 vs 4004624")
    ... except RuntimeError as exc:
    ...     type(interruption(exc)).__name__, interruption(ValueError("bad"))
    ('KeyboardInterrupt', None)
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if current is handled:
            return None
        if isinstance(current, (KeyboardInterrupt, SystemExit)):
            return current
        seen.add(id(current))
        current = current.__context__
    return None


_HOST = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"
_TEMPORARY = re.compile(r"^\..+\.tmp$")
_OWNER = re.compile(r"\.~(?P<host>[^~]+)~(?P<pid>\d+)~[^~]*\.tmp$")
STALE_AFTER_S = 24 * 3600.0
"""A temporary file of another host (or one that does not name its writer) older than this is left over."""


def remove_stale_temporaries(directory: Path) -> list[str]:
    """Remove the temporary files saves left behind in ``directory`` when their process died (SIGKILL, a node
    lost) part-way through: one whose writer, named in its file name, was a process of this host that is gone,
    or one older than :data:`STALE_AFTER_S`. A save still in progress (its process alive) is left alone.
    Returns the names removed."""
    removed = []
    for path in directory.iterdir() if directory.is_dir() else ():
        if not _TEMPORARY.match(path.name):
            continue
        owner = _OWNER.search(path.name)
        try:
            stale = (owner is not None and owner["host"] == _HOST and not _alive(int(owner["pid"]))) \
                or time.time() - path.stat().st_mtime > STALE_AFTER_S
            if stale:
                path.unlink()
                removed.append(path.name)
        except OSError:  # gone meanwhile, or not ours to remove: left as it is
            continue
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists (another user's process)
        return True
    return True


def _atomic_write(path: Path, write: Callable[[Any], Any]) -> int:
    """Write through ``write(fileobj)`` to a temporary file beside ``path``, fsync, rename; return the
    size."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.~{_HOST}~{os.getpid()}~", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:  # some filesystems cannot fsync a directory
        pass
    return path.stat().st_size


def nonfinite_entry(state: Any) -> str | None:
    """The dotted path of the first floating-point tensor in ``state`` holding NaN or inf ("" for ``state``
    itself), or None when every one is finite."""
    return next(_nonfinite(state, ""), None)


def _nonfinite(obj: Any, where: str) -> Iterator[str]:
    """Paths of floating-point tensors holding NaN or inf, depth first (plain floats such as an infinite clip
    threshold are legitimate state and are not checked)."""
    import torch

    if isinstance(obj, torch.Tensor):
        if (obj.is_floating_point() or obj.is_complex()) and not bool(torch.isfinite(obj).all()):
            yield where
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _nonfinite(v, f"{where}.{k}" if where else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _nonfinite(v, f"{where}[{i}]")
