"""Interventions every rank does together: rank 0 decides, every rank follows, and the ranks agree.

The runbook engine runs on rank 0, inside a flush, while the other ranks wait in that flush's broadcast for its
decisions (:mod:`stabmon.collect.cluster.distributed`). A :class:`Joint` action (``diagnose``, ``rollback``,
``checkpoint_and_stop``, the kill switch's stop) first sends a :class:`~stabmon.collect.cluster.distributed.Join`
through that broadcast; every other rank then runs the same action at the same point on its own state, and
each rank keeps its result: when rank 0's decisions are then shared, its executor takes that result instead
of running the action a second time.

With an :class:`Agreement`, every rank's summary is then gathered on a :class:`RankChannel`: rank 0 compares
them with its own, and a rank that failed, or reached another result (restored another checkpoint step,
stopped without its checkpoint), is logged, reported (``report``: a ``rank_disagreement`` anomaly) and named
in rank 0's facts under ``rank_disagreements``. :func:`agreed_checkpoint` makes a rollback's choice a joint
one: the newest step every rank holds and every rank validates; :func:`restore_agreed` then checks where each
rank landed: a step some rank did not restore (another step in its file, a state it could not apply) is refused
on every rank, and the ranks go back together, or, with no step left, each puts its state back and the rollback
fails on every rank alike (:class:`RankDisagreementError`), never with the ranks at two steps.

>>> channel = RankChannel(rank=0, world_size=1, timeout=1.0)
>>> channel.gather({"rank": 0}), channel.share("verdict")
([{'rank': 0}], 'verdict')
>>> Joint("stop", lambda **p: {"step": 3, **p}, rank=0, world_size=1)(reason="x")
{'step': 3, 'reason': 'x'}
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from stabmon.checkpoints import CheckpointStore, NoValidCheckpointError
from stabmon.collect.cluster.distributed import Join, broadcast, collective

log = logging.getLogger(__name__)


class RankChannel:
    """Joint actions' own exchanges between ranks: a gloo group with ``timeout`` seconds (one process: none). An
    exchange with a rank that is gone raises :class:`~stabmon.collect.cluster.distributed.PeerLost`."""

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
        collective("the joint action's gather", partial(torch.distributed.all_gather_object, out, value,
                                                        group=self.group))
        return out

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self.group is None:
            return value
        box = [value]
        collective("the joint action's broadcast", partial(torch.distributed.broadcast_object_list, box, src=0,
                                                           group=self.group))
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


class RankDisagreementError(RuntimeError):
    """The ranks could not reach one result of a joint action, and every rank refused it together (each put back
    what it had); ``lines`` names what each rank reached."""

    def __init__(self, message: str, lines: Sequence[str]) -> None:
        super().__init__(f"{message}: {'; '.join(lines)}")
        self.lines = list(lines)


LANDING = "landing_refused"
"""The fact in which a rank says that its checkpoint of an agreed step restored another step, or could not be
restored (:func:`restore_agreed`)."""


def agreed_checkpoint(manager: CheckpointStore, before_step: int | None, *,
                      check: Callable[[dict[str, Any]], str | None] | None,
                      gather: Callable[[Any], list[Any]],
                      refused: Collection[int] = ()) -> tuple[Any, dict[str, Any]]:
    """The newest checkpoint at or before ``before_step`` (None: any) that every rank holds and every rank
    validates, with this rank's loaded state (every rank calls it together; ``refused``: steps not to choose). Raises
    :class:`~stabmon.checkpoints.NoValidCheckpointError` on every rank when there is none. A rank that cannot
    list or check its checkpoints offers none: every rank still makes the same exchanges."""
    mine: dict[int, Any] = {}
    for info in _candidates(manager, before_step):  # newest first: the newest timeline at each step
        if info.step not in refused:
            mine.setdefault(info.step, info)
    steps = set(mine)
    for theirs in gather(sorted(mine)):
        steps &= set(theirs)
    reasons: dict[str, str] = {}
    for step in sorted(steps, reverse=True):
        state, reason = _validate(manager, mine[step], check)
        if reason is not None:
            log.warning("stabmon: checkpoint %s (step %d) refused: %s", mine[step].path, step, reason)
        answers = gather(reason)
        if all(r is None for r in answers):
            assert state is not None
            return mine[step], state
        reasons |= {f"step {step} on rank {r}": str(why) for r, why in enumerate(answers) if why is not None}
    where = "" if before_step is None else f" at or before step {before_step}"
    raise NoValidCheckpointError(f"no valid checkpoint{where} on every rank in {manager.directory}", reasons)


def _candidates(manager: CheckpointStore, before_step: int | None) -> list[Any]:
    try:
        return manager.candidates(before_step)
    except Exception as exc:  # noqa: BLE001 - this rank then offers no checkpoint; the others must still hear so
        log.error("stabmon: could not list the checkpoints in %s: %s", manager.directory, _line(exc))
        return []


def _validate(manager: CheckpointStore, info: Any, check: Callable[[dict[str, Any]], str | None] | None
              ) -> tuple[dict[str, Any] | None, str | None]:
    try:
        return manager.validate(info, check)
    except Exception as exc:  # noqa: BLE001 - a refusal like any other; every rank must reach the exchange
        return None, f"could not be checked: {_line(exc)}"


def restore_agreed(manager: CheckpointStore, before_step: int, *, rank: int,
                   check: Callable[[dict[str, Any]], str | None] | None,
                   gather: Callable[[Any], list[Any]], restore: Callable[[dict[str, Any]], int],
                   keep: Callable[[], Callable[[], Any]]) -> tuple[Any, dict[str, Any]]:
    """Every rank together: restore the newest checkpoint at or before ``before_step`` that every rank holds,
    validates (:func:`agreed_checkpoint`) and lands on. ``restore(state)`` applies a state on this rank and
    returns the step it restored; the ranks then compare: a step on which a rank restored another step than the
    others, or could not restore at all, is refused on every rank, and the ranks go back together to the next
    older step they all hold. When none is left, every rank puts back the state it had before (``keep()``, taken
    before the first restore, returns what does that) and raises :class:`RankDisagreementError`; so does a rank
    whose restore is followed by any other failure (a peer gone), before raising it.

    Returns the checkpoint and this rank's fact to report (``{LANDING: ...}`` when a step was refused for what
    this rank restored, else empty).

    >>> import tempfile
    >>> from stabmon.checkpoints import CheckpointManager
    >>> m = CheckpointManager(tempfile.mkdtemp())
    >>> _ = m.save({"step": 5}, step=5); _ = m.save({"step": 10}, step=10)
    >>> def gather(value):  # rank 1 agrees on every exchange, but its file of step 10 holds step 5
    ...     return [value, (5, None) if value == (10, None) else value]
    >>> now = {"step": 12}
    >>> def restore(state): now.update(state); return now["step"]
    >>> def keep(): saved = dict(now); return lambda: now.update(saved)
    >>> info, found = restore_agreed(m, 11, rank=0, check=None, gather=gather, restore=restore, keep=keep)
    >>> info.step, found, now
    (5, {}, {'step': 5})
    """
    kept: list[Callable[[], Any]] = []  # what puts this rank's state back, once a restore may have touched it

    def keep_once() -> None:
        if not kept:
            kept.append(keep())

    try:
        return _land_together(manager, before_step, rank=rank, check=check, gather=gather, restore=restore,
                              keep=keep_once)
    except Exception:  # no step left, or a peer gone: the state this rank had, whole, and the failure raised
        if kept:
            _put_back(kept[0])
        raise


def _land_together(manager: CheckpointStore, before_step: int, *, rank: int,
                   check: Callable[[dict[str, Any]], str | None] | None,
                   gather: Callable[[Any], list[Any]], restore: Callable[[dict[str, Any]], int],
                   keep: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """:func:`restore_agreed`'s rounds; ``keep()`` before each restore."""
    refused: dict[int, list[str]] = {}
    mine: list[str] = []
    while True:
        try:
            info, state = agreed_checkpoint(manager, before_step, check=check, gather=gather, refused=refused)
        except NoValidCheckpointError:
            if not refused:  # no round restored anything: every rank keeps its state as it is
                raise
            said = [line for step in refused for line in refused[step]]
            raise RankDisagreementError(f"no checkpoint at or before step {before_step} that every rank "
                                        "restores", said) from None
        keep()
        lines = _landings(info.step, gather(_land(restore, state, info.step)))
        if not lines:
            return info, ({LANDING: "; ".join(mine)} if mine else {})
        log.warning("stabmon: rollback: checkpoint step %d refused on every rank: %s", info.step,
                    "; ".join(f"rank {r}: {line}" for r, line in lines.items()))
        refused[info.step] = [f"rank {r}: {line}" for r, line in lines.items()]
        if rank in lines:
            mine.append(f"{lines[rank]}; refused on every rank")


