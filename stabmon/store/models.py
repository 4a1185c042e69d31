"""SQLAlchemy 2.0 models of stabmon's store. The schema itself is created only by the Alembic migrations.

Per-step metrics are narrow rows ``(run_key, metric_id, seq, step, value)`` with metric names normalised into
``metric_names``. ``seq`` is a per-run ordinal that the store assigns to every record it is handed (steps and
events share one counter), so a run that rolled back and re-trained steps keeps both trajectories, and events
come back in causal order. A NaN metric value is stored as NULL (SQLite cannot hold NaN); an absent metric has
no row.

>>> sorted(Base.metadata.tables)[:3]
['alerts', 'anomalies', 'checkpoints']
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ID = String(64)
NAME = String(255)
SHORT = String(32)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSON, datetime: DateTime(timezone=True)}


def _run_key_fk() -> Any:
    return ForeignKey("runs.key", ondelete="CASCADE")


def _run_fk() -> Any:
    return ForeignKey("runs.id", ondelete="CASCADE")


class Run(Base):
    """A training run: live, a replay of another run, or an import of a third-party log.

    ``id`` is the public identifier; ``key`` is a compact integer used only by the high-volume tables (an
    integer key makes per-step inserts into SQLite markedly faster than a text key).
    """

    __tablename__ = "runs"
    key: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(ID, unique=True)
    name: Mapped[str] = mapped_column(NAME, index=True)
    kind: Mapped[str] = mapped_column(SHORT)  # live | replay | import
    status: Mapped[str] = mapped_column(SHORT)  # running | finished | failed | stopped | ...
    started_at: Mapped[datetime] = mapped_column(index=True)
    ended_at: Mapped[datetime | None]
    config: Mapped[dict[str, Any] | None]
    environment: Mapped[dict[str, Any] | None]
    parent_run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"), index=True)
    source: Mapped[str | None] = mapped_column(Text)
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    """``host:pid:token`` of the store writing the run (see :mod:`stabmon.store.lease`); None: nobody."""
    lease_until: Mapped[float | None] = mapped_column(Float)
    """Unix time the lease lasts until unless its owner renews it."""


class MetricName(Base):
    __tablename__ = "metric_names"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(NAME, unique=True)


class Step(Base):
    """One StepRecord's scalar fields; its metrics are in ``step_metrics`` under the same ``seq``."""

    __tablename__ = "steps"
    __table_args__ = ({"sqlite_with_rowid": False},)
    run_key: Mapped[int] = mapped_column(_run_key_fk(), primary_key=True, autoincrement=False)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    step: Mapped[int] = mapped_column(BigInteger)
    batch_index: Mapped[int | None] = mapped_column(BigInteger)
    time: Mapped[float | None] = mapped_column(Float)


class StepMetric(Base):
    """One metric value of one step. The primary key serves "one metric of a run over steps" directly.

    No foreign keys, on purpose: PostgreSQL checks them with a trigger per row, which cut its insert rate
    about three-fold. Rows are only ever written in the same transaction as their ``steps`` row (which has
    the foreign key to ``runs``) and after their ``metric_names`` row.
    """

    __tablename__ = "step_metrics"
    __table_args__ = ({"sqlite_with_rowid": False},)
    run_key: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    metric_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    step: Mapped[int] = mapped_column(BigInteger)
    value: Mapped[float | None] = mapped_column(Float)  # NULL = NaN


