"""A stored run's report data, read through the store's repository functions."""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy.orm import Session

from stabmon.report.model import ReportData, RunInfo, build_report


def load_report(*, session: Session, run_id: str, buckets: int = 1000) -> ReportData:
    """Report data of the stored run ``run_id``: its metrics, events and environment fingerprint.

    A replay or import records no environment of its own; its parent's is shown when it has one."""
    from stabmon.store import repo

    run = repo.get_run(session=session, run_id=run_id)
    _, environment = repo.run_config(session=session, run_id=run_id)
    if not environment and run.parent_run_id:
        _, environment = repo.run_config(session=session, run_id=run.parent_run_id)
    info = RunInfo(id=run.id, name=run.name, kind=run.kind, status=run.status, source=run.source,
                   parent_run_id=run.parent_run_id)
    metrics = repo.get_metrics(session=session, run_id=run_id)
    events = repo.load_events(session=session, run_id=run_id)
    data = build_report(metrics, events, run=info, environment=environment, buckets=buckets)
    return dataclasses.replace(data, goodput=_ledger(session, run_id))


def _ledger(session: Session, run_id: str) -> Any:
    """The run's goodput ledger, or None when its steps carry no times (an imported log)."""
    from stabmon.goodput import compute_ledger, load_input

    ledger = compute_ledger(load_input(session=session, run_id=run_id))
    return ledger if ledger.wall_seconds > 0 else None
