"""Reading a run's recorded metrics back in tests."""

from __future__ import annotations


def metrics_by_step(url: str, run_id: str) -> dict[int, dict[str, float]]:
    """Every stored metric of a run, by step (a step recorded twice, as after a rollback, keeps the last)."""
    from stabmon.store import open_store
    from stabmon.store.repo import load_steps

    store = open_store(url)
    try:
        with store.session() as session:
            records = load_steps(session=session, run_id=run_id)
    finally:
        store.close()
    return {r.step: dict(r.metrics) for r in records}
