"""The protocols through which the monitor and replay hand events to storage and alerting.

Dependencies are passed in (``store=``, ``notifier=``), never global. Implementations: :class:`stabmon.store.Store`
(SQL through a background writer) and :class:`stabmon.alerts.Notifier` (apprise on a background thread). Every
method here is called from the training thread. The ones called while training (``write_*``, ``poll_answers``,
``handle``) must return at once without waiting on I/O; ``start_run``, ``flush`` and ``close`` come at the edges
of a run and may wait, bounded (the SQL store's ``start_run`` reads the last sequence number of a resumed run).
Failures are caught, logged, counted and spooled by the implementation, never raised into training; the one
exception is :class:`RunRefusedError` from ``start_run``, before training starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from stabmon.events import Anomaly, Decision, Event, InterventionRecord, Outcome, StepRecord

LowVolumeEvent = Anomaly | Decision | InterventionRecord | Outcome


class RunRefusedError(ValueError):
    """A sink refuses to open a run at all (another live process writes it). The one sink failure that is
    raised to the user, at start-up, before training: going on would lose rows without counting them."""


@runtime_checkable
class Sink(Protocol):
    def start_run(
        self,
        *,
        name: str,
        kind: str = "live",
        config: Mapping[str, Any] | None = None,
        environment: Mapping[str, Any] | None = None,
        resume_run_id: str | None = None,
    ) -> str:
        """Create (or reopen, with ``resume_run_id``) a run and return its id. ``kind``: live | replay | import."""

    def write_steps(self, *, run_id: str, records: Sequence[StepRecord]) -> None:
        """Queue per-step metrics; never blocks on the database."""

    def write_events(self, *, run_id: str, events: Sequence[LowVolumeEvent]) -> None:
        """Queue anomalies, decisions, interventions and outcomes."""

    def write_checkpoint(self, *, run_id: str, step: int, path: str, nbytes: int, valid: bool = True) -> None: ...

    def write_skipped_batches(self, *, run_id: str, step: int, batch_indices: Sequence[int]) -> None: ...

    def poll_answers(self, *, run_id: str) -> list[tuple[str, bool]]:
        """Human answers (decision id, approved) to proposals not yet picked up. Called on the training
        thread at each flush: must not wait on I/O (the SQL store hands over what its writer thread read).
        A sink may also offer ``answers_live`` (bool): False while answers cannot be read, and the monitor
        then holds its proposals' approval clocks."""

    def end_run(self, *, run_id: str, status: str) -> None: ...

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is written (True) or the timeout passes (False)."""

    def close(self) -> None: ...


@runtime_checkable
class NotifierLike(Protocol):
    def handle(self, *, run_id: str, run_name: str, events: Sequence[Event]) -> None:
        """Look at freshly produced events and queue alerts for those that warrant one; never blocks."""

    def close(self, timeout: float | None = None) -> None: ...


# -- optional capabilities: a sink or notifier that has one says so by its type, never probed by name --
@runtime_checkable
class ResumableSink(Protocol):
    """A sink that can say how far a run it holds got (a resumed run must continue its own step count)."""

    def last_step(self, *, run_id: str) -> int | None: ...


@runtime_checkable
class ConfigurableSink(Protocol):
    """A sink that can replace a run's stored config (what the monitor learns of its loop after it started)."""

    def update_config(self, *, run_id: str, config: Mapping[str, Any]) -> None: ...


@runtime_checkable
class AnsweringSink(Protocol):
    """A sink that knows whether it can read humans' answers right now (proposals must not expire while it
    cannot)."""

    @property
    def answers_live(self) -> bool: ...


@runtime_checkable
class LocatedSink(Protocol):
    """A sink with a URL a command line can name (``--db``)."""

    @property
    def url(self) -> str: ...


@runtime_checkable
class StatefulNotifier(Protocol):
    """A notifier whose memory (deduplication, rate limits, incidents already alerted) is saved with the run."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

