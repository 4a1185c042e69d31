"""A batch of queued writes, its JSON form for the spool, and the idempotent SQL that writes it.

Every insert is "insert or ignore" on a natural key (run id + seq, event id, ...), so writing a batch twice (a
spool replayed after a commit whose acknowledgement was lost) leaves exactly one copy. Decisions are upserted
so that a later status of the same decision (proposed -> approved -> applied) wins. Per-step metrics go
through the raw DBAPI cursor: ``executemany`` on SQLite, binary ``COPY`` on PostgreSQL (falling back to
``COPY`` into a temporary table then ``INSERT ... ON CONFLICT DO NOTHING`` when the batch was partly written
before).

>>> b = Batch(hi=3); b.steps.append(("r", 1, 0, None, None, {"loss": float("nan")}))
>>> Batch.from_json(b.to_json()).steps[0][5]["loss"]
nan
>>> b.rows()
2
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from stabmon.store.models import Base, MetricName

# (run_id, seq, step, batch_index, time, {metric: value})
StepTuple = tuple[str, int, int, int | None, float | None, dict[str, float]]

_TIME_FIELDS = ("started_at", "ended_at", "created_at", "updated_at")


def to_datetime(t: float | None) -> datetime | None:
    return None if t is None else datetime.fromtimestamp(t, tz=timezone.utc)


def _scalar(value: Any) -> Any:
    """numpy / torch scalars that slipped into a record: their Python value."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot spool a {type(value).__name__}")


@dataclass
class Batch:
    """Writes taken from the queue together. ``hi`` is the highest queue ticket they cover."""

    hi: int
    runs: list[dict[str, Any]] = field(default_factory=list)
    steps: list[StepTuple] = field(default_factory=list)
    events: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[tuple[str, int, int]] = field(default_factory=list)
    run_updates: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    alert_updates: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def rows(self) -> int:
        """Rows this batch writes (one per step plus one per metric value, and one per other row)."""
        n = sum(1 + len(s[5]) for s in self.steps)
        n += sum(len(v) for v in self.events.values())
        n += len(self.alerts) + len(self.alert_updates)
        return n + len(self.runs) + len(self.checkpoints) + len(self.skipped) + len(self.run_updates)

    def top_seq(self, run_id: str) -> int:
        """The highest sequence number this batch holds for ``run_id`` (-1 when none)."""
        seqs = [s[1] for s in self.steps if s[0] == run_id]
        seqs += [r["seq"] for rows in self.events.values() for r in rows if r.get("run_id") == run_id]
        return max(seqs, default=-1)

    def split(self) -> list[Batch]:
        """One batch per step record / event / other group, in write order (to isolate a row the database
        refuses)."""
        parts = [Batch(self.hi, runs=self.runs)] if self.runs else []
        parts += [Batch(self.hi, steps=[s]) for s in self.steps]
        parts += [Batch(self.hi, events={t: [r]}) for t, rows in self.events.items() for r in rows]
        if self.checkpoints or self.skipped or self.run_updates or self.alerts or self.alert_updates:
            parts.append(
                Batch(
                    self.hi, checkpoints=self.checkpoints, skipped=self.skipped, run_updates=self.run_updates,
                    alerts=self.alerts, alert_updates=self.alert_updates,
                )
            )
        return parts

    def to_json(self) -> str:
        # NaN/inf in metrics are written as JSON's NaN/Infinity tokens, which Python's json reads back.
        return json.dumps(
            {
                "hi": self.hi,
                "runs": self.runs,
                "steps": self.steps,
                "events": self.events,
                "checkpoints": self.checkpoints,
                "skipped": self.skipped,
                "run_updates": self.run_updates,
                "alerts": self.alerts,
                "alert_updates": self.alert_updates,
            },
            separators=(",", ":"),
            default=_scalar,
        )

    @classmethod
    def from_json(cls, text: str) -> Batch:
        d = json.loads(text)
        return cls(
            hi=d["hi"],
            runs=d["runs"],
            steps=[tuple(s) for s in d["steps"]],
            events=d["events"],  # type: ignore[misc]
            checkpoints=d["checkpoints"],
            skipped=[tuple(s) for s in d["skipped"]],  # type: ignore[misc]
            run_updates=[tuple(u) for u in d["run_updates"]],  # type: ignore[misc]
            alerts=d.get("alerts", []),
            alert_updates=[tuple(u) for u in d.get("alert_updates", [])],  # type: ignore[misc]
        )