def _land(restore: Callable[[dict[str, Any]], int], state: dict[str, Any], step: int
          ) -> tuple[int | None, str | None]:
    """(the step this rank restored, None), or (None, why it could not restore)."""
    try:
        return int(restore(state)), None
    except Exception as exc:  # noqa: BLE001 - every rank must reach the comparison
        log.error("stabmon: the checkpoint of step %d could not be restored on this rank: %s", step, _line(exc))
        return None, _line(exc)


def _landings(step: int, reports: Sequence[tuple[int | None, str | None]]) -> dict[int, str]:
    """By rank, what keeps ``step`` from being the rollback's landing: a rank that could not restore its
    checkpoint of ``step``, or whose checkpoint restored another step than the others'. Empty: every rank
    restored the same step (the one its checkpoint was registered at, or another on every rank alike).

    >>> _landings(10, [(10, None), (5, None)]), _landings(10, [(11, None), (11, None)])
    ({1: 'its checkpoint of step 10 restored step 5'}, {})
    >>> _landings(10, [(10, None), (None, "OSError: torn")])
    {1: 'its checkpoint of step 10 could not be restored (OSError: torn)'}
    """
    out = {r: f"its checkpoint of step {step} could not be restored ({error})"
           for r, (_, error) in enumerate(reports) if error is not None}
    landed = {at for at, error in reports if error is None}
    if len(landed) > 1:
        out |= {r: f"its checkpoint of step {step} restored step {at}"
                for r, (at, error) in enumerate(reports) if error is None and at != step}
        if not out:  # every rank restored another step than registered, each its own: none is right
            out = {r: f"its checkpoint of step {step} restored step {at}" for r, (at, _) in enumerate(reports)}
    return dict(sorted(out.items()))


def _put_back(undo: Callable[[], Any]) -> None:
    try:
        undo()
    except Exception as exc:  # noqa: BLE001 - said loudly; the rollback's failure is raised either way
        log.error("stabmon: could not put back the state this rank had before the rollback: %s", _line(exc))
