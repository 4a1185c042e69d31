"""Where a run's wall time went: productive steps, and badput by cause (the goodput ledger).

Large-run teams judge reliability by goodput, the share of wall time that trained the model the run kept
(Llama 3 405B: > 90% through 466 interruptions; Google's ml-goodput-measurement splits the rest by cause).
stabmon stores every step with its end time and duration, every rollback, hang and checkpoint, and the first
step of each process (``segment_start``), so the ledger is computed from the store alone.

The run's wall time runs from its first process's start to its end (the last step's end while it runs). It is
cut into the stored steps (each ``[end - step_time, end]``) and the gaps between them, and every second goes to
exactly one cause, so the causes add up to the wall time. Durations come from the monitor's monotonic clock
(``step_time``, ``monitor_time`` between the steps of one process, ``startup_time``), so a step of the wall clock
(NTP, a resumed VM) in the middle of a process changes no figure; only what lies between two processes (a
restart) and the run's closing are read from the wall clock's times, and never count below 0:

=================  ===============================================================================================
``productive``     steps the run kept (minus what the other step causes take)
``rollback``       steps a rollback abandoned (they were trained again), and the restore between them
``skipped_update`` steps whose update was discarded (stabmon's skip guard, or an fp16 overflow)
``checkpoint``     the monitor's checkpoint saves (``checkpoint_time`` on the step after each)
``outside_steps``  the loop's own work between steps: evaluation, data loading, logging (``outside_time``)
``hang``           from the last step before a hang until the watchdog fired (the hang anomaly's wait)
``restart``        the rest of each gap between two processes (exit, scheduler, start-up of the next) and
                   the steps a restart trained again
``startup``        from the first process's start to its first step (model build, the initial checkpoint
                   excepted)
``monitor``        the rest of the gaps between steps (the monitor's flushes) and closing after the last step
=================  ===============================================================================================

Skipped batches cost data, not time (the loader skips them during the rollback's restore); the ledger counts
them under ``rollback``'s ``batches``.

>>> from stabmon.events import StepRecord
>>> steps = [Timed(seq=s, record=StepRecord(step=s, metrics={"step_time": 1.0}, time=float(s + 1)))
...          for s in range(10)]
>>> ledger = compute_ledger(LedgerInput(run_id="r", steps=steps))
>>> ledger.wall_seconds, ledger.cause("productive").seconds, ledger.goodput
(10.0, 10.0, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stabmon.events import Anomaly, InterventionRecord, Metric, StepRecord
from stabmon.interventions.traits import recorded_traits

CAUSES: dict[str, str] = {
    "productive": "steps the run kept",
    "rollback": "steps a rollback abandoned, and the restores",
    "skipped_update": "steps whose update was discarded (skip guard, fp16 overflow)",
    "checkpoint": "the monitor's checkpoint saves",
    "outside_steps": "the loop's work between steps (evaluation, data loading)",
    "hang": "hung until the watchdog fired",
    "restart": "between processes, and steps a restart trained again",
    "startup": "first process start to its first step",
    "monitor": "the monitor's flushes between steps, closing",
}
"""Every cause of the ledger, in the order it is printed, with a short description."""


@dataclass(frozen=True)
class Timed:
    """One stored step record and its place in the run's record order."""

    seq: int
    record: StepRecord


@dataclass(frozen=True)
class LedgerInput:
    """What the ledger reads from the store; ``events`` are ``(seq, event)`` in record order."""

    run_id: str
    steps: Sequence[Timed]
    events: Sequence[tuple[int, Any]] = ()
    ended_at: float | None = None
    skipped_batches: int = 0


@dataclass(frozen=True)
class Cause:
    name: str
    seconds: float
    steps: int
    percent: float
    description: str


@dataclass(frozen=True)
class Ledger:
    """The run's wall time split by cause; :attr:`goodput` is the productive share."""

    run_id: str
    wall_seconds: float
    causes: tuple[Cause, ...]
    segments: int
    skipped_batches: int
    stragglers: dict[int, float] = field(default_factory=dict)
    """Fleet runs: seconds the median rank waited on each rank while it was the slowest (an estimate from
    ``fleet/step_time`` x (``fleet/straggler_ratio`` - 1)); part of ``productive``, shown per rank."""

    def cause(self, name: str) -> Cause:
        return next(c for c in self.causes if c.name == name)

    @property
    def goodput(self) -> float:
        return self.cause("productive").seconds / self.wall_seconds if self.wall_seconds > 0 else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "wall_seconds": self.wall_seconds,
            "goodput": self.goodput,
            "segments": self.segments,
            "skipped_batches": self.skipped_batches,
            "causes": {c.name: {"seconds": c.seconds, "steps": c.steps, "percent": c.percent} for c in self.causes},
            "stragglers": {str(rank): s for rank, s in sorted(self.stragglers.items())},
        }