class NameCache(dict[str, int]):
    """metric name -> id (and run id -> run key), filled from the database on first use inside the writer's
    transaction. Cleared when a transaction fails, since ids inserted by it were rolled back.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conn: sa.Connection | None = None
        self.run_keys: dict[str, int] = {}

    def __missing__(self, name: str) -> int:
        assert self.conn is not None, "NameCache used outside a write"
        table = MetricName.__table__
        self.conn.execute(_insert_ignore(self.conn, table).values(name=name))
        mid = self.conn.execute(sa.select(table.c.id).where(table.c.name == name)).scalar_one()
        self[name] = mid
        return mid

    def run_key(self, run_id: str) -> int:
        """The integer key of a run that must already exist (its row is written before its steps)."""
        key = self.run_keys.get(run_id)
        if key is None:
            assert self.conn is not None, "NameCache used outside a write"
            runs = Base.metadata.tables["runs"]
            key = self.conn.execute(sa.select(runs.c.key).where(runs.c.id == run_id)).scalar_one()
            self.run_keys[run_id] = key
        return key

    def clear(self) -> None:
        super().clear()
        self.run_keys.clear()


def _insert_ignore(conn: sa.Connection, table: Any, upsert: tuple[str, ...] = ()) -> Any:
    mod = postgresql if conn.dialect.name == "postgresql" else sqlite
    stmt = mod.insert(table)
    if upsert:
        return stmt.on_conflict_do_update(
            index_elements=["id"], set_={c: getattr(stmt.excluded, c) for c in upsert}
        )
    return stmt.on_conflict_do_nothing()


def _timed(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (to_datetime(v) if k in _TIME_FIELDS else v) for k, v in row.items()}


def write_batch(conn: sa.Connection, batch: Batch, names: NameCache) -> None:
    """Write ``batch`` inside the caller's transaction. Idempotent."""
    tables = Base.metadata.tables
    if batch.runs:
        conn.execute(_insert_ignore(conn, tables["runs"]), [_timed(r) for r in batch.runs])
    if batch.steps:
        _write_steps(conn, batch.steps, names)
    for table, rows in batch.events.items():
        upsert = ("status", "params", "reason") if table == "decisions" else ()
        rows = list({r["id"]: r for r in rows}.values()) if upsert else rows  # one row per id per statement
        _refuse_collisions(conn, tables[table], rows)
        conn.execute(_insert_ignore(conn, tables[table], upsert), rows)
    if batch.checkpoints:
        conn.execute(_insert_ignore(conn, tables["checkpoints"]), [_timed(r) for r in batch.checkpoints])
    if batch.skipped:
        rows = [{"run_id": r, "step": s, "batch_index": b} for r, s, b in batch.skipped]
        conn.execute(_insert_ignore(conn, tables["skipped_batches"]), rows)
    runs = tables["runs"]
    for run_id, values in batch.run_updates:
        conn.execute(sa.update(runs).where(runs.c.id == run_id).values(**_timed(values)))
    alerts = tables["alerts"]
    if batch.alerts:
        conn.execute(_insert_ignore(conn, alerts), [_timed(r) for r in batch.alerts])
    for alert_id, values in batch.alert_updates:
        conn.execute(sa.update(alerts).where(alerts.c.id == alert_id).values(**_timed(values)))


class IdCollisionError(ValueError):
    """An event id already names a different event in the store (refused, so never dropped silently)."""


