""":func:`build_diagnoser`: the live diagnoser, wired from the collaborators it works with, given explicitly.

The monitor calls it once, after its checkpoints and its record history exist, and hands the result to the live
target (the ``diagnose`` rung calls it) and to the flusher (the other ranks join through it). Nothing here reads
the monitor: the experiments see only what is passed in.

>>> import torch
>>> from stabmon.collect.signals.grads import GradNorms
>>> from stabmon.collect.cluster.joint import RankChannel
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> model = torch.nn.Linear(2, 1)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> class Hooks:
...     def remove(self): pass
...     def install(self): pass
>>> diagnoser = build_diagnoser(model=model, optimizer=opt, scaler=None, grads=GradNorms(model),
...                             hooks=HookSwitch(Hooks()),
...                             batches=None, records=[], checkpoints=None, check=lambda state: None,
...                             loss_fn=None, own=None, rank=0, world_size=1,
...                             channel=RankChannel(rank=0, world_size=1, timeout=1.0))
>>> diagnoser(onset_step=5, step=9, metric="loss", max_batches=4, rtol=1e-4, recur=0.5).summary
'no batch log: the runbook has no diagnose rung, or the monitor no checkpoints to diagnose from'
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from stabmon.checkpoints import CheckpointStore
from stabmon.collect.batches import BatchLog
from stabmon.collect.signals.grads import GradNorms
from stabmon.diagnose.experiments import Bench, call_model, run
from stabmon.diagnose.ranks import CrossRank, RankChannel
from stabmon.diagnose.rerun import LossFn
from stabmon.diagnose.verdict import Diagnosis
from stabmon.events import StepRecord


class Switchable(Protocol):
    """Hooks that can be put on the optimizer and taken off (the monitor's optimizer hooks)."""

    def remove(self) -> None: ...

    def install(self) -> None: ...


class Pausable(Switchable, Protocol):
    """Hooks the experiments take off the optimizer while they train, and put back only if they were on."""

    @property
    def installed(self) -> bool: ...


class HookSwitch:
    """The monitor's optimizer hooks and whether they are on the optimizer now. A loop may have taken them off
    (a framework that calls ``before_optimizer_step`` / ``after_optimizer_step`` itself): a diagnosis then must
    not put them back, or every later step runs the pre-step work twice. Every install and remove goes through
    it; installing twice registers once.

    >>> class Hooks:
    ...     def remove(self): print("off")
    ...     def install(self): print("on")
    >>> switch = HookSwitch(Hooks()); switch.install(); switch.install(); switch.installed
    on
    True
    >>> switch.remove(); switch.installed
    off
    False
    """

    def __init__(self, hooks: Switchable) -> None:
        self.hooks = hooks
        self.installed = False

    def install(self) -> None:
        if not self.installed:
            self.hooks.install()
            self.installed = True

    def remove(self) -> None:
        self.hooks.remove()
        self.installed = False


def build_diagnoser(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    grads: GradNorms,
    hooks: Pausable,
    batches: BatchLog | None,
    records: Iterable[StepRecord],
    checkpoints: CheckpointStore | None,
    check: Callable[[dict[str, Any]], str | None],
    loss_fn: LossFn | None,
    own: Mapping[int, Mapping[str, float]] | None,
    rank: int,
    world_size: int,
    channel: RankChannel,
    land: Callable[..., str | None] | None = None,
) -> CrossRank:
    """The diagnoser of a live run.

    ``batches``: the batch log (None: the runbook has no diagnose rung or there are no checkpoints, every
    diagnosis is inconclusive);
    ``records``: the recent step records (read when a diagnosis runs); ``checkpoints``: the checkpoint manager
    (``last_known_good``) and ``check`` its validation of a loaded state; ``hooks``: removed while the
    experiments train and put back afterwards if they were on (a loop may have taken them off);
    ``loss_fn``: a batch's loss (None: :func:`~stabmon.diagnose.experiments.call_model`);
    ``own``: this rank's own recorded values per step (torch.distributed; None in one process). Under
    torch.distributed every rank must call it at the same point; ``channel``: the ranks' own exchanges (the
    monitor's joint-action group); ``land``: where one process hands the state a re-run that did not reproduce
    left (:meth:`~stabmon.collect.checkpoint.landing.RerunLanding.offer`)."""
    if batches is None:
        return CrossRank(_no_batch_log, rank=rank, world_size=world_size)

    @contextlib.contextmanager
    def paused() -> Iterator[None]:
        were_on = hooks.installed  # as the loop set them: a framework may drive the step work itself
        if were_on:
            hooks.remove()
        try:
            yield
        finally:
            if were_on:
                hooks.install()

    bench = Bench(model=model, optimizer=optimizer, grads=grads, loss_fn=loss_fn or call_model, batches=batches,
                  records=records, checkpoints=checkpoints, check=check, paused=paused,
                  scaler=scaler if scaler is not None and scaler.is_enabled() else None, own=own,
                  channel=channel, rank=rank, land=land if world_size == 1 else None)

    def diagnose(**params: Any) -> Diagnosis:
        return run(bench, **params)

    return CrossRank(diagnose, rank=rank, world_size=world_size)


def _no_batch_log(**params: Any) -> Diagnosis:
    return Diagnosis.inconclusive(
        "no batch log: the runbook has no diagnose rung, or the monitor no checkpoints to diagnose from")
