"""The one pipeline that live monitoring and replay share.

``StepRecord -> detectors -> Anomaly -> engine -> Decision -> executor -> InterventionRecord``; the engine later
emits ``Outcome``. The live :class:`~stabmon.monitor.Monitor` and :func:`stabmon.replay.replay` both get their
:class:`Pipeline` from :func:`stabmon.factory.build_pipeline` and call :meth:`Pipeline.process` once per
StepRecord, so replaying a live run's recorded metrics reproduces its anomalies and decisions exactly. The
detector, engine and executor classes are the same; what differs is the executor's target (the monitor, whose
overrides act on the optimizer, or a :class:`~stabmon.replay.simulate.Simulation` that records what would
have changed, with ``simulated=True`` on every InterventionRecord) and when records arrive (live at each flush;
replay in blocks of the recorded ``flush_every``).

The protocols below are the plug points; concrete classes live in ``stabmon.detect``, ``stabmon.runbook`` and
``stabmon.interventions``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from stabmon.events import (
    NOT_OF_THE_MODEL,
    Anomaly,
    Decision,
    DecisionStatus,
    Event,
    InterventionRecord,
    Outcome,
    Severity,
    StepRecord,
)
from stabmon.interventions.traits import changed_training


@runtime_checkable
class DetectorSuiteLike(Protocol):
    """Runs every configured detector on a StepRecord."""

    def update(self, record: StepRecord) -> list[Anomaly]: ...

    def enter_grace(self, steps: int | None = None) -> None:
        """Re-enter the grace period (after an intervention, a rollback or a resume)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class EngineLike(Protocol):
    """The runbook state machine: pure, no torch, no I/O."""

    def process(self, record: StepRecord, anomalies: Sequence[Anomaly]) -> list[Decision | Outcome]: ...

    def answer(self, decision_id: str, approved: bool, step: int) -> list[Decision | Outcome]:
        """A human's answer to a proposed decision."""

    def applied(self, decision: Decision, record: InterventionRecord) -> None:
        """Tell the engine what applying ``decision`` changed (so it can judge and revert it later)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class ProposingEngine(Protocol):
    """An engine that can propose instead of apply: its ``mode``, and ``hold(ticks)`` to keep a waiting proposal
    from expiring while answers cannot be read."""

    mode: str

    def hold(self, ticks: int) -> None: ...


@runtime_checkable
class ReseedableEngine(Protocol):
    """An engine whose event ids come from a seed: a run continued from a saved state draws a fresh line."""

    def reseed(self) -> None: ...


@runtime_checkable
class RunbookEngine(Protocol):
    """An engine that runs a :class:`~stabmon.runbook.schema.Runbook` (what it may do is read from it)."""

    @property
    def runbook(self) -> Any: ...


@runtime_checkable
class IncidentEngine(Protocol):
    """An engine that says where its open incident began (a rollback lands before it)."""

    @property
    def open_onset(self) -> int | None: ...


def open_onset(engine: Any) -> int | None:
    """``engine``'s open incident's onset; None when none is open or the engine does not say (a user's own)."""
    return engine.open_onset if isinstance(engine, IncidentEngine) else None


def calls_for_closer_flushes(events: Iterable[Event], engine: Any) -> bool:
    """After a flush: an anomaly at warning or above about the model (not about time or bookkeeping) among its
    ``events``, or an incident open in ``engine``, brings the next flushes closer (``MonitorConfig.watch``); the
    live monitor and a replay of its run decide it alike."""
    return open_onset(engine) is not None or any(
        isinstance(e, Anomaly) and e.severity >= Severity.WARNING and e.kind not in NOT_OF_THE_MODEL for e in events)


@runtime_checkable
class LadderEngine(Protocol):
    """An engine whose ladders can be fitted to the loop: the rungs that cannot act in it are passed over."""

    def drop_rungs(self, unfit: Mapping[tuple[str, int], str]) -> None: ...


@runtime_checkable
class ExecutorLike(Protocol):
    """Applies decisions: to the live training state, or simulated in replay."""

    def execute(self, decision: Decision) -> InterventionRecord | None: ...

    def commit(self, decision: Decision, tell: Callable[[Decision, InterventionRecord], None],
               into: list[Any]) -> None:
        """Apply ``decision``, append its record to ``into`` and ``tell`` the engine, as one change: whole or
        absent."""


@runtime_checkable
class EvidenceFiller(Protocol):
    """An executor whose interventions may take their target (tensor, layer, head) from the anomaly that opened
    the incident: the decision comes back with those parameters filled in, before it is executed, stored and
    shared with the other ranks (so every rank acts on the same tensors)."""

    def with_evidence(self, decision: Decision, anomaly: Anomaly, recent: Iterable[Anomaly] = ()) -> Decision: ...


_KEPT_ANOMALIES = 1024
"""How many recent anomalies the pipeline keeps for the decisions that name them (an incident's first anomaly
older than that, or from before a resume, leaves the rung to its own parameters)."""
_SETTLE_PASSES = 64  # rungs gone past on one record at most (a ladder of failing rungs, each repeated)


class Pipeline:
    """Detectors, then engine, then executor, for one StepRecord at a time."""

    def __init__(
        self,
        detectors: DetectorSuiteLike,
        engine: EngineLike | None = None,
        executor: ExecutorLike | None = None,
    ) -> None:
        self.detectors = detectors
        self.engine = engine
        self.executor = executor
        self._anomalies: dict[str, Anomaly] = {}  # recent anomalies by id: the evidence a decision may name
        self._produced: list[Event] = []

    def process(self, record: StepRecord) -> list[Event]:
        """Run one record through the pipeline; return every event it produced, in causal order. Should a stage
        raise, what was produced before it (a change already made above all) is still there for
        :meth:`take_produced`: a change is never left unrecorded."""
        events: list[Event] = []
        self._produced = events
        anomalies = self.detectors.update(record)
        events.extend(anomalies)
        self._remember(anomalies)
        engine = self.engine
        if engine is not None:
            produced = engine.process(record, anomalies)
            if produced:  # most records produce nothing: skip the executor loop
                self._run_engine(produced, events)
                self._settle(record, events)
        return events

    def _settle(self, record: StepRecord, events: list[Event]) -> None:
        """Let the engine go on, on the same record, past rungs that needed none (``Engine.settle``: one not
        applicable in this loop, a failed one, a diagnosis and its verdict's rule); bounded, since each pass
        moves the ladder on. An engine of the user's without ``settle`` goes on at its next record."""
        settle = getattr(self.engine, "settle", None)
        if settle is None or self.executor is None:
            return
        for _ in range(_SETTLE_PASSES):
            more = settle(record)
            if not more:
                return
            self._run_engine(more, events)

    def take_produced(self) -> list[Event]:
        """The events of the last :meth:`process` or :meth:`answer` call, also when it raised part-way."""
        produced, self._produced = self._produced, []
        return produced

    def answer(self, decision_id: str, approved: bool, step: int) -> list[Event]:
        """Feed a human's answer to a proposal through the engine and executor."""
        events: list[Event] = []
        self._produced = events
        if self.engine is None:
            return events
        self._run_engine(self.engine.answer(decision_id, approved, step), events)
        return events

    def _run_engine(self, produced: Sequence[Decision | Outcome], events: list[Event]) -> None:
        assert self.engine is not None
        for ev in produced:
            if not isinstance(ev, Decision) or ev.status not in (DecisionStatus.APPLY, DecisionStatus.APPROVED):
                events.append(ev)
                continue
            ev = self._with_evidence(ev)
            events.append(ev)
            if self.executor is None:
                continue
            made = len(events)
            self.executor.commit(ev, self.engine.applied, events)  # the change whole: applied, recorded, told
            record = events[-1] if len(events) > made else None
            if isinstance(record, InterventionRecord) and changed_training(record):
                self.detectors.enter_grace()  # (should this fail, the change and its record stand)

    def _remember(self, anomalies: Sequence[Anomaly]) -> None:
        for a in anomalies:
            self._anomalies[a.id] = a
        while len(self._anomalies) > _KEPT_ANOMALIES:
            del self._anomalies[next(iter(self._anomalies))]

    def _with_evidence(self, decision: Decision) -> Decision:
        anomaly = self._anomalies.get(decision.anomaly_id or "")
        if anomaly is None or not isinstance(self.executor, EvidenceFiller):
            return decision
        return self.executor.with_evidence(decision, anomaly, self._anomalies.values())

    def state_dict(self) -> dict[str, Any]:
        return {
            "detectors": self.detectors.state_dict(),
            "engine": self.engine.state_dict() if self.engine is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detectors.load_state_dict(state["detectors"])
        if self.engine is not None and state.get("engine") is not None:
            self.engine.load_state_dict(state["engine"])
