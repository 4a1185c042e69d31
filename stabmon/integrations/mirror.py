"""Mirror stabmon's signals and events into the tools people already watch (TensorBoard, Weights & Biases).

:class:`MirrorSink` is a :class:`~stabmon.sinks.Sink`: it hands everything to the primary store (which keeps
answers, checkpoints and the record) and mirrors steps and events to each mirror. :class:`Mirror` is the base of
a mirror: its public methods own the guard (a failing mirror is logged and counted, never raised into training)
and the bookkeeping; subclasses implement ``_open``, ``_steps``, ``_events`` and ``_close``.

>>> from stabmon.events import StepRecord
>>> class Printer(Mirror):
...     def _steps(self, records):
...         print([(r.step, dict(r.metrics)) for r in records])
>>> sink = MirrorSink(None, Printer())
>>> run = sink.start_run(name="demo")
>>> sink.write_steps(run_id=run, records=[StepRecord(step=0, metrics={"loss": 2.0})])
[(0, {'loss': 2.0})]
>>> sink.close()
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from stabmon.events import Anomaly, Decision, InterventionRecord, Outcome, StepRecord, new_id
from stabmon.sinks import LowVolumeEvent, Sink

log = logging.getLogger(__name__)


class Mirror:
    """One place signals and events are mirrored to. Subclasses implement the ``_``-methods they need."""

    def __init__(self) -> None:
        self.errors: Counter[str] = Counter()
        self.run_id: str | None = None
        self.run_name: str | None = None

    def _guard(self, what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - a mirror never raises into training
            self.errors[what] += 1
            log.exception("stabmon: %s mirror: %s failed (continuing)", type(self).__name__, what)

    def open(self, *, run_id: str, name: str, config: Mapping[str, Any]) -> None:
        self.run_id, self.run_name = run_id, name
        self._guard("open", lambda: self._open(run_id=run_id, name=name, config=config))

    def steps(self, records: Sequence[StepRecord]) -> None:
        if records:
            self._guard("steps", lambda: self._steps(records))

    def events(self, events: Sequence[LowVolumeEvent]) -> None:
        if events:
            self._guard("events", lambda: self._events(events))

    def close(self, status: str = "finished") -> None:
        self._guard("close", lambda: self._close(status))

    def _open(self, *, run_id: str, name: str, config: Mapping[str, Any]) -> None:
        return None

    def _steps(self, records: Sequence[StepRecord]) -> None:
        return None

    def _events(self, events: Sequence[LowVolumeEvent]) -> None:
        return None

    def _close(self, status: str) -> None:
        return None


def describe(event: LowVolumeEvent) -> tuple[str, str]:
    """(kind, one line) of an event, for text panels and alerts."""
    if isinstance(event, Anomaly):
        return "anomaly", (f"{event.kind} on {event.metric} at step {event.step} (score {event.score:.4g}, "
                           f"{event.severity.value}, {event.detector}) {event.message}").strip()
    if isinstance(event, Decision):
        params = ", ".join(f"{k}={v}" for k, v in event.params.items())
        return "decision", (f"{event.action}({params}) [{event.status.value}] at step {event.step}, rule "
                            f"{event.rule} rung {event.rung + 1}: {event.reason}")
    if isinstance(event, InterventionRecord):
        kind = "revert" if event.reverted else "intervention"
        return kind, f"{event.action} at step {event.step}: {dict(event.before)} -> {dict(event.stored_after())}"
    if isinstance(event, Outcome):
        return "outcome", f"{event.verdict.value} at step {event.step}: {dict(event.evidence)}"
    raise TypeError(f"not a stabmon event: {type(event).__name__}")


class MirrorSink:
    """A :class:`~stabmon.sinks.Sink` that writes to ``primary`` (a Sink or None) and mirrors to ``mirrors``.

    Pass it as ``Monitor(..., store=MirrorSink(open_store(url), TensorBoardMirror("runs/x")))``; the caller
    closes it (``close()`` closes the primary store and every mirror).
    """

    def __init__(self, primary: Sink | None, *mirrors: Mirror) -> None:
        self.primary = primary
        self.mirrors = list(mirrors)

    def start_run(self, *, name: str, kind: str = "live", config: Mapping[str, Any] | None = None,
                  environment: Mapping[str, Any] | None = None, resume_run_id: str | None = None) -> str:
        if self.primary is not None:
            run_id = self.primary.start_run(name=name, kind=kind, config=config, environment=environment,
                                            resume_run_id=resume_run_id)
        else:
            run_id = resume_run_id or new_id()
        for m in self.mirrors:
            m.open(run_id=run_id, name=name, config=dict(config or {}))
        return run_id

    def write_steps(self, *, run_id: str, records: Sequence[StepRecord]) -> None:
        if self.primary is not None:
            self.primary.write_steps(run_id=run_id, records=records)
        for m in self.mirrors:
            m.steps(records)

    def write_events(self, *, run_id: str, events: Sequence[LowVolumeEvent]) -> None:
        if self.primary is not None:
            self.primary.write_events(run_id=run_id, events=events)
        for m in self.mirrors:
            m.events(events)

    def write_checkpoint(self, *, run_id: str, step: int, path: str, nbytes: int, valid: bool = True) -> None:
        if self.primary is not None:
            self.primary.write_checkpoint(run_id=run_id, step=step, path=path, nbytes=nbytes, valid=valid)

    def write_skipped_batches(self, *, run_id: str, step: int, batch_indices: Sequence[int]) -> None:
        if self.primary is not None:
            self.primary.write_skipped_batches(run_id=run_id, step=step, batch_indices=batch_indices)

    def poll_answers(self, *, run_id: str) -> list[tuple[str, bool]]:
        return self.primary.poll_answers(run_id=run_id) if self.primary is not None else []

    def end_run(self, *, run_id: str, status: str) -> None:
        if self.primary is not None:
            self.primary.end_run(run_id=run_id, status=status)
        for m in self.mirrors:
            m.close(status)

    def flush(self, timeout: float | None = None) -> bool:
        return self.primary.flush(timeout) if self.primary is not None else True

    def close(self) -> None:
        for m in self.mirrors:
            m.close()
        if self.primary is not None:
            self.primary.close()
