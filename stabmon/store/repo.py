"""Keyword-only repository functions over a SQLAlchemy session: runs, metrics, events, answers, alerts.

Readers (CLI, replay, report, trace) and ``stabmon approve/reject`` call these with a session from
:meth:`stabmon.store.Store.session` or their own ``Session(engine)``. Every run, record, event, checkpoint and
alert is written by a :class:`~stabmon.store.Store` (``start_run``, ``write_*``, ``add_alert``), through its
background writer; the store's writer thread also reads human answers here (:func:`take_answers`).

>>> import os, tempfile
>>> from stabmon.store import open_store
>>> store = open_store("sqlite:///" + os.path.join(tempfile.mkdtemp(), "r.db"))
>>> rid = store.start_run(name="demo", environment={}); store.flush(10.0)
True
>>> with store.session() as s:
...     resolve_run(session=s, ref="demo").id == rid, resolve_run(session=s, ref="latest").name
(True, 'demo')
>>> store.close()
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from stabmon.events import Decision, DecisionStatus, StepRecord
from stabmon.store.codec import decode, event_from_row
from stabmon.store.database import StoreError
from stabmon.store.models import (
    AlertRow,
    AnomalyRow,
    Base,
    CheckpointRow,
    DecisionRow,
    InterventionRow,
    MetricName,
    OutcomeRow,
    Run,
    SkippedBatch,
    Step,
    StepMetric,
)

if TYPE_CHECKING:
    import polars as pl

RUN_KINDS = frozenset({"live", "replay", "import"})
_EVENT_MODELS = {
    "anomalies": AnomalyRow,
    "decisions": DecisionRow,
    "interventions": InterventionRow,
    "outcomes": OutcomeRow,
}


class RunNotFoundError(StoreError):
    pass


class AnswerError(StoreError):
    pass


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _utc(dt: datetime | None) -> datetime | None:
    if dt is None:
        return None
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


# -- runs ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunSummary:
    id: str
    name: str
    kind: str
    status: str
    started_at: datetime
    ended_at: datetime | None
    steps: int
    last_step: int | None
    anomalies: int
    parent_run_id: str | None

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["started_at"] = self.started_at.isoformat()
        d["ended_at"] = self.ended_at.isoformat() if self.ended_at else None
        return d


def list_runs(*, session: Session, limit: int | None = None) -> list[RunSummary]:
    """Runs, newest first, with their recorded step count, last step and anomaly count."""
    steps = (
        sa.select(Step.run_key, sa.func.count().label("n"), sa.func.max(Step.step).label("last"))
        .group_by(Step.run_key)
        .subquery()
    )
    anomalies = (
        sa.select(AnomalyRow.run_id, sa.func.count().label("n")).group_by(AnomalyRow.run_id).subquery()
    )
    q = (
        sa.select(Run, steps.c.n, steps.c.last, anomalies.c.n)
        .outerjoin(steps, steps.c.run_key == Run.key)
        .outerjoin(anomalies, anomalies.c.run_id == Run.id)
        .order_by(Run.started_at.desc(), Run.id)
        .limit(limit)
    )
    return [
        RunSummary(
            r.id,
            r.name,
            r.kind,
            run_status(r),
            _utc(r.started_at) or r.started_at,
            _utc(r.ended_at),
            n or 0,
            last,
            na or 0,
            r.parent_run_id,
        )
        for r, n, last, na in session.execute(q)
    ]


def run_status(run: Run) -> str:
    """The run's status; ``interrupted`` for one still marked ``running`` whose writer is gone (killed with no
    chance to say so: its lease ran out, or its process ended on this host)."""
    from stabmon.store.lease import writer_gone

    if run.status == "running" and writer_gone(run.lease_owner, run.lease_until):
        return "interrupted"
    return run.status


def delete_run(*, session: Session, run_id: str) -> None:
    """Delete a run and every row that belongs to it (runs that name it as their parent keep theirs, without
    the link). Explicit on every table: SQLite does not enforce the foreign keys' cascades."""
    key = _run_key(session, run_id)
    for table in ("step_metrics", "steps"):
        t = Base.metadata.tables[table]
        session.execute(sa.delete(t).where(t.c.run_key == key))
    for table in (*_EVENT_MODELS, "alerts", "checkpoints", "skipped_batches"):
        t = Base.metadata.tables[table]
        session.execute(sa.delete(t).where(t.c.run_id == run_id))
    session.execute(sa.update(Run).where(Run.parent_run_id == run_id).values(parent_run_id=None))
    session.execute(sa.delete(Run).where(Run.id == run_id))