# what must match between a stored event and one written again under its id (a replay, a later status)
_SAME = {"decisions": ("run_id", "anomaly_id", "rule", "rung", "action")}


def _refuse_collisions(conn: sa.Connection, table: Any, rows: list[dict[str, Any]]) -> None:
    keys = _SAME.get(table.name, ("run_id", "seq"))
    by_id = {r["id"]: r for r in rows}
    cols = [table.c.id, *(table.c[k] for k in keys)]
    for stored in conn.execute(sa.select(*cols).where(table.c.id.in_(list(by_id)))):
        mine = by_id[stored[0]]
        if any(mine.get(k) != v for k, v in zip(keys, stored[1:], strict=True)):
            raise IdCollisionError(
                f"{table.name} id {stored[0]!r} already names another event "
                f"({dict(zip(keys, stored[1:], strict=True))}, not {({k: mine.get(k) for k in keys})})"
            )


def _write_steps(conn: sa.Connection, steps: list[StepTuple], names: NameCache) -> None:
    keys = {r: names.run_key(r) for r in {s[0] for s in steps}}
    step_rows = [(keys[r], q, s, b, t) for r, q, s, b, t, _ in steps]
    metric_rows = [
        (keys[r], names[n], q, s, None if v != v else float(v))
        for r, q, s, _b, _t, m in steps
        for n, v in m.items()
    ]
    if conn.dialect.name == "postgresql":
        _copy_ignore(conn, "steps", "run_key, seq, step, batch_index, time", step_rows)
        _copy_ignore(conn, "step_metrics", "run_key, metric_id, seq, step, value", metric_rows)
        return
    ph = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    conn.exec_driver_sql(
        f"INSERT INTO steps (run_key, seq, step, batch_index, time) VALUES ({ph}, {ph}, {ph}, {ph}, {ph}) "
        "ON CONFLICT DO NOTHING",
        step_rows,  # type: ignore[arg-type]
    )
    if metric_rows:
        conn.exec_driver_sql(
            "INSERT INTO step_metrics (run_key, metric_id, seq, step, value) "
            f"VALUES ({ph}, {ph}, {ph}, {ph}, {ph}) "
            "ON CONFLICT DO NOTHING",
            metric_rows,  # type: ignore[arg-type]
        )


_PG_TYPES = {
    "steps": ["int4", "int8", "int8", "int8", "float8"],
    "step_metrics": ["int4", "int4", "int8", "int8", "float8"],
}


def _copy_ignore(conn: sa.Connection, table: str, columns: str, rows: list[tuple[Any, ...]]) -> None:
    """PostgreSQL: binary COPY straight into ``table``; if some rows are already there (a replayed batch),
    undo that and COPY into a session temp table, then insert only what is missing."""
    if not rows:
        return
    import psycopg

    raw: Any = conn.connection.driver_connection
    with raw.cursor() as cur:
        cur.execute("SAVEPOINT stabmon_copy")
        try:
            _copy(cur, table, columns, rows, table)
            cur.execute("RELEASE SAVEPOINT stabmon_copy")
            return
        except psycopg.errors.UniqueViolation:
            cur.execute("ROLLBACK TO SAVEPOINT stabmon_copy")
        tmp = f"_stabmon_{table}"
        cur.execute(f"CREATE TEMP TABLE IF NOT EXISTS {tmp} (LIKE {table}) ON COMMIT DELETE ROWS")
        _copy(cur, tmp, columns, rows, table)
        cur.execute(f"INSERT INTO {table} ({columns}) SELECT {columns} FROM {tmp} ON CONFLICT DO NOTHING")
        cur.execute(f"TRUNCATE {tmp}")


def _copy(cur: Any, target: str, columns: str, rows: list[tuple[Any, ...]], table: str) -> None:
    with cur.copy(f"COPY {target} ({columns}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types(_PG_TYPES[table])
        for row in rows:
            copy.write_row(row)
