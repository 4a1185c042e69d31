"""Replay a recorded run through the same detectors and runbook engine as live, interventions simulated.

:func:`replay` feeds StepRecords one at a time into a :class:`stabmon.pipeline.Pipeline` built by the same
factory as the live monitor's (:func:`stabmon.factory.build_pipeline`: :class:`stabmon.detect.DetectorSuite`,
:class:`stabmon.runbook.Engine`, :class:`stabmon.interventions.Executor`); only the executor's target differs:
a :class:`~stabmon.replay.simulate.Simulation`. Any object with the pipeline protocols can be passed
instead (``pipeline=``), which is how tests and :mod:`stabmon.replay.eval` run it.

Replay is deterministic: the same records through freshly built objects give the same events, apart from the
random event ids; :func:`canonical` replaces those by ordinals so two replays compare equal.

>>> from stabmon.events import Anomaly, Severity, StepRecord
>>> class Above:  # a stand-in detector suite: flags loss > 5
...     def update(self, r):
...         v = r.get("loss")
...         return [Anomaly("spike", "loss", r.step, v, Severity.ERROR, "above")] if v and v > 5 else []
...     def enter_grace(self, steps=None): pass
...     def state_dict(self): return {}
...     def load_state_dict(self, s): pass
>>> from stabmon.pipeline import LadderEngine, Pipeline, RunbookEngine, calls_for_closer_flushes
>>> records = [StepRecord(s, {"loss": v}) for s, v in enumerate([2.0, 9.0, 2.1])]
>>> res = replay(records, pipeline=Pipeline(Above()))
>>> [(a.step, a.kind) for a in res.anomalies], res.steps, res.samples
([(1, 'spike')], 3, 3)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stabmon.collect.signals.jump import LossJump
from stabmon.events import (
    Anomaly,
    Decision,
    DecisionStatus,
    Event,
    InterventionRecord,
    Metric,
    Outcome,
    StepRecord,
    to_dict,
)
from stabmon.factory import build_pipeline
from stabmon.interventions.executor import Executor
from stabmon.pipeline import LadderEngine, Pipeline, RunbookEngine, calls_for_closer_flushes
from stabmon.replay.simulate import Simulation

Progress = Callable[[int], None]


@dataclass
class ReplayResult:
    """Everything a replay produced, in causal order, and what the simulated target went through."""

    events: list[Event] = field(default_factory=list)
    steps: int = 0
    samples: int = 0  # metric values fed (sum over records of len(metrics))
    target: Simulation | None = None

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    @property
    def anomalies(self) -> list[Anomaly]:
        return self.of(Anomaly)

    @property
    def decisions(self) -> list[Decision]:
        return self.of(Decision)

    @property
    def interventions(self) -> list[InterventionRecord]:
        return self.of(InterventionRecord)

    @property
    def outcomes(self) -> list[Outcome]:
        return self.of(Outcome)

    def summary(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "samples": self.samples,
            "anomalies": len(self.anomalies),
            "decisions": len(self.decisions),
            "interventions": len(self.interventions),
            "outcomes": len(self.outcomes),
            "target": self.target.summary() if self.target is not None else None,
        }


def simulated_pipeline(
    *,
    runbook: Any = None,
    detector_config: dict[str, Any] | None = None,
    overrides: Sequence[str] = (),
    target: Simulation | None = None,
    mode: str | None = None,
    live_config: Mapping[str, Any] | None = None,
) -> tuple[Pipeline, Simulation]:
    """The pipeline :func:`stabmon.factory.build_pipeline` builds for the live monitor, its executor acting on
    a simulated ``target`` (default: a fresh :class:`Simulation`), and that target. ``mode`` None keeps the
    runbook's. ``live_config``: the stored config of the live run replayed: the rungs its loop could not act on
    are dropped here as they were there, when this is the runbook it ran
    (:func:`stabmon.runbook.fit.dropped_from_config`)."""
    from stabmon.runbook.fit import dropped_from_config

    target = target or Simulation()
    pipeline = build_pipeline(
        target.handle, runbook=runbook, detectors=detector_config, overrides=overrides, mode=mode, simulated=True
    )
    engine = pipeline.engine
    if live_config and isinstance(engine, LadderEngine) and isinstance(engine, RunbookEngine):
        engine.drop_rungs(dropped_from_config(live_config, runbook=engine.runbook.name))
    return pipeline, target


def replay(
    records: Iterable[StepRecord],
    *,
    pipeline: Pipeline | None = None,
    target: Simulation | None = None,
    runbook: Any = None,
    overrides: Sequence[str] = (),
    detector_config: dict[str, Any] | None = None,
    approve: bool = False,
    restarts: Sequence[int] = (),
    grace_on_restart: bool = False,
    flush_every: int = 1,
    watch: tuple[int, int] = (0, 1),
    alarm: tuple[bool, float | None] = (False, None),
    progress: Progress | None = None,
    progress_every: int = 1000,
) -> ReplayResult:
    """Run ``records`` (in step order) through the pipeline; see the module docstring.

    ``approve``: answer every proposal "yes" at once (as if a human approved it), so the simulation shows what
    an apply-mode run would have done. ``restarts``: steps at which the recorded run resumed from a
    checkpoint; with ``grace_on_restart`` the detectors re-enter their grace period there, as a freshly
    resumed monitor would when its detector state was not restored (the default carries the detector history
    across, as a monitor restored from its own ``state_dict`` does). ``progress(n)`` is called with the number
    of records processed since the last call.
    ``flush_every``: the live monitor's flush cadence (``MonitorConfig.flush_every``); interventions take effect
    after each block of that many records, as they did live (this matters to replay a live run exactly).
    ``watch``: the live monitor's closer flushes (``MonitorConfig.watch``: steps, flush_every): after a block with
    trouble in it, or with an incident open, the blocks are that many records for that many steps, as they were
    live (``(0, 1)``: never).
    ``alarm``: the live monitor's loss alarm (``MonitorConfig.flush_on_nonfinite``, ``flush_on_rise``): a block
    ends at a record whose loss it rings on (NaN or inf, or a jump over its running mean), as the live flush did
    (``(False, None)``: never). The live alarm's own rule judges the recorded losses
    (:class:`~stabmon.collect.signals.jump.LossJump`).
    """
    if flush_every < 1:
        raise ValueError(f"replay.flush_every must be >= 1, got {flush_every}")
    if watch[0] < 0 or watch[1] < 1:
        raise ValueError(f"replay.watch must be (steps >= 0, flush_every >= 1), got {watch}")
    if pipeline is None:
        pipeline, target = simulated_pipeline(
            runbook=runbook, detector_config=detector_config, overrides=overrides, target=target
        )
    executor = pipeline.executor
    if target is None:
        found = Simulation.of(executor.target) if isinstance(executor, Executor) else None
        target = found if found is not None else Simulation()
    result = ReplayResult(target=target)
    restart_set = set(restarts) if grace_on_restart else set()
    pending = steps = samples = 0
    events = result.events
    process = pipeline.process
    begin_block = target.begin_block
    closer = _Closer(*watch, pipeline=pipeline) if watch[0] and flush_every > 1 else None
    rings = LossJump(alarm[1]) if alarm[0] and flush_every > 1 else None
    # one record per flush, the common case: 1-tuples made in C (no generator to resume)
    blocks = zip(records) if flush_every == 1 else _blocks(records, flush_every, closer, rings)
    for block in blocks:
        begin_block(block)
        first = len(events)
        for record in block:
            if restart_set and record.step in restart_set:
                pipeline.detectors.enter_grace()
            produced = process(record)
            if produced:
                if approve:
                    produced = _approve(pipeline, produced, target.step)
                events.extend(produced)
            samples += len(record.metrics)
            if progress is not None:
                pending += 1
                if pending >= progress_every:
                    progress(pending)
                    pending = 0
            steps += 1
        if closer is not None:
            closer.flushed(block[-1].step, events[first:])
    result.steps, result.samples = steps, samples
    if progress is not None and pending:
        progress(pending)
    return result


class _Closer:
    """The live monitor's closer flushes in a replay: which records make a block (see :func:`replay`'s ``watch``).
    Live, the decision is taken after each flush, from its events and the engine (the rule is
    :func:`~stabmon.pipeline.calls_for_closer_flushes`, shared); here, after each block."""

    def __init__(self, steps: int, every: int, *, pipeline: Pipeline) -> None:
        self.steps, self.every, self.pipeline = steps, every, pipeline
        self.until = 0  # the step before which blocks are ``every`` records (the live monitor's ``_watch_until``)

    def flushed(self, last_step: int, events: Sequence[Event]) -> None:
        if calls_for_closer_flushes(events, self.pipeline.engine):
            self.until = last_step + 1 + self.steps


def _blocks(records: Iterable[StepRecord], size: int, closer: _Closer | None,
            alarm: LossJump | None) -> Iterator[list[StepRecord]]:
    """The live monitor's flushes as blocks: ``size`` records, ``closer.every`` in a watch window, and a block
    ends at a record the loss ``alarm`` rings on (the live monitor's ``end_step``)."""
    block: list[StepRecord] = []
    for record in records:
        block.append(record)
        rang = alarm is not None and (loss := record.get(Metric.LOSS)) is not None and alarm.judge(loss)
        watching = closer is not None and record.step + 1 < closer.until and len(block) >= closer.every
        if len(block) >= size or watching or rang:
            yield block  # (the caller processes it and calls flushed() before the next is built)
            block = []
    if block:
        yield block


def _approve(pipeline: Pipeline, produced: list[Event], step: int) -> list[Event]:
    out: list[Event] = []
    queue = list(produced)
    while queue:
        ev = queue.pop(0)
        out.append(ev)
        if isinstance(ev, Decision) and ev.status == DecisionStatus.PROPOSED:
            queue[:0] = pipeline.answer(ev.id, True, step)
    return out


_ID_FIELDS = ("id", "anomaly_id", "decision_id", "intervention_id", "incident_id")


def canonical(events: Iterable[Event]) -> list[dict[str, Any]]:
    """JSON-ready dicts with every random id replaced by the order in which it first appeared."""
    ids: dict[str, str] = {}

    def norm(value: Any) -> Any:
        if isinstance(value, str) and value in ids:
            return ids[value]
        if isinstance(value, dict):
            return {k: norm(v) for k, v in value.items()}
        if isinstance(value, list):
            return [norm(v) for v in value]
        return value

    out = []
    for ev in events:
        d = to_dict(ev)
        for name in _ID_FIELDS:
            v = d.get(name)
            if isinstance(v, str) and v not in ids:
                ids[v] = f"#{len(ids)}"
        out.append(norm(d))
    return out


def event_rows(events: Iterable[Event]) -> list[dict[str, Any]]:
    """The JSON objects ``stabmon replay --json`` prints: one per anomaly, decision, intervention and outcome,
    each with ``type, step, kind, metric, severity`` (a decision takes metric and severity from its
    anomaly)."""
    anomalies: dict[str, Anomaly] = {}
    rows = []
    for ev in events:
        if isinstance(ev, Anomaly):
            anomalies[ev.id] = ev
        rows.append(event_row(ev, anomalies))
    return rows


def event_row(event: Event, anomalies: dict[str, Anomaly] | None = None) -> dict[str, Any]:
    """The compact JSON object for one event; see :func:`event_rows`."""
    d = to_dict(event)
    row: dict[str, Any] = {"type": d["type"], "step": d.get("step")}
    if isinstance(event, Anomaly):
        row.update(
            kind=event.kind,
            metric=event.metric,
            severity=event.severity.value,
            score=event.score,
            threshold=event.threshold,
            detector=event.detector,
            message=event.message,
            id=event.id,
        )
    elif isinstance(event, Decision):
        cause = (anomalies or {}).get(event.anomaly_id or "")
        row.update(
            kind=event.action,
            metric=cause.metric if cause else None,
            severity=cause.severity.value if cause else None,
            status=event.status.value,
            rule=event.rule,
            rung=event.rung,
            params=d["params"],
            reason=event.reason,
            anomaly_id=event.anomaly_id,
            id=event.id,
        )
    elif isinstance(event, InterventionRecord):
        row.update(
            kind=event.action,
            metric=None,
            severity=None,
            before=d["before"],
            after=d["after"],
            reverted=event.reverted,
            decision_id=event.decision_id,
            id=event.id,
        )
    elif isinstance(event, Outcome):
        row.update(
            kind=event.verdict.value,
            metric=None,
            severity=None,
            evidence=d["evidence"],
            decision_id=event.decision_id,
            id=event.id,
        )
    return row