def _run_key(session: Session, run_id: str) -> int:
    key = session.scalar(sa.select(Run.key).where(Run.id == run_id))
    if key is None:
        raise RunNotFoundError(f"no run with id {run_id!r}")
    return key


def get_run(*, session: Session, run_id: str) -> Run:
    run = session.scalars(sa.select(Run).where(Run.id == run_id)).first()
    if run is None:
        raise RunNotFoundError(f"no run with id {run_id!r}")
    return run


def run_ended_at(*, session: Session, run_id: str) -> float | None:
    """When the run ended (UNIX seconds; None while it runs or after it was cut off)."""
    ended = _utc(get_run(session=session, run_id=run_id).ended_at)
    return ended.timestamp() if ended is not None else None


def resolve_run(*, session: Session, ref: str) -> Run:
    """The run named by ``ref``: an id, a unique id prefix, a unique name, or ``latest``."""
    if ref == "latest":
        run = session.scalars(sa.select(Run).order_by(Run.started_at.desc()).limit(1)).first()
        if run is None:
            raise RunNotFoundError("no runs recorded yet")
        return run
    run = session.scalars(sa.select(Run).where(Run.id == ref)).first()
    if run is not None:
        return run
    for where, what in (
        (Run.name == ref, "named"),
        (Run.id.startswith(ref, autoescape=True), "with id prefix"),
    ):
        if what == "with id prefix" and len(ref) < 4:
            continue
        found = list(session.scalars(sa.select(Run).where(where).order_by(Run.started_at.desc()).limit(11)))
        if len(found) == 1:
            return found[0]
        if found:
            ids = ", ".join(r.id for r in found[:10])
            raise RunNotFoundError(f"{len(found)} runs {what} {ref!r} ({ids}); use a run id")
    raise RunNotFoundError(f"no run matches {ref!r} (see `stabmon runs`)")


def next_seq(*, session: Session, run_id: str) -> int:
    """The next free record sequence number of a run (0 for a new run)."""
    key = session.scalar(sa.select(Run.key).where(Run.id == run_id))
    tops = [session.scalar(sa.select(sa.func.max(Step.seq)).where(Step.run_key == key))] if key else []
    for table in ("anomalies", "decisions", "interventions", "outcomes"):
        t = Base.metadata.tables[table]
        tops.append(session.scalar(sa.select(sa.func.max(t.c.seq)).where(t.c.run_id == run_id)))
    top = max((x for x in tops if x is not None), default=-1)
    return top + 1


# -- metrics and steps ---------------------------------------------------------------------------------------
def last_step(*, session: Session, run_id: str) -> int | None:
    """The highest step a run has stored (None: no steps)."""
    key = session.scalar(sa.select(Run.key).where(Run.id == run_id))
    value = session.scalar(sa.select(sa.func.max(Step.step)).where(Step.run_key == key)) if key else None
    return None if value is None else int(value)


def metric_names(*, session: Session, run_id: str) -> list[str]:
    q = (
        sa.select(MetricName.name)
        .where(
            MetricName.id.in_(
                sa.select(StepMetric.metric_id)
                .where(StepMetric.run_key == _run_key(session, run_id))
                .distinct()
            )
        )
        .order_by(MetricName.id)
    )
    return list(session.scalars(q))


