"""Joining a torch.distributed job under ``torchrun --max-restarts``: a process group of its own per restart, and
the one checkpoint every rank resumes from.

torchelastic's agent keeps one store for the whole job and hands it to every attempt. The default process
group's rendezvous keys (each rank's gloo address) are the same on every attempt, so a rank of attempt 1 can read
the address a rank of attempt 0 published and connect to a process that no longer exists ("Gloo connectFullMesh
failed ... Connection refused": a restart after a hang failed about half the time). :func:`init_process_group`
puts each attempt's keys under a prefix of its own (``TORCHELASTIC_RESTART_COUNT``).

A rank that dies (killed, out of memory) dies between its peers' checkpoints: the survivors may have saved a
step it never reached. Each rank resuming from its own newest checkpoint then starts the new attempt at two
steps, and its collectives no longer line up. :func:`resume_checkpoint` is the newest step every rank holds and
validates, on every rank.

>>> attempt_prefix({"TORCHELASTIC_RESTART_COUNT": "2"}), attempt_prefix({})
('stabmon/attempt-2/', 'stabmon/attempt-0/')
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from stabmon.checkpoints import CheckpointInfo, CheckpointManager, CheckpointStore, NoValidCheckpointError


def attempt_prefix(environ: Mapping[str, str] = os.environ) -> str:
    """The store prefix of this restart attempt (0 outside torchrun)."""
    return f"stabmon/attempt-{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def init_process_group(backend: str, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group(backend)`` with the ``env://`` rendezvous torchrun sets up, the
    store's keys under :func:`attempt_prefix`; other keyword arguments go to ``init_process_group``."""
    import torch.distributed as dist

    from stabmon.collect.cluster.distributed import PEERS

    store, rank, world_size = next(iter(dist.rendezvous("env://")))
    dist.init_process_group(backend, store=dist.PrefixStore(attempt_prefix(), store), rank=rank,
                            world_size=world_size, **kwargs)
    PEERS.lost = None  # a new process group: every peer is there


def resume_checkpoint(
    checkpoints: str | os.PathLike[str] | CheckpointStore,
    *,
    check: Callable[[dict[str, Any]], str | None] | None = None,
) -> tuple[CheckpointInfo, dict[str, Any]] | None:
    """The checkpoint to resume from and its loaded state, or None (nothing to resume: a first attempt).
    ``checkpoints``: this rank's checkpoint directory, or its :class:`~stabmon.checkpoints.CheckpointStore`;
    ``check(state)``: a reason to refuse a state, or None. Under torch.distributed every rank calls it together
    (after :func:`init_process_group`) and gets the newest step every rank holds and validates; alone, the newest
    valid checkpoint.

    >>> import tempfile, torch
    >>> d = tempfile.mkdtemp()
    >>> resume_checkpoint(d) is None
    True
    >>> _ = CheckpointManager(d).save({"w": torch.ones(1)}, step=10)
    >>> info, state = resume_checkpoint(d); info.step, state["w"].tolist()
    (10, [1.0])
    """
    from stabmon.collect.cluster.distributed import world
    from stabmon.collect.cluster.joint import agreed_checkpoint

    manager = checkpoints if isinstance(checkpoints, CheckpointStore) else CheckpointManager(checkpoints)
    try:
        if world()[1] == 1:
            return manager.last_known_good(check=check)
        return agreed_checkpoint(manager, None, check=check, gather=_gather)
    except NoValidCheckpointError:
        return None


def _gather(value: Any) -> list[Any]:
    """Every rank's ``value``, by rank, on the default process group."""
    import torch.distributed as dist

    from stabmon.collect.cluster.distributed import collective

    out: list[Any] = [None] * dist.get_world_size()
    collective("the resume's gather of every rank's checkpoints", lambda: dist.all_gather_object(out, value))
    return out
