"""A hung fleet: every rank's stacks reach the store before the job goes down, and the culprit is named.

Rank 1 is stuck in its own Python code; rank 0 waits for it in an ``all_reduce``. Rank 0's deadline is 2 s,
rank 1's 60 s (as if its steps had been slow): before, rank 0 reported and exited and rank 1's stacks (the ones
that say why) were never stored (under torchrun the agent then terminated it). Now rank 0's report rings an
alarm in the job's c10d store, rank 1 reports at once, rank 0 waits for it before exiting, and ``stabmon
trace`` (and the report's trace table) names rank 1 as the culprit."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_support import exit_codes
from test_monitor_hang import _train
from typer.testing import CliRunner

from stabmon.cli import app
from stabmon.collect.config import HANG_EXIT_CODE
from stabmon.report import load_report
from stabmon.store import open_store, repo

FLOORS = (2.0, 60.0)  # rank 1's own deadline is far past the test's 45 s


@pytest.mark.slow
def test_every_ranks_stacks_are_stored_and_the_culprit_is_named(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'stabmon.db'}"
    codes = exit_codes(_train, 2, url, "", FLOORS, timeout=45)  # test_monitor_hang's job, other deadlines
    assert codes == [HANG_EXIT_CODE, HANG_EXIT_CODE]  # rank 1 too, well before its own 60 s
    store = open_store(url)
    try:
        with store.session() as s:
            (run,) = repo.list_runs(session=s)
            hangs = [e for e in repo.load_events(session=s, run_id=run.id) if getattr(e, "kind", "") == "hang"]
            report = load_report(session=s, run_id=run.id)
    finally:
        store.close()
    assert sorted(a.message.split(":")[0] for a in hangs) == ["rank 0", "rank 1"]
    (culprit,) = [a for a in hangs if a.message.startswith("rank 1")]
    assert "a peer rank is hung" in culprit.message and "stuck_in_python" in culprit.message
    trace = CliRunner().invoke(app, ["trace", "latest", "--db", url])
    assert trace.exit_code == 0, trace.output
    assert "hang  culprit rank 1: its main thread is not in a collective" in trace.output, trace.output
    assert "rank 0     no step for" in trace.output and "waiting in a collective" in trace.output
    assert "0 anomaly(ies) without an incident" in trace.output  # the hang is in the trace, not left over
    rows = [(r.incident, r.stage) for r in report.trace]
    assert ("hang", "rank 1 (the culprit)") in rows and ("hang", "rank 0") in rows