def get_metrics(*, session: Session, run_id: str, names: Sequence[str] | None = None) -> pl.DataFrame:
    """Long table ``seq, step, name, value`` (NaN restored), in record order then metric-name order."""
    import polars as pl  # a query needs it; the live monitor's import path must not (see docs/monitor.md)

    q = (
        sa.select(StepMetric.seq, StepMetric.step, MetricName.name, StepMetric.value)
        .join(MetricName, MetricName.id == StepMetric.metric_id)
        .where(StepMetric.run_key == _run_key(session, run_id))
    )
    if names:
        q = q.where(MetricName.name.in_(list(names)))
    rows = session.execute(q.order_by(StepMetric.seq, StepMetric.metric_id)).all()
    schema = {"seq": pl.Int64, "step": pl.Int64, "name": pl.Utf8, "value": pl.Float64}
    df = pl.DataFrame(rows, schema=schema, orient="row")
    return df.with_columns(pl.col("value").fill_null(math.nan))


def load_steps(*, session: Session, run_id: str) -> list[StepRecord]:
    """The run's StepRecords exactly as written (NaN and infinities kept), in record order.

    Safe while the run is being written: records committed after the first query are left out whole."""
    return [r for _, r in load_sequenced_steps(session=session, run_id=run_id)]


def load_sequenced_steps(*, session: Session, run_id: str) -> list[tuple[int, StepRecord]]:
    """``(seq, record)`` of every stored step, in record order (``seq`` places them among the events)."""
    key = _run_key(session, run_id)
    steps = session.execute(
        sa.select(Step.seq, Step.step, Step.batch_index, Step.time)
        .where(Step.run_key == key)
        .order_by(Step.seq)
    ).all()
    if not steps:
        return []
    metrics: dict[int, dict[str, float]] = {seq: {} for seq, *_ in steps}
    q = (
        sa.select(StepMetric.seq, MetricName.name, StepMetric.value)
        .join(MetricName, MetricName.id == StepMetric.metric_id)
        .where(StepMetric.run_key == key, StepMetric.seq <= steps[-1][0])
        .order_by(StepMetric.seq, StepMetric.metric_id)
    )
    for seq, name, value in session.execute(q):
        if seq in metrics:
            metrics[seq][name] = math.nan if value is None else value
    return [(seq, StepRecord(step=int(s), metrics=metrics[seq], batch_index=b, time=t)) for seq, s, b, t in steps]


def batch_positions(*, session: Session, run_id: str) -> list[tuple[int, int | None]]:
    """(step, batch_index) of every recorded step, in record order (a step trained again after a rollback
    appears again, with the batch it got then)."""
    q = sa.select(Step.step, Step.batch_index).where(Step.run_key == _run_key(session, run_id)).order_by(Step.seq)
    return [(int(s), None if b is None else int(b)) for s, b in session.execute(q)]


# -- events --------------------------------------------------------------------------------------------------
def load_events(*, session: Session, run_id: str) -> list[Any]:
    """Anomalies, decisions, interventions and outcomes of a run, in the causal order they were written."""
    return [ev for _, ev in load_sequenced_events(session=session, run_id=run_id)]


def load_sequenced_events(*, session: Session, run_id: str) -> list[tuple[int, Any]]:
    """``(seq, event)`` of a run's anomalies, decisions, interventions and outcomes, in record order."""
    found: list[tuple[int, Any]] = []
    for table, model in _EVENT_MODELS.items():
        cols = model.__table__.columns
        for row in session.execute(sa.select(*cols).where(cols.run_id == run_id)).mappings():
            found.append((row["seq"], event_from_row(table, dict(row))))
    found.sort(key=lambda p: p[0])
    return found


@dataclass(frozen=True)
class Pending:
    run_id: str
    run_name: str
    decision: Decision


def pending_answers(*, session: Session, run_id: str | None = None) -> list[Pending]:
    """Proposed decisions that nobody has answered yet, oldest first."""
    cols = DecisionRow.__table__.columns
    q = (
        sa.select(*cols, Run.name.label("run_name"))
        .join(Run, Run.id == cols.run_id)
        .where(cols.status == DecisionStatus.PROPOSED.value, cols.approved.is_(None))
    )
    if run_id is not None:
        q = q.where(cols.run_id == run_id)
    rows = session.execute(q.order_by(cols.run_id, cols.seq)).mappings()
    return [Pending(r["run_id"], r["run_name"], event_from_row("decisions", r)) for r in rows]  # type: ignore[arg-type]


