"""Interventions every rank does together: rank 0 decides, every rank follows, and the ranks agree.

The runbook engine runs on rank 0, inside a flush, while the other ranks wait in that flush's broadcast for its
decisions (:mod:`stabmon.collect.distributed`). A :class:`Joint` action (``diagnose``, ``rollback``,
``checkpoint_and_stop``, the kill switch's stop) first sends a :class:`~stabmon.collect.distributed.Join`
through that broadcast; every other rank then runs the same action at the same point on its own state, and
each rank keeps its result: when rank 0's decisions are then shared, its executor takes that result instead
of running the action a second time.

With an :class:`Agreement`, every rank's summary is then gathered on a :class:`RankChannel`: rank 0 compares
them with its own, and a rank that failed, or reached another result (restored another checkpoint step,
stopped without its checkpoint), is logged, reported (``report``: a ``rank_disagreement`` anomaly) and named
in rank 0's facts under ``rank_disagreements``. :func:`agreed_checkpoint` makes a rollback's choice a joint
one: the newest step every rank holds and every rank validates.

>>> channel = RankChannel(rank=0, world_size=1, timeout=1.0)
>>> channel.gather({"rank": 0}), channel.share("verdict")
([{'rank': 0}], 'verdict')
>>> Joint("stop", lambda **p: {"step": 3, **p}, rank=0, world_size=1)(reason="x")
{'step': 3, 'reason': 'x'}
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stabmon.checkpoints import CheckpointStore
from stabmon.collect.distributed import Join, broadcast

log = logging.getLogger(__name__)


class RankChannel:
    """Joint actions' own exchanges between ranks: a gloo group with ``timeout`` seconds (one process: none)."""

    def __init__(self, *, rank: int, world_size: int, timeout: float) -> None:
        self.rank, self.world_size = rank, world_size
        self.group: Any = None
        if world_size > 1:  # every rank builds the monitor at the same point: new_group is a collective
            self.group = torch.distributed.new_group(backend="gloo",
                                                     timeout=datetime.timedelta(seconds=timeout))

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, by rank, on every rank."""
        if self.group is None:
            return [value]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, value, group=self.group)
        return out

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self.group is None:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


@dataclass(frozen=True)
class Agreement:
    """What the ranks must agree on after a joint action: the facts in ``same`` equal rank 0's on every rank,
    and none of the facts in ``problems`` set (a problem a rank reports about itself).

    >>> rule = Agreement(same=("checkpoint_step",), problems=("checkpoint_error",))
    >>> lines = rule.disagreements([rule.summary(0, {"checkpoint_step": 20}, None),
    ...                             rule.summary(1, {"checkpoint_step": 10}, None),
    ...                             rule.summary(2, None, "NoValidCheckpointError: none")])
    >>> for line in lines: print(line)
    rank 1 reached checkpoint_step=10 where rank 0 reached checkpoint_step=20
    rank 2 failed: NoValidCheckpointError: none
    """

    same: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()

    def summary(self, rank: int, facts: Mapping[str, Any] | None, error: str | None) -> dict[str, Any]:
        """What one rank tells rank 0 about its part."""
        facts = facts or {}
        return {"rank": rank, "error": error, **{k: facts.get(k) for k in (*self.same, *self.problems)}}

    def disagreements(self, reports: Sequence[Mapping[str, Any]]) -> list[str]:
        """One line per rank that failed, reached another result than rank 0, or reported a problem."""
        lead = reports[0]
        out: list[str] = []
        for report in reports:
            rank = report["rank"]
            if report["error"] is not None:
                out.append(f"rank {rank} failed: {report['error']}")
                continue
            if rank and lead["error"] is None and any(report[k] != lead[k] for k in self.same):
                out.append(f"rank {rank} reached {_facts(report, self.same)} where rank 0 reached "
                           f"{_facts(lead, self.same)}")
            out.extend(f"rank {rank}: {report[k]}" for k in self.problems if report[k])
        return out


def _facts(report: Mapping[str, Any], keys: Sequence[str]) -> str:
    return ", ".join(f"{k}={report[k]}" for k in keys)


class Joint:
    """``run(**params)`` on every rank together, called in by rank 0; alone in one process. See the module
    docstring. ``agreement`` (with ``channel``): the check after the run; ``report(action, lines)`` hears of the
    ranks that disagree. ``last``: the latest result on this rank."""

    def __init__(self, action: str, run: Callable[..., Any], *, rank: int, world_size: int,
                 send: Callable[[Any], Any] = broadcast, channel: RankChannel | None = None,
                 agreement: Agreement | None = None,
                 report: Callable[[str, list[str]], None] | None = None) -> None:
        self.action, self.run, self.rank, self.world_size, self.send = action, run, rank, world_size, send
        self.channel, self.agreement, self.report = channel, agreement, report
        self.held: Any = None  # the result this rank was called in for (or its failure)
        self.last: Any = None

    def __call__(self, **params: Any) -> Any:
        if self.world_size > 1 and self.rank == 0:
            self.send(Join(self.action, dict(params)))
        elif self.world_size > 1:
            held, self.held = self.held, None
            if isinstance(held, BaseException):
                raise held
            return held if held is not None else self.absent()
        return self._run(params)

    def absent(self) -> Any:
        """A rank other than 0 asked for the result of a run rank 0 did not call it into."""
        raise RuntimeError(f"rank {self.rank} was not called into {self.action} by rank 0")

    def join(self, params: dict[str, Any]) -> None:
        """A rank other than 0, called in by rank 0: run with it and keep the result (or the failure)."""
        try:
            self.held = self._run(params)
        except Exception as exc:  # noqa: BLE001 - raised again when the executor asks for the result
            log.error("stabmon: rank %d, called into %s by rank 0, failed: %s", self.rank, self.action, _line(exc))
            self.held = exc

    def _run(self, params: dict[str, Any]) -> Any:
        if self.agreement is None or self.channel is None or self.world_size == 1:
            self.last = self.run(**params)
            return self.last
        facts: dict[str, Any] | None = None
        error: Exception | None = None
        try:
            facts = self.run(**params)
        except Exception as exc:  # noqa: BLE001 - every rank must still reach the exchange below
            error = exc
        reports = self.channel.gather(self.agreement.summary(self.rank, facts, _line(error)))
        if self.rank == 0:
            facts = self._check(reports, facts)
        if error is not None:
            raise error
        self.last = facts
        return facts or {}

    def _check(self, reports: list[dict[str, Any]], facts: dict[str, Any] | None) -> dict[str, Any] | None:
        assert self.agreement is not None
        lines = self.agreement.disagreements(reports)
        if not lines:
            return facts
        log.error("stabmon: %s: the ranks do not agree: %s", self.action, "; ".join(lines))
        if self.report is not None:
            self.report(self.action, lines)
        return None if facts is None else {**facts, "rank_disagreements": lines}


def _line(error: BaseException | None) -> str | None:
    if error is None:
        return None
    first = (str(error).splitlines() or [""])[0]
    return f"{type(error).__name__}: {first}"


def agreed_checkpoint(manager: CheckpointStore, before_step: int, *,
                      check: Callable[[dict[str, Any]], str | None] | None,
                      gather: Callable[[Any], list[Any]]) -> tuple[Any, dict[str, Any]]:
    """The newest checkpoint at or before ``before_step`` that every rank holds and every rank validates, with
    this rank's loaded state (every rank calls it together). Raises
    :class:`~stabmon.checkpoints.NoValidCheckpointError` on every rank when there is none."""
    from stabmon.checkpoints import NoValidCheckpointError

    mine: dict[int, Any] = {}
    for info in manager.candidates(before_step):  # newest first: the newest timeline at each step
        mine.setdefault(info.step, info)
    steps = set(mine)
    for theirs in gather(sorted(mine)):
        steps &= set(theirs)
    refused: dict[str, str] = {}
    for step in sorted(steps, reverse=True):
        state, reason = manager.validate(mine[step], check)
        if reason is not None:
            log.warning("stabmon: checkpoint %s (step %d) refused: %s", mine[step].path, step, reason)
        reasons = gather(reason)
        if all(r is None for r in reasons):
            assert state is not None
            return mine[step], state
        refused |= {f"step {step} on rank {r}": str(why) for r, why in enumerate(reasons) if why is not None}
    raise NoValidCheckpointError(
        f"no valid checkpoint at or before step {before_step} on every rank in {manager.directory}",
        refused,
    )