class AnomalyRow(Base):
    __tablename__ = "anomalies"
    __table_args__ = (
        Index("ix_anomalies_run_id_seq", "run_id", "seq"),
        Index("ix_anomalies_run_id_step", "run_id", "step"),
    )
    id: Mapped[str] = mapped_column(ID, primary_key=True)
    run_id: Mapped[str] = mapped_column(_run_fk())
    seq: Mapped[int] = mapped_column(BigInteger)
    step: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(64))
    metric: Mapped[str] = mapped_column(NAME)
    score: Mapped[float | None] = mapped_column(Float)
    severity: Mapped[str] = mapped_column(SHORT)
    detector: Mapped[str] = mapped_column(NAME)
    threshold: Mapped[float | None] = mapped_column(Float)
    message: Mapped[str] = mapped_column(Text)
    evidence: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class DecisionRow(Base):
    """A runbook decision; ``answered_*`` / ``approved`` record a human's answer in propose mode and
    ``answer_seen`` whether the monitor has picked that answer up."""

    __tablename__ = "decisions"
    __table_args__ = (
        Index("ix_decisions_run_id_seq", "run_id", "seq"),
        Index("ix_decisions_run_id_status", "run_id", "status"),
    )
    id: Mapped[str] = mapped_column(ID, primary_key=True)
    run_id: Mapped[str] = mapped_column(_run_fk())
    seq: Mapped[int] = mapped_column(BigInteger)
    step: Mapped[int] = mapped_column(BigInteger)
    action: Mapped[str] = mapped_column(String(64))
    params: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(SHORT)
    runbook: Mapped[str] = mapped_column(NAME)
    rule: Mapped[str] = mapped_column(NAME)
    rung: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(Text)
    anomaly_id: Mapped[str | None] = mapped_column(ID, index=True)
    incident_id: Mapped[str | None] = mapped_column(ID, index=True)
    approved: Mapped[bool | None] = mapped_column(Boolean)
    answered_by: Mapped[str | None] = mapped_column(NAME)
    answered_at: Mapped[datetime | None]
    answer_seen: Mapped[bool] = mapped_column(Boolean, default=False)


class InterventionRow(Base):
    __tablename__ = "interventions"
    __table_args__ = (Index("ix_interventions_run_id_seq", "run_id", "seq"),)
    id: Mapped[str] = mapped_column(ID, primary_key=True)
    run_id: Mapped[str] = mapped_column(_run_fk())
    seq: Mapped[int] = mapped_column(BigInteger)
    decision_id: Mapped[str] = mapped_column(ID, index=True)
    step: Mapped[int] = mapped_column(BigInteger)
    action: Mapped[str] = mapped_column(String(64))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    reverted: Mapped[bool] = mapped_column(Boolean)
    simulated: Mapped[bool] = mapped_column(Boolean)


class OutcomeRow(Base):
    __tablename__ = "outcomes"
    __table_args__ = (Index("ix_outcomes_run_id_seq", "run_id", "seq"),)
    id: Mapped[str] = mapped_column(ID, primary_key=True)
    run_id: Mapped[str] = mapped_column(_run_fk())
    seq: Mapped[int] = mapped_column(BigInteger)
    intervention_id: Mapped[str | None] = mapped_column(ID, index=True)
    decision_id: Mapped[str] = mapped_column(ID, index=True)
    step: Mapped[int] = mapped_column(BigInteger)
    verdict: Mapped[str] = mapped_column(SHORT)
    evidence: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    incident_id: Mapped[str | None] = mapped_column(ID, index=True)


class AlertRow(Base):
    """One alert to one channel, updated after every delivery attempt. ``channel`` is stored redacted.

    ``run_id`` is deliberately not a foreign key: alerts are written by the notifier's own threads, which may
    run ahead of the store's queued run row."""

    __tablename__ = "alerts"
    __table_args__ = (Index("ix_alerts_run_id_created_at", "run_id", "created_at"),)
    id: Mapped[str] = mapped_column(ID, primary_key=True)
    run_id: Mapped[str | None] = mapped_column(ID)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    channel: Mapped[str] = mapped_column(Text)
    severity: Mapped[str] = mapped_column(SHORT)
    status: Mapped[str] = mapped_column(SHORT)  # queued | sent | failed | suppressed | deduplicated
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    dedup_key: Mapped[str | None] = mapped_column(NAME, index=True)
    incident_id: Mapped[str | None] = mapped_column(ID, index=True)
    event_id: Mapped[str | None] = mapped_column(ID)
    title: Mapped[str] = mapped_column(Text, default="")


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (Index("ix_checkpoints_run_id_step", "run_id", "step"),)
    id: Mapped[str] = mapped_column(ID, primary_key=True)
    run_id: Mapped[str] = mapped_column(_run_fk())
    step: Mapped[int] = mapped_column(BigInteger)
    path: Mapped[str] = mapped_column(Text)
    nbytes: Mapped[int] = mapped_column(BigInteger)
    valid: Mapped[bool] = mapped_column(Boolean)
    created_at: Mapped[datetime]


class SkippedBatch(Base):
    __tablename__ = "skipped_batches"
    run_id: Mapped[str] = mapped_column(_run_fk(), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    batch_index: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
