"""The flush side of the monitor: records -> pipeline -> store and notifier, and rank-0 decisions shared.

:class:`Outbox` is the run's way out of the training process: the run in the store and the notifier, every
call through the :class:`~stabmon.collect.failsafe.Failsafe` (only rank 0 has a store and a notifier; on the
other ranks both are None and the outbox does nothing). :class:`Flusher` is the flush step, built from its
collaborators: the pipeline, the outbox, the intervention target, the rank follower and the kill switch.
:meth:`Flusher.decide` runs on rank 0 only; :meth:`Flusher.share` is a collective every rank calls at every
flush under ``torch.distributed``.

The hang watchdog publishes from its own thread (:meth:`Flusher.publish_from_thread`). Publishing holds a lock,
so the watchdog's events and a flush's never go to the store and the notifier at the same time; when the
training thread keeps the lock for ``handoff_after`` seconds (stuck in a write), the watchdog's events are
handed to the training thread's next flush instead.

>>> from stabmon.collect.failsafe import Failsafe
>>> from stabmon.factory import NullDetectors
>>> from stabmon.pipeline import Pipeline
>>> from stabmon.interventions.commit import FollowUps
>>> class Target:
...     should_stop, stop_reason, follow_ups = False, None, FollowUps()
>>> outbox = Outbox(None, None, failsafe=Failsafe(), run_name="doc")
>>> flusher = Flusher(Pipeline(NullDetectors()), outbox, target=Target(), failsafe=outbox.failsafe)
>>> flusher.flush([StepRecord(step=0, metrics={"loss": 1.0})]), list(flusher.events)
([], [])
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial
from typing import Any, Protocol

from stabmon.collect.cluster.distributed import Join, PeerLost, RankFollower, broadcast, executed_decisions
from stabmon.collect.cluster.joint import Agreement, RankChannel
from stabmon.collect.cluster.rank_policy import RankPolicy
from stabmon.collect.failsafe import Failsafe
from stabmon.collect.wiring import environment
from stabmon.events import Anomaly, Decision, DecisionStatus, Event, InterventionRecord, Severity, StepRecord
from stabmon.interventions.commit import FollowUps
from stabmon.pipeline import Pipeline, ProposingEngine
from stabmon.sinks import (
    AnsweringSink,
    ConfigurableSink,
    LocatedSink,
    NotifierLike,
    ResumableSink,
    RunRefusedError,
    Sink,
    StatefulNotifier,
)

log = logging.getLogger(__name__)

SAVED = Agreement(problems=("checkpoint_error", "rolled_back_state_not_saved", "follow_up_error"))
"""After the follow-ups of a joint change (:mod:`stabmon.interventions.commit`): every saving rank wrote its
checkpoint."""


class Exporter(Protocol):
    """Live metrics out of the process (:class:`stabmon.integrations.otel.OtlpExporter`): fed at each flush with
    the flushed records and the published events, it exports on a thread of its own; feeding never blocks."""

    def steps(self, *, run_id: str, records: Sequence[StepRecord]) -> None: ...

    def events(self, *, run_id: str, events: Sequence[Any]) -> None: ...

    def close(self, timeout: float | None = None) -> None: ...


class Outbox:
    """The run in the store, the alert channels and the live exporter (``exporter``: on rank 0, or on every
    rank when it exports per rank); nothing here raises (see the module docstring).

    >>> from stabmon.collect.failsafe import Failsafe
    >>> box = Outbox(None, None, failsafe=Failsafe(), run_name="doc")
    >>> box.start_run(config={}, resume_run_id="r-1"), box.poll_answers()
    ('r-1', [])
    """

    def __init__(
        self,
        store: Sink | None,
        notifier: NotifierLike | None,
        *,
        failsafe: Failsafe,
        run_name: str,
        owns_store: bool = False,
        owns_notifier: bool = False,
        exporter: Exporter | None = None,
    ) -> None:
        self.store, self.notifier = store, notifier
        self.exporter = exporter
        """The live metrics export (None: none); the outbox closes it."""
        self.failsafe = failsafe
        self.run_name = run_name
        self.run_id = ""
        """Set by :meth:`start_run` (and, under ``torch.distributed``, to rank 0's id on every rank)."""
        self.owns_store, self.owns_notifier = owns_store, owns_notifier

    def start_run(self, *, config: Mapping[str, Any], resume_run_id: str | None) -> str:
        """Open (or reopen) the run in the store; a local id when there is no store or it failed."""
        run_id = None
        store = self.store
        if store is not None:
            try:
                run_id = self.failsafe.call(
                    "store",
                    lambda: store.start_run(
                        name=self.run_name,
                        kind="live",
                        config=config,
                        environment=environment(),
                        resume_run_id=resume_run_id,
                    ),
                    let_through=(RunRefusedError,),
                )
            except RunRefusedError:  # another process writes the run: nothing of this one is written
                self._release()
                raise
        self.run_id = run_id or resume_run_id or f"local-{time.time_ns():x}"
        return self.run_id

    def update_config(self, config: Mapping[str, Any]) -> None:
        """The run's config as it is now (a store that cannot update a run's config keeps the first)."""
        store = self.store
        if isinstance(store, ConfigurableSink):
            self.failsafe.call("store", lambda: store.update_config(run_id=self.run_id, config=config))

    def last_step(self) -> int | None:
        """The highest step the store holds for this run (None: none, or a store that cannot say)."""
        store = self.store
        if not isinstance(store, ResumableSink):
            return None
        value = self.failsafe.call("store", lambda: store.last_step(run_id=self.run_id))
        return value if isinstance(value, int) else None

    def write_steps(self, records: Sequence[StepRecord]) -> None:
        store, exporter = self.store, self.exporter
        if records and store is not None:
            self.failsafe.call("store", lambda: store.write_steps(run_id=self.run_id, records=records))
        if records and exporter is not None:
            self.failsafe.call("export", lambda: exporter.steps(run_id=self.run_id, records=records))

    def send(self, events: Sequence[Any]) -> None:
        """Anomalies, decisions, interventions and outcomes to the store and to the notifier."""
        self.store_events(events)
        self.notify(events)

    def store_events(self, events: Sequence[Any]) -> None:
        store, exporter = self.store, self.exporter
        if store is not None:
            self.failsafe.call("store", lambda: store.write_events(run_id=self.run_id, events=events))
        if exporter is not None:
            self.failsafe.call("export", lambda: exporter.events(run_id=self.run_id, events=events))

    def notify(self, events: Sequence[Any]) -> None:
        """The events to the notifier (its gates decide at once what goes out; delivery is on its threads)."""
        notifier = self.notifier
        if notifier is not None:
            self.failsafe.call(
                "alerts", lambda: notifier.handle(run_id=self.run_id, run_name=self.run_name, events=events)
            )

    @property
    def answers_live(self) -> bool:
        """False while the store cannot read humans' answers (proposals must not expire meanwhile)."""
        return not isinstance(self.store, AnsweringSink) or bool(self.store.answers_live)

    def poll_answers(self) -> list[tuple[str, bool]]:
        store = self.store
        if store is None:
            return []
        return self.failsafe.call("store", lambda: store.poll_answers(run_id=self.run_id)) or []

    def write_skipped_batches(self, *, step: int, batch_indices: Sequence[int]) -> None:
        store = self.store
        if store is not None:
            self.failsafe.call(
                "store",
                lambda: store.write_skipped_batches(run_id=self.run_id, step=step, batch_indices=batch_indices),
            )

    def mark(self, status: str) -> None:
        """Record the run's status now (a hung process about to exit cannot close the run)."""
        store = self.store
        if store is not None:
            self.failsafe.call("store", lambda: store.end_run(run_id=self.run_id, status=status))

    def settle(self) -> None:
        """What was sent reaches the database and the alert channels (bounded): before a hang exit."""
        store, notifier, exporter = self.store, self.notifier, self.exporter
        if exporter is not None:
            self.failsafe.call("export", exporter.close)
        if notifier is not None:  # first: its last delivery attempts are rows for the store
            self.failsafe.call("alerts", lambda: notifier.close(timeout=10.0))
        if store is not None:
            self.failsafe.call("store", lambda: store.flush(timeout=30.0))

    def proposal_line(self, decision: Decision) -> str:
        """One line for a terminal: what is proposed and the commands that answer it."""
        url = self.store.url if isinstance(self.store, LocatedSink) else None
        db = f" --db '{url}'" if url else ""
        params = ", ".join(f"{k}={v}" for k, v in decision.params.items())
        return (f"stabmon: proposal {decision.id} waits for an answer: {decision.action}({params}) at step "
                f"{decision.step}; stabmon approve {self.run_id} {decision.id}{db}  |  "
                f"stabmon reject {self.run_id} {decision.id}{db}")

    def notifier_state(self) -> dict[str, Any] | None:
        """Which channels were told about which incident, so a resumed run does not page again."""
        notifier = self.notifier
        return self.failsafe.call("notifier", notifier.state_dict) if isinstance(notifier, StatefulNotifier) else None

    def load_notifier_state(self, state: dict[str, Any] | None) -> None:
        notifier = self.notifier
        if state is not None and isinstance(notifier, StatefulNotifier):
            self.failsafe.call("notifier", lambda: notifier.load_state_dict(state))

    def close(self, status: str) -> None:
        """End the run in the store, then close the notifier and the store where this outbox opened them."""
        if self.store is not None:
            store = self.store
            self.failsafe.call("store", lambda: store.end_run(run_id=self.run_id, status=status))
        self._release()

    def _release(self) -> None:
        """Close what this outbox opened: the notifier first (its last attempts are rows for the store), then the
        store (its close() drains within its close_timeout and spools the rest), and the exporter (its last export,
        bounded)."""
        if self.exporter is not None:
            self.failsafe.call("export", self.exporter.close)
        if self.notifier is not None and self.owns_notifier:
            self.failsafe.call("alerts", partial(self.notifier.close, timeout=10.0))
        if self.store is not None and self.owns_store:
            self.failsafe.call("store", self.store.close)


class FlushTarget(Protocol):
    """What a flush needs of the intervention target: the step, the stop request, checkpoint-and-stop (joint:
    rank 0's kill switch calls every rank in) and one rank's own stop (a rank that learns of a stop it was
    not called into saves as its rank policy says, then stops)."""

    should_stop: bool
    stop_reason: str | None
    follow_ups: FollowUps

    @property
    def step(self) -> int: ...

    def checkpoint_and_stop(self, *, reason: str) -> dict[str, Any]: ...

    def stop_here(self, *, reason: str | None) -> dict[str, Any]: ...


class Flusher:
    """One flush: records through the pipeline, events to the outbox, decisions shared across ranks."""

    def __init__(
        self,
        pipeline: Pipeline,
        outbox: Outbox,
        *,
        target: FlushTarget,
        failsafe: Failsafe,
        mode: str | None = None,
        follower: RankFollower | None = None,
        kill_switch: Any = None,
        policy: RankPolicy | None = None,
        handed: deque[Event] | None = None,
        handoff_after: float = 10.0,
        channel: RankChannel | None = None,
        joiners: Mapping[str, Callable[[dict[str, Any]], Any]] | None = None,
        history: int | None = None,
    ) -> None:
        self.pipeline, self.outbox, self.target, self.failsafe = pipeline, outbox, target, failsafe
        self.channel = channel
        """The joint actions' exchanges between ranks (None: one process)."""
        self.mode = mode
        self.follower = follower if follower is not None else RankFollower()
        self.kill_switch = kill_switch
        self.policy = policy if policy is not None else RankPolicy()
        self.handoff_after = handoff_after
        self.joiners: dict[str, Callable[[dict[str, Any]], Any]] = dict(joiners or {})
        """Non-zero ranks: what to run when rank 0 sends a :class:`~stabmon.collect.cluster.distributed.Join`."""
        self.events: deque[Event] = deque(maxlen=history)
        """The anomalies, decisions, interventions and outcomes published in this run, the newest ``history``
        (the store holds them all)."""
        self.anomalies: deque[Anomaly] = deque(maxlen=history)
        self._publishing = threading.Lock()
        self._handed: deque[Event] = handed if handed is not None else deque()
        """Events from outside a flush (the watchdog's thread, a joint action's disagreements) for the next
        publish."""

    def flush(self, records: list[StepRecord], *, stored: Collection[int] = ()) -> list[Event]:
        """The records (already read back) to the store, then rank 0 decides and every rank follows; the
        changes made are then whole (:mod:`stabmon.interventions.commit`): their follow-ups done, their records
        completed with what the follow-ups found, and only then published. ``stored``: ids of records the
        store holds already (a resume's steps its crashed process had flushed): not written again."""
        self.outbox.write_steps([r for r in records if id(r) not in stored] if stored else records)
        leader = self.policy.leader
        events = self.decide(records) if leader else []
        joint = False
        if self.policy.distributed:
            try:
                joint = self.share(executed_decisions(events) if leader else None)
            except PeerLost:  # said in one line where it failed; what rank 0 decided is still recorded below
                if not leader:
                    raise
        if not leader:
            self.follow_up(joint)
            return events
        # the alert gates first: the checkpoint a follow-up writes then remembers who was told of this incident
        handed = self._take_handed()
        with self._publishing:
            self.outbox.notify(_low([*handed, *events]))
        found, disagreements = self.follow_up(joint)
        events = [*_completed(events, found), *disagreements]
        with self._publishing:
            self.outbox.notify(disagreements)
            self._keep(_low([*handed, *events]))
        return events

    def decide(self, records: list[StepRecord]) -> list[Event]:
        """Rank 0: detectors, engine and executor on the new records (published by :meth:`flush`)."""
        events: list[Event] = []
        engine = self.pipeline.engine
        mode = engine.mode if isinstance(engine, ProposingEngine) else self.mode
        propose = engine is not None and mode == "propose"
        if propose and not self.outbox.answers_live and isinstance(engine, ProposingEngine):
            engine.hold(len(records))  # answers cannot be read: no proposal may expire meanwhile
        for r in records:
            # what the pipeline produced before a failure is kept: a change it made is recorded and shared
            self.failsafe.call("pipeline", partial(self.pipeline.process, r))
            events.extend(self.pipeline.take_produced())
        if propose:
            events.extend(self._answers())
        self._check_kill_switch()
        return events

    def follow_up(self, joint: bool) -> tuple[dict[str | None, dict[str, Any]], list[Event]]:
        """This rank's follow-ups of the changes just committed (a rollback's or a stop's checkpoint): their facts by
        record. After a joint change (``joint``: rank 0 made one) every rank's problems are gathered: on rank 0 a
        rank that could not save is named on the change's record (``rank_disagreements``) and in a
        ``rank_disagreement`` anomaly, returned to publish with the records."""
        follow_ups = self.target.follow_ups
        actions = follow_ups.actions
        found = follow_ups.run() if follow_ups.pending else {}
        if not (joint and self.channel is not None):
            return found, []
        mine = {k: v for facts in found.values() for k, v in facts.items()}
        reports = self.channel.gather(SAVED.summary(self.policy.rank, mine, None))
        lines = [line for line in SAVED.disagreements(reports) if not line.startswith("rank 0")] \
            if self.policy.leader else []
        if not lines:
            return found, []
        log.error("stabmon: after %s the ranks do not agree: %s", "/".join(actions), "; ".join(lines))
        for facts in found.values():
            facts["rank_disagreements"] = [*facts.get("rank_disagreements", []), *lines]
        return found, [Anomaly(kind="rank_disagreement", metric="ranks/" + "/".join(actions), step=self.target.step,
                               score=float(len(lines)), severity=Severity.ERROR, detector="rank_policy",
                               message="/".join(actions) + ": " + "; ".join(lines))]

    def _answers(self) -> list[Event]:
        """Propose mode: humans' answers from the store, fed to the engine (and executed when approved)."""
        out: list[Event] = []
        for decision_id, approved in self.outbox.poll_answers():
            answer = partial(self.pipeline.answer, decision_id, approved, self.target.step)
            self.failsafe.call("pipeline", answer)
            out.extend(self.pipeline.take_produced())
        return out

    def _check_kill_switch(self) -> None:
        switch = self.kill_switch
        if switch is not None and not self.target.should_stop and switch.triggered():
            self.target.checkpoint_and_stop(reason=switch.reason())

    def share(self, executed: Any) -> bool:
        """Every rank: apply what rank 0 applied, and stop when rank 0 stops (a collective call). Returns
        whether rank 0 left follow-ups of a joint change (then every rank's are compared after they are done)."""
        target = self.target
        leader = self.policy.leader
        payload = (executed, target.should_stop, target.stop_reason, target.follow_ups.pending) if leader else None
        message = broadcast(payload)
        while isinstance(message, Join):  # rank 0 calls every rank into a joint intervention first
            self._join(message)
            message = broadcast(None)
        executed, stop, reason, joint = message
        if not leader:
            follower, executor = self.follower, self.pipeline.executor
            self.failsafe.call("pipeline", lambda: follower.follow(executor, executed))
            if stop and not target.should_stop:  # a stop this rank was not called into: it saves its part
                self.failsafe.call("checkpoint", lambda: target.stop_here(reason=reason))
        return bool(joint)

    def _join(self, message: Join) -> None:
        joiner = self.joiners.get(message.action)
        if joiner is None:  # every rank builds the same joiners: this is a bug, say so loudly
            log.error("stabmon: rank 0 asked for %s, which this rank cannot join", message.action)
            return
        self.failsafe.call("pipeline", lambda: joiner(message.params))

    def publish(self, events: Sequence[Event]) -> None:
        """Keep anomalies, decisions, interventions and outcomes; send them to the store and the alerts."""
        with self._publishing:
            self._publish(events)

    def publish_from_thread(self, events: Sequence[Event]) -> None:
        """:meth:`publish` from another thread (the hang watchdog): once no flush is publishing, or, when one
        keeps publishing for ``handoff_after`` seconds, at the training thread's next flush."""
        if not self._publishing.acquire(timeout=self.handoff_after):
            log.error("stabmon: the training thread is stuck publishing; %d event(s) wait for its next flush",
                      len(events))
            self._handed.extend(events)
            return
        try:
            self._publish(events)
        finally:
            self._publishing.release()

    def _take_handed(self) -> list[Event]:
        taken: list[Event] = []
        while self._handed:
            taken.append(self._handed.popleft())
        return taken

    def _publish(self, events: Sequence[Event]) -> None:
        low = _low(events)
        if low:
            self.outbox.notify(low)
            self._keep(low)

    def _keep(self, low: Sequence[Event]) -> None:
        """Keep the events in memory and in the store; a proposal with no alert channel is said in the log."""
        if not low:
            return
        self.events.extend(low)
        self.anomalies.extend(e for e in low if isinstance(e, Anomaly))
        self.outbox.store_events(low)
        if self.outbox.notifier is None:  # no alert channel: the person at the terminal must hear of it
            for d in low:
                if isinstance(d, Decision) and d.status == DecisionStatus.PROPOSED:
                    log.warning("%s", self.outbox.proposal_line(d))


def _low(events: Sequence[Event]) -> list[Event]:
    """The events that are not step records (those go to the store on their own path)."""
    return [e for e in events if not isinstance(e, StepRecord)]


def _completed(events: list[Event], found: Mapping[str | None, Mapping[str, Any]]) -> list[Event]:
    """``events`` with each change's record completed by what its follow-ups found."""
    if not found:
        return events
    return [dataclasses.replace(e, after={**e.after, **found[e.id]})
            if isinstance(e, InterventionRecord) and e.id in found else e for e in events]