def answer_decision(*, session: Session, run_id: str, decision_id: str, approved: bool, by: str) -> Decision:
    """Record a human's answer to a proposed decision; the monitor picks it up at its next flush.

    The answer is one conditional UPDATE (``WHERE approved IS NULL AND status = 'proposed'``), so of two answers
    given at the same instant, from any number of processes, exactly one wins; the other gets an
    :class:`AnswerError` naming the answer that won."""
    row = session.get(DecisionRow, decision_id)
    if row is None or row.run_id != run_id:
        raise AnswerError(f"run {run_id!r} has no decision {decision_id!r}")
    status = (DecisionStatus.APPROVED if approved else DecisionStatus.REJECTED).value
    result: sa.CursorResult[Any] = session.execute(  # type: ignore[assignment]
        sa.update(DecisionRow)
        .where(
            DecisionRow.id == decision_id,
            DecisionRow.approved.is_(None),
            DecisionRow.status == DecisionStatus.PROPOSED.value,
        )
        .values(approved=approved, answered_by=by, answered_at=_now(), status=status)
        .execution_options(synchronize_session=False)
    )
    session.refresh(row)
    if result.rowcount != 1:
        raise _not_answerable(row)
    return event_from_row("decisions", {c.name: getattr(row, c.name) for c in row.__table__.columns})  # type: ignore[return-value]


def _not_answerable(row: DecisionRow) -> AnswerError:
    """Why the decision in ``row`` (as stored now) cannot take an answer: another answer won, or it is not a
    proposal awaiting one."""
    if row.approved is not None:
        verb = "approved" if row.approved else "rejected"
        return AnswerError(f"decision {row.id!r} was already {verb} by {row.answered_by} at {row.answered_at}")
    return AnswerError(f"decision {row.id!r} is not awaiting an answer (status {row.status})")


def take_answers(*, session: Session, run_id: str) -> list[tuple[str, bool]]:
    """Answers not yet seen by the run's monitor, marking them seen."""
    q = sa.select(DecisionRow).where(
        DecisionRow.run_id == run_id, DecisionRow.approved.is_not(None), DecisionRow.answer_seen.is_(False)
    )
    rows = list(session.scalars(q.order_by(DecisionRow.answered_at)))
    for row in rows:
        row.answer_seen = True
    session.flush()
    return [(r.id, bool(r.approved)) for r in rows]


# -- alerts, checkpoints, skipped batches --------------------------------------------------------------------
def list_alerts(*, session: Session, run_id: str | None = None) -> list[dict[str, Any]]:
    q = sa.select(*AlertRow.__table__.columns)
    if run_id is not None:
        q = q.where(AlertRow.run_id == run_id)
    return [dict(r) for r in session.execute(q.order_by(AlertRow.created_at)).mappings()]


def list_checkpoints(*, session: Session, run_id: str) -> list[dict[str, Any]]:
    q = sa.select(*CheckpointRow.__table__.columns).where(CheckpointRow.run_id == run_id)
    return [
        dict(r) for r in session.execute(q.order_by(CheckpointRow.step, CheckpointRow.created_at)).mappings()
    ]


def skipped_batches(*, session: Session, run_id: str) -> list[tuple[int, int]]:
    """(step, batch_index) pairs skipped in a run."""
    q = sa.select(SkippedBatch.step, SkippedBatch.batch_index).where(SkippedBatch.run_id == run_id)
    return [
        (int(s), int(b)) for s, b in session.execute(q.order_by(SkippedBatch.step, SkippedBatch.batch_index))
    ]


def run_config(*, session: Session, run_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A run's (config, environment), decoded."""
    run = get_run(session=session, run_id=run_id)
    return decode(run.config or {}), decode(run.environment or {})
