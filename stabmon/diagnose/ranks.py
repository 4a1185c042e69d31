"""``diagnose`` under torch.distributed: every rank re-runs and replays together, and all agree on one verdict.

The runbook engine runs on rank 0, inside a flush, while the other ranks wait in that flush's broadcast for
its decisions (:mod:`stabmon.collect.cluster.distributed`). When rank 0 applies a ``diagnose`` decision,
:class:`CrossRank` first sends a :class:`~stabmon.collect.cluster.distributed.Join` through that broadcast; every other
rank then runs the very same experiments on its own model shard or replica, its own batches and its own RNG
states (the model's collectives, DDP's all-reduce or FSDP's all-gathers, happen as in training), and the ranks
exchange what they found through a :class:`~stabmon.collect.cluster.joint.RankChannel`:

1. each rank's plan (incident and reference steps, checkpoint step, whether the re-run can run) or the reason
   it has none: any reason, or plans that differ, make every rank return ``inconclusive`` before any
   experiment starts, so no rank is left waiting in a collective the others skip;
2. each rank's evidence: its re-run compared with what *that rank* recorded, and its replayed values;
3. rank 0's verdict, so every rank holds the same result (stored once, by rank 0).

A rank whose own loss did not reproduce is named (``hardware_suspect``, with its host); the replay takes the
mean over ranks of each step's value, as the record does. Then rank 0 shares its decisions as at every flush,
and each rank's executor takes the diagnosis it already holds instead of running it again.

Bounded: the three exchanges run on a gloo group of their own whose timeout is ``config.diagnose.timeout``
(300 s); a rank that does not arrive makes the others' exchange fail after that long and their verdict
``inconclusive``. The model's own collectives inside the experiments are bounded by the process group's
timeout (``init_process_group(timeout=...)``), as in training.

>>> channel = RankChannel(rank=0, world_size=1, timeout=1.0)
>>> channel.gather({"rank": 0}), channel.share("verdict")
([{'rank': 0}], 'verdict')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stabmon.collect.cluster.distributed import broadcast
from stabmon.collect.cluster.joint import Joint, RankChannel
from stabmon.diagnose.verdict import Diagnosis
from stabmon.interventions.diagnose import Diagnose

__all__ = ["CrossRank", "RankChannel"]


class CrossRank(Joint):
    """The live target's diagnoser: ``run(**params)`` alone in one process; under torch.distributed rank 0
    calls the other ranks in (a :class:`Join` through ``send``) and each of them keeps the result of the run
    it joined for its executor (see the module docstring). ``last``: the latest diagnosis on this rank.

    >>> from stabmon.diagnose import Diagnosis
    >>> cross = CrossRank(lambda **p: Diagnosis("data", "seen again", step=p["step"]), rank=0, world_size=1)
    >>> cross(step=3).verdict, cross.last.step
    ('data', 3)
    """

    def __init__(self, run: Callable[..., Diagnosis], *, rank: int, world_size: int,
                 send: Callable[[Any], Any] = broadcast) -> None:
        super().__init__(Diagnose.name, run, rank=rank, world_size=world_size, send=send)

    def absent(self) -> Diagnosis:
        return Diagnosis.inconclusive(f"rank {self.rank} was not called into the diagnosis by rank 0",
                                      rank=self.rank)
