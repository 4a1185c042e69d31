"""Rank consistency under ``torch.distributed``: reduce metrics, decide on rank 0, apply everywhere.

At each flush every rank reaches the same point (flushes happen at the same step counts). The stacked metric
vector is averaged across ranks with one ``all_reduce`` before the host copy (the values that are each rank's
maximum over its own inputs, the attention and output logits, take the maximum over ranks instead: a second
``all_reduce``, only in a flush that holds one), so every rank builds identical StepRecords; rank 0 alone runs
detectors and engine (and writes to the store and the notifier); the decisions it executed are broadcast with
``broadcast_object_list`` and every other rank executes the same decisions through its own executor at the
same step. Revert decisions name rank 0's intervention ids, which
:class:`RankFollower` translates to the local ones. With one process (or no process group) all of this is
skipped.

An intervention whose work every rank must do together (``diagnose`` re-runs steps, collectives included)
sends a :class:`Join` through that same broadcast first: the other ranks, waiting there for rank 0's
decisions, do the work with rank 0, then wait again for the decisions.

A peer that is gone (its process killed, its node lost) makes the next collective fail. Every collective the
monitor calls goes through :func:`collective`: the first failure is said in one line and raises
:class:`PeerLost`, which the monitor's callers take quietly (no traceback: the training's own collectives, or
the launcher, end the process); after it the monitor calls no collective in this process, each raising
:class:`PeerLost` at once instead of waiting on a peer that is not there.

>>> world()
(0, 1)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch

from stabmon.collect.failsafe import Reported
from stabmon.events import Decision, Event, InterventionRecord, Metric
from stabmon.interventions.traits import traits_of

log = logging.getLogger(__name__)

T = TypeVar("T")


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without an initialised process group."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class PeerLost(Reported, RuntimeError):
    """A collective of the monitor's failed, or one failed before in this process: another rank is gone (its
    process died, or its connection broke) or out of step, and the process group cannot be used again. Said
    once, in one line, where it first happened (:func:`collective`); ``what``: the collective that raised it."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: another rank is gone ({why})")
        self.what, self.why = what, why


@dataclass
class Peers:
    """Whether this process can still reach the other ranks: the first of the monitor's collectives that fails
    says not (``lost``: why). One per process, as the process group it describes."""

    lost: str | None = None


PEERS = Peers()
"""This process's :class:`Peers` (:func:`~stabmon.collect.cluster.restarts.init_process_group` starts it afresh)."""


def collective(what: str, call: Callable[[], T]) -> T:
    """``call()``, one of the monitor's collectives (``what`` names it in the log). When it fails, the peers are
    lost: one line says so and :class:`PeerLost` is raised, here and, without calling, from every later one.

    >>> collective("a gather", lambda: [1])
    [1]
    """
    if PEERS.lost is not None:
        raise PeerLost(what, PEERS.lost)
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - any failure leaves the ranks' collectives out of line
        PEERS.lost = (str(exc).splitlines() or [""])[0][:300] or type(exc).__name__
        log.error("stabmon: rank %d: %s failed, another rank is gone (%s: %s); stabmon calls no more "
                  "collectives in this process", world()[0], what, type(exc).__name__, PEERS.lost)
        log.debug("stabmon: %s failed", what, exc_info=True)
        raise PeerLost(what, PEERS.lost) from exc


def max_over_ranks(name: str) -> bool:
    """Is this metric each rank's maximum over its own batch, so that the run's value is the maximum over ranks
    (a mean would halve one rank's runaway attention logit on two ranks)?

    >>> [max_over_ranks(n) for n in ("attn_logit/h.0/3", "logit_max", "logit_logz", "loss", "grad_norm")]
    [True, True, True, False, False]
    """
    return name == Metric.ATTN_LOGIT or name.startswith(Metric.ATTN_LOGIT_PREFIX) or name in _MAXED


_MAXED = frozenset({Metric.LOGIT_MAX, Metric.LOGIT_LOGZ})


def reduce_across_ranks(flat: torch.Tensor, maxed: Sequence[bool] = ()) -> torch.Tensor:
    """Average a flat metric vector over all ranks (SUM then divide: gloo has no AVG); the positions where
    ``maxed`` is true take the maximum over ranks (:func:`max_over_ranks`). NaN on any rank stays."""
    _, size = world()
    if size == 1:
        return flat
    dist = torch.distributed
    out = flat.clone()
    collective("the flush's mean over ranks", partial(dist.all_reduce, out, op=dist.ReduceOp.SUM))
    out = out / size
    if len(maxed) == flat.numel() and any(maxed):  # the same names on every rank: all take this branch together
        mask = torch.tensor(list(maxed), dtype=torch.bool, device=flat.device)
        peak = flat.clone()
        collective("the flush's maximum over ranks", partial(dist.all_reduce, peak, op=dist.ReduceOp.MAX))
        out = torch.where(mask & torch.isfinite(out), peak, out)  # a NaN or inf on any rank stays in the mean
    return out


def executed_decisions(events: Sequence[Event]) -> list[tuple[Decision, str]]:
    """(decision, rank-0 intervention id) for every decision rank 0 executed in ``events``."""
    decisions = {e.id: e for e in events if isinstance(e, Decision)}
    return [
        (decisions[e.decision_id], e.id)
        for e in events
        if isinstance(e, InterventionRecord) and e.decision_id in decisions and e.ok
    ]


@dataclass(frozen=True)
class Join:
    """Rank 0 calls the other ranks into ``action`` (with ``params``) before it shares the flush's decisions."""

    action: str
    params: dict[str, Any] = field(default_factory=dict)


def broadcast(payload: Any) -> Any:
    """Rank 0's ``payload`` on every rank (:class:`PeerLost` when a peer is gone)."""
    box = [payload]
    collective("the broadcast from rank 0", partial(torch.distributed.broadcast_object_list, box, src=0))
    return box[0]


class RankFollower:
    """Executes on a non-zero rank the decisions rank 0 executed, keeping rank 0's intervention ids mapped."""

    def __init__(self) -> None:
        self.ids: dict[str, str] = {}

    def follow(self, executor: Any, executed: Sequence[tuple[Decision, str]]) -> None:
        if executor is None:
            return
        for decision, leader_id in executed:
            decision = self._translated(decision)
            record = executor.execute(decision)
            if record is None:
                continue
            self.ids[leader_id] = record.id
            if record.error is not None:  # rank 0 applied it: this rank now differs from rank 0
                log.error("stabmon: this rank could not follow rank 0's %s at step %d: %s", decision.action,
                          decision.step, record.error)

    def _translated(self, decision: Decision) -> Decision:
        """``decision`` naming this rank's records where it names rank 0's: the change a revert undoes, the
        changes a release gives back, the release a re-apply undoes."""
        traits = traits_of(decision.action)
        params = dict(decision.params)
        if traits.undoes:
            theirs = str(params.get("intervention_id"))
            params["intervention_id"] = self.ids.pop(theirs, theirs)
        elif traits.reapplies:
            theirs = str(params.get("intervention_id"))
            params["intervention_id"] = self.ids.get(theirs, theirs)
        elif traits.releases:
            params["intervention_ids"] = [self.ids.get(str(i), str(i)) for i in params.get("intervention_ids", ())]
        else:
            return decision
        return dataclasses.replace(decision, params=params)

    def state_dict(self) -> dict[str, Any]:
        return {"ids": dict(self.ids)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ids = dict(state.get("ids", {}))