class _Tally:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(CAUSES, 0.0)
        self.steps = dict.fromkeys(CAUSES, 0)

    def add(self, cause: str, seconds: float, steps: int = 0) -> float:
        """Book ``seconds`` (at least 0) on ``cause``; returns what was booked."""
        seconds = max(0.0, seconds)
        self.seconds[cause] += seconds
        self.steps[cause] += steps
        return seconds


def _value(r: StepRecord, name: str) -> float:
    v = r.get(name)
    return v if v is not None and math.isfinite(v) else 0.0


def _rewinds(data: LedgerInput) -> dict[int, str]:
    """seq of each abandoned step record -> what rewound it (``rollback`` or ``restart``)."""
    rollbacks = sorted(seq for seq, ev in data.events if _is_rollback(ev))
    out = _abandoned_in_place(data)
    later_min = math.inf
    later_cause = "restart"
    ordered = sorted(data.steps, key=lambda t: t.seq)
    for i in range(len(ordered) - 1, -1, -1):
        t = ordered[i]
        if t.record.step >= later_min:
            out.setdefault(t.seq, later_cause)
        nxt = ordered[i - 1].seq if i > 0 else -math.inf
        if t.record.step < later_min:
            later_min = t.record.step
            # what opened the timeline this record starts: a rollback between it and the record before it
            later_cause = "rollback" if any(nxt < s < t.seq for s in rollbacks) else "restart"
    return out


def _abandoned_in_place(data: LedgerInput) -> dict[int, str]:
    """The step records abandoned by a rollback after which a framework's step count went on (HF Trainer,
    Lightning): the training state came back from its checkpoint's step while the count did not, so the steps
    from that checkpoint to the rollback, recorded before it, were trained for nothing."""
    out: dict[int, str] = {}
    for seq, ev in data.events:
        if not _is_rollback(ev):
            continue
        checkpoint, restored = ev.after.get("checkpoint_step"), ev.after.get("restored_step")
        if not (isinstance(checkpoint, int) and isinstance(restored, int) and restored > checkpoint):
            continue  # the count went back with the state: the timelines say what was abandoned
        for t in data.steps:
            if t.seq < seq and checkpoint <= t.record.step < restored:
                out[t.seq] = "rollback"
    return out


def _is_rollback(ev: Any) -> bool:
    return (isinstance(ev, InterventionRecord) and not ev.reverted and ev.ok
            and recorded_traits(ev.action).rewinds_step)


def _hang_wait(data: LedgerInput, after: int, before: float) -> float:
    """Seconds a hang anomaly stored between record order ``after`` and ``before`` waited (0: none)."""
    return max(
        (ev.score for seq, ev in data.events
         if after < seq < before and isinstance(ev, Anomaly) and ev.kind == "hang" and math.isfinite(ev.score)),
        default=0.0,
    )


def _book_step(tally: _Tally, t: Timed, rewound: dict[int, str]) -> None:
    r = t.record
    seconds = _value(r, Metric.STEP_TIME)
    outside = tally.add("outside_steps", min(_value(r, Metric.OUTSIDE_TIME), seconds))
    rest = seconds - outside
    if t.seq in rewound:
        tally.add(rewound[t.seq], rest, 1)
    elif _value(r, Metric.SKIPPED) or _value(r, Metric.OVERFLOW):
        tally.add("skipped_update", rest, 1)
    else:
        tally.add("productive", rest, 1)


def _book_gap(
    tally: _Tally, data: LedgerInput, prev: Timed, t: Timed, rollbacks: Sequence[int], rewound: dict[int, str],
    *, monotonic: bool,
) -> None:
    """The time between ``prev``'s end and ``t``'s start: in one process, what the monitor measured on its
    monotonic clock (``monitor_time``) when it did; between processes (and for runs recorded before), the
    difference of the wall clock's times, never below 0."""
    r = t.record
    if monotonic and r.get(Metric.SEGMENT_START) is None:
        gap = _value(r, Metric.MONITOR_TIME)
    else:
        gap = (r.time or 0.0) - _value(r, Metric.STEP_TIME) - (prev.record.time or 0.0)
    gap -= tally.add("checkpoint", min(_value(r, Metric.CHECKPOINT_TIME), max(gap, 0.0)))
    if t.seq in rewound:  # the flush before a step a later rewind abandoned was spent on it too
        tally.add(rewound[t.seq], gap)
    elif r.get(Metric.SEGMENT_START) is not None:
        gap -= tally.add("hang", min(_hang_wait(data, prev.seq, t.seq), max(gap, 0.0)))
        tally.add("restart", gap)
    elif any(prev.seq < s < t.seq for s in rollbacks):
        tally.add("rollback", gap)
    else:
        tally.add("monitor", gap)


