"""Who decides, who saves and who writes under torch.distributed: one answer for every path.

A checkpoint is written on five paths. Each is decided in one place, and the same rule says which ranks save:

| path | who decides | who saves | ranks agree afterwards |
|---|---|---|---|
| periodic (``checkpoint_every``) | every rank, at the same step | the saving ranks | no (nothing was decided) |
| interrupt (Ctrl-C, SIGTERM, exit) | each rank, on its own signal | the saving ranks | no (no collective is safe) |
| kill switch | rank 0 (it reads the file) | the saving ranks | yes |
| runbook ``checkpoint_and_stop`` | rank 0 (the engine) | the saving ranks | yes |
| rollback | rank 0 calls it, every rank agrees on the step | the saving ranks (new timeline) | yes |

*The saving ranks* depend on the checkpoint layout, found once at start (:func:`rank_policy`):

- :attr:`Layout.PER_RANK`: each rank has a directory of its own: every rank saves its state and keeps its own
  registry. The only layout for a sharded model (FSDP1 / FSDP2), where each rank's state is its shard.
- :attr:`Layout.SHARED`: one directory seen by every rank, replicated state (DDP): rank 0 saves and keeps the
  registry; the other ranks read it afresh before a rollback.

Rank 0 alone writes to the store and sends alerts, whatever the layout. On the agreed paths rank 0 calls every
rank in through the flush's broadcast (:class:`~stabmon.collect.cluster.joint.Joint`, the path ``diagnose`` takes);
a rank that fails or reaches another result is logged and reported as a ``rank_disagreement`` anomaly.

>>> policy = RankPolicy(rank=1, world_size=2, layout=Layout.SHARED)
>>> policy.leader, policy.saves(SavePath.PERIODIC), policy.keeps_registry, policy.agreed(SavePath.STOP)
(False, False, False, True)
>>> RankPolicy(rank=1, world_size=2).saves(SavePath.KILL_SWITCH)
True
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class Layout(str, Enum):
    """Where the ranks' checkpoints live (see the module docstring)."""

    PER_RANK = "per_rank"
    SHARED = "shared"


class SavePath(str, Enum):
    """The five ways a checkpoint comes to be written."""

    PERIODIC = "periodic"
    INTERRUPT = "interrupt"
    KILL_SWITCH = "kill_switch"
    STOP = "stop"
    ROLLBACK = "rollback"


AGREED = frozenset({SavePath.KILL_SWITCH, SavePath.STOP, SavePath.ROLLBACK})
"""The paths rank 0 decides and every rank then confirms (a join-and-agree)."""


@dataclass(frozen=True)
class RankPolicy:
    """This rank's part on every path: see the module docstring. One process: rank 0 of 1, which does all.

    >>> RankPolicy().leader, RankPolicy().distributed, RankPolicy().agreed(SavePath.ROLLBACK)
    (True, False, False)
    """

    rank: int = 0
    world_size: int = 1
    layout: Layout = Layout.PER_RANK

    @property
    def leader(self) -> bool:
        """Rank 0: runs the detectors and the engine, reads the kill switch, writes the store and the alerts."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def follower(self) -> bool:
        """A rank that applies what rank 0 decided."""
        return self.distributed and not self.leader

    def saves(self, path: SavePath) -> bool:
        """Whether this rank writes a checkpoint on ``path``: the same answer for every path."""
        return self.layout is Layout.PER_RANK or self.leader

    @property
    def keeps_registry(self) -> bool:
        """Whether this rank writes the checkpoint registry (else it reads the one rank 0 keeps)."""
        return self.layout is Layout.PER_RANK or self.leader

    def agreed(self, path: SavePath) -> bool:
        """Whether ``path`` is decided by rank 0 and confirmed by every rank."""
        return self.distributed and path in AGREED


def layout_from(seen: Sequence[Sequence[int]], *, sharded: bool) -> Layout:
    """The layout from what each rank found in its checkpoint directory: ``seen[r]`` holds the ranks whose
    marker rank ``r`` found there (its own included). ``ValueError`` for a layout no rule fits.

    >>> layout_from([(0,), (1,)], sharded=True), layout_from([(0, 1), (0, 1)], sharded=False)
    (<Layout.PER_RANK: 'per_rank'>, <Layout.SHARED: 'shared'>)
    >>> layout_from([(0, 1), (0, 1)], sharded=True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: checkpoint_dir: every rank has the same directory, but the model is sharded (FSDP): ...
    """
    everyone = tuple(range(len(seen)))
    if all(tuple(s) == (r,) for r, s in enumerate(seen)):
        return Layout.PER_RANK
    if all(tuple(s) == everyone for s in seen):
        if sharded:
            raise ValueError("checkpoint_dir: every rank has the same directory, but the model is sharded (FSDP): "
                             "each rank's state is its shard; give each rank its own directory (ckpt-rank{rank})")
        return Layout.SHARED
    groups = sorted({tuple(s) for s in seen})
    raise ValueError(f"checkpoint_dir: ranks share directories in groups {groups}: give every rank its own "
                     "directory (ckpt-rank{rank}), or all of them one")


def rank_policy(rank: int, world_size: int, *, directory: str | os.PathLike[str] | None, sharded: bool,
                replicated: bool = True) -> RankPolicy:
    """The policy of this rank. Under torch.distributed every rank must call it at the same point (it is a
    collective): each rank leaves a marker in its checkpoint directory and looks for the others' there, so a
    directory shared over a network file system is told from node-local ones with the same name.
    ``replicated``: every rank holds the same state (DDP); a shared directory then holds rank 0's."""
    if world_size <= 1:
        return RankPolicy(rank, world_size)
    seen = _probe(rank, world_size, None if directory is None else Path(directory))
    if seen is None:
        return RankPolicy(rank, world_size)
    layout = layout_from(seen, sharded=sharded)
    if layout is Layout.SHARED and not replicated and rank == 0:
        log.warning("stabmon: every rank has checkpoint directory %s but the ranks train alone (no DDP): only rank "
                    "0's state is saved there, and a rollback restores it on every rank", directory)
    return RankPolicy(rank, world_size, layout)


def _probe(rank: int, world_size: int, directory: Path | None) -> list[tuple[int, ...]] | None:
    """Which ranks' markers each rank finds in its directory (None: no rank has checkpoints)."""
    token = f"{time.time_ns():x}-{os.getpid()}"
    dirs = _gather((token, None if directory is None else str(directory)), world_size)
    missing = [r for r, (_, d) in enumerate(dirs) if d is None]
    if len(missing) == world_size:
        return None
    if missing:
        raise ValueError(f"checkpoint_dir: ranks {missing} have no checkpoint directory and the others do: give "
                         "every rank one, or none")
    assert directory is not None
    prefix = f".stabmon-probe-{dirs[0][0]}-rank"  # rank 0's token: no stale marker of an earlier run counts
    mine = directory / f"{prefix}{rank}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        mine.touch()
    except OSError as exc:  # the manager reports an unwritable directory; this rank then counts as alone
        log.error("stabmon: could not leave a marker in checkpoint directory %s (%s)", directory, exc)
    _gather(None, world_size)  # every rank has left its marker
    found = (rank, *(r for r in range(world_size) if r != rank and (directory / f"{prefix}{r}").exists()))
    seen = _gather(tuple(sorted(found)), world_size)  # every rank has looked: the markers may go
    mine.unlink(missing_ok=True)
    return seen


def _gather(value: Any, world_size: int) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, value)
    return out
