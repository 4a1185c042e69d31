"""The flush side of the monitor: records -> pipeline -> store and notifier, and rank-0 decisions shared.

Functions of the :class:`~stabmon.monitor.Monitor` they are given (like :mod:`stabmon.collect.restore`); all
training-path I/O goes through ``monitor._guard``, which catches, logs and counts. :func:`decide` runs on
rank 0 only; :func:`share` is a collective every rank calls at every flush under ``torch.distributed``.
"""

from __future__ import annotations

import time
from typing import Any

from stabmon.collect.distributed import broadcast
from stabmon.collect.wiring import environment
from stabmon.events import Anomaly, Event, StepRecord


def decide(monitor: Any, records: list[StepRecord]) -> list[Event]:
    """Rank 0: detectors, engine and executor on the new records; events to the store and notifier."""
    events: list[Event] = []
    engine = monitor.pipeline.engine
    propose = engine is not None and getattr(engine, "mode", monitor.mode) == "propose"
    if propose and not getattr(monitor.store, "answers_live", True) and hasattr(engine, "hold"):
        engine.hold(len(records))  # answers cannot be read: no proposal may expire meanwhile
    for r in records:
        events.extend(monitor._guard("pipeline", lambda r=r: monitor.pipeline.process(r)) or [])
    if propose:
        events.extend(answers(monitor))
    publish(monitor, events)
    if monitor.kill_switch is not None and not monitor.should_stop and monitor.kill_switch.triggered():
        monitor.checkpoint_and_stop(reason=monitor.kill_switch.reason())
    return events


def share(monitor: Any, executed: Any) -> None:
    """Every rank: apply what rank 0 applied, and stop when rank 0 stops (a collective call)."""
    payload = (executed, monitor.should_stop, monitor.stop_reason) if monitor.rank == 0 else None
    executed, stop, reason = broadcast(payload)
    if monitor.rank != 0:
        monitor._guard("pipeline", lambda: monitor._follower.follow(monitor.executor, executed))
        if stop and not monitor.should_stop:
            monitor.should_stop, monitor.stop_reason = True, reason


def answers(monitor: Any) -> list[Event]:
    """Propose mode: humans' answers from the store, fed to the engine (and executed when approved)."""
    if monitor.store is None:
        return []
    got = monitor._guard("store", lambda: monitor.store.poll_answers(run_id=monitor.run_id)) or []
    out: list[Event] = []
    for decision_id, approved in got:
        out.extend(
            monitor._guard(
                "pipeline", lambda d=decision_id, a=approved: monitor.pipeline.answer(d, a, monitor.step)
            )
            or []
        )
    return out


def publish(monitor: Any, events: list[Event]) -> None:
    """Keep anomalies, decisions, interventions and outcomes; write them to the store; hand them to alerts."""
    low = [e for e in events if not isinstance(e, StepRecord)]
    if not low:
        return
    monitor.events.extend(low)
    monitor.anomalies.extend(e for e in low if isinstance(e, Anomaly))
    monitor._guard("store", lambda: monitor.store.write_events(run_id=monitor.run_id, events=low))
    if monitor.notifier is not None:
        monitor._guard(
            "alerts",
            lambda: monitor.notifier.handle(run_id=monitor.run_id, run_name=monitor.run_name, events=low),
        )


def start_run(monitor: Any, resume_run_id: str | None) -> str:
    """Open the run in the store (rank 0), or make up a local id when there is no store."""
    if monitor.store is None:
        return resume_run_id or f"local-{time.time_ns():x}"
    run_id = monitor._guard(
        "store",
        lambda: monitor.store.start_run(
            name=monitor.run_name,
            kind="live",
            config={"monitor": monitor.config.to_dict(), "mode": monitor.mode},
            environment=environment(),
            resume_run_id=resume_run_id,
        ),
    )
    return run_id or resume_run_id or f"local-{time.time_ns():x}"