def _stragglers(steps: Sequence[Timed]) -> dict[int, float]:
    out: dict[int, float] = {}
    for t in steps:
        r = t.record
        rank, ratio, median = r.get(Metric.STRAGGLER_RANK), r.get(Metric.STRAGGLER_RATIO), r.get(Metric.FLEET_STEP_TIME)
        if rank is None or ratio is None or median is None or not (math.isfinite(ratio) and math.isfinite(median)):
            continue
        out[int(rank)] = out.get(int(rank), 0.0) + max(0.0, ratio - 1.0) * median
    return out


def compute_ledger(data: LedgerInput) -> Ledger:
    """The ledger of a run's stored steps and events (see the module docstring)."""
    steps = sorted((t for t in data.steps if t.record.time is not None), key=lambda t: t.seq)
    tally = _Tally()
    if not steps:
        return Ledger(data.run_id, 0.0, _causes(tally, 0.0), 0, data.skipped_batches)
    rewound = _rewinds(LedgerInput(data.run_id, steps, data.events))
    rollbacks = [seq for seq, ev in data.events if _is_rollback(ev)]
    # a run whose monitor timed its processes' starts and its own work on a monotonic clock: a step of the wall
    # clock (NTP, a VM resumed) inside a process changes no figure
    monotonic = any(t.record.get(Metric.STARTUP_TIME) is not None for t in steps)
    first = steps[0].record
    begin = (first.time or 0.0) - _value(first, Metric.STEP_TIME)
    started = first.get(Metric.SEGMENT_START)
    if monotonic and first.get(Metric.STARTUP_TIME) is not None:
        startup = _value(first, Metric.STARTUP_TIME)
    else:
        startup = begin - started if started is not None and math.isfinite(started) else 0.0
    if startup > 0:
        startup -= tally.add("checkpoint", min(_value(first, Metric.CHECKPOINT_TIME), startup))
        tally.add("startup", startup)
    _book_step(tally, steps[0], rewound)
    for prev, t in zip(steps, steps[1:], strict=False):
        _book_gap(tally, data, prev, t, rollbacks, rewound, monotonic=monotonic)
        _book_step(tally, t, rewound)
    end = steps[-1].record.time or 0.0
    hung = _hang_wait(data, steps[-1].seq, math.inf)  # the last process hung: it waited at least this long
    ended = max(data.ended_at if data.ended_at is not None else end, end + hung)
    if ended > end:
        tally.add("monitor", ended - end - tally.add("hang", hung))  # closing: the last flush, the store
    segments = sum(1 for t in steps if t.record.get(Metric.SEGMENT_START) is not None)
    wall = sum(tally.seconds.values())  # every second booked once: the causes add up to the wall time
    return Ledger(data.run_id, wall, _causes(tally, wall), max(segments, 1), data.skipped_batches,
                  _stragglers(steps))


def _causes(tally: _Tally, wall: float) -> tuple[Cause, ...]:
    return tuple(
        Cause(name, tally.seconds[name], tally.steps[name],
              100.0 * tally.seconds[name] / wall if wall > 0 else 0.0, description)
        for name, description in CAUSES.items()
    )


def load_input(*, session: Any, run_id: str) -> LedgerInput:
    """What :func:`compute_ledger` needs of a stored run."""
    from stabmon.store import repo

    return LedgerInput(
        run_id=run_id,
        steps=[Timed(seq, r) for seq, r in repo.load_sequenced_steps(session=session, run_id=run_id)],
        events=repo.load_sequenced_events(session=session, run_id=run_id),
        ended_at=repo.run_ended_at(session=session, run_id=run_id),
        skipped_batches=len(repo.skipped_batches(session=session, run_id=run_id)),
    )


def format_ledger(ledger: Ledger) -> list[str]:
    """The ledger as lines for a terminal."""
    out = [f"run {ledger.run_id}: wall {ledger.wall_seconds:.1f} s, goodput {100 * ledger.goodput:.1f}%"
           f" ({ledger.segments} process(es), {ledger.skipped_batches} batch(es) skipped)",
           f"  {'cause':<15} {'seconds':>10} {'steps':>7} {'percent':>8}"]
    for c in ledger.causes:
        out.append(f"  {c.name:<15} {c.seconds:>10.2f} {c.steps:>7} {c.percent:>7.2f}%  {c.description}")
    if ledger.stragglers:
        out.append("  stragglers (seconds the median rank waited on each rank, part of productive):")
        out += [f"    rank {rank}: {s:.2f} s" for rank, s in sorted(ledger.stragglers.items())]
    return out
