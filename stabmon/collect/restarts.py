"""Joining a torch.distributed job under ``torchrun --max-restarts``: a process group of its own per restart.

torchelastic's agent keeps one store for the whole job and hands it to every attempt. The default process
group's rendezvous keys (each rank's gloo address) are the same on every attempt, so a rank of attempt 1 can read
the address a rank of attempt 0 published and connect to a process that no longer exists ("Gloo connectFullMesh
failed ... Connection refused": a restart after a hang failed about half the time). :func:`init_process_group`
puts each attempt's keys under a prefix of its own (``TORCHELASTIC_RESTART_COUNT``).

>>> attempt_prefix({"TORCHELASTIC_RESTART_COUNT": "2"}), attempt_prefix({})
('stabmon/attempt-2/', 'stabmon/attempt-0/')
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def attempt_prefix(environ: Mapping[str, str] = os.environ) -> str:
    """The store prefix of this restart attempt (0 outside torchrun)."""
    return f"stabmon/attempt-{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def init_process_group(backend: str, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group(backend)`` with the ``env://`` rendezvous torchrun sets up, the
    store's keys under :func:`attempt_prefix`; other keyword arguments go to ``init_process_group``."""
    import torch.distributed as dist

    store, rank, world_size = next(iter(dist.rendezvous("env://")))
    dist.init_process_group(backend, store=dist.PrefixStore(attempt_prefix(), store), rank=rank,
                            world_size=world_size, **kwargs)
