"""``stabmon events RUN [--json]`` reads the anomalies stored for a run."""

from __future__ import annotations

import json
import math

from typer.testing import CliRunner

from stabmon.cli import app
from stabmon.detect import DetectorSuite
from stabmon.events import Metric, StepRecord
from stabmon.store import open_store


def _stored_run(url: str) -> str:
    suite = DetectorSuite.from_config(overrides={"spike.grace_period": 1, "robust_spike.grace_period": 1})
    records = [StepRecord(step=s, metrics={Metric.LOSS: 2.0, Metric.GRAD_NORM: g})
               for s, g in enumerate([0.25, 0.25, 0.26, 4.0, 30.0, 200.0])]
    records.append(StepRecord(step=6, metrics={Metric.LOSS: math.nan, Metric.GRAD_NORM: 0.3}))
    store = open_store(url)
    run_id = store.start_run(name="unstable", kind="replay", environment={})
    store.write_steps(run_id=run_id, records=records)
    store.write_events(run_id=run_id, events=[a for r in records for a in suite.update(r)])
    store.close()
    return run_id


def test_events_table_and_json(sqlite_url: str) -> None:
    run_id = _stored_run(sqlite_url)
    runner = CliRunner()
    out = runner.invoke(app, ["events", run_id, "--db", sqlite_url])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0].startswith(f"run {run_id} (unstable): 4 anomalies")
    assert "spike" in lines[2] and "grad_norm" in lines[2] and lines[2].split()[0] == "3"
    assert "warning" in lines[-1] and "nonfinite" in lines[-1]  # one NaN: a warning until it persists

    out = runner.invoke(app, ["events", "unstable", "--db", sqlite_url, "--json", "--min-severity", "warning"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["run_id"] == run_id
    got = [(a["step"], a["kind"], a["severity"]) for a in data["anomalies"]]
    # the grad norm alone (16x, 120x, 800x its 0.25 baseline) and one NaN loss: warnings, nothing that pages
    assert got == [(3, "spike", "warning"), (4, "spike", "warning"), (5, "spike", "warning"),
                   (6, "nonfinite", "warning")]
    assert data["anomalies"][2]["evidence"][-1] == [5, 200.0]
    out = runner.invoke(app, ["events", "unstable", "--db", sqlite_url, "--json", "--min-severity", "error"])
    assert out.exit_code == 0 and json.loads(out.output)["anomalies"] == []

    out = runner.invoke(app, ["events", run_id, "--db", sqlite_url, "--kind", "spike", "--evidence"])
    assert out.exit_code == 0 and "evidence: 0:0.25" in out.output


def test_events_user_errors(sqlite_url: str) -> None:
    _stored_run(sqlite_url)
    runner = CliRunner()
    out = runner.invoke(app, ["events", "nope", "--db", sqlite_url])
    assert out.exit_code == 1 and "no run matches 'nope'" in out.output
    out = runner.invoke(app, ["events", "unstable", "--db", sqlite_url, "--min-severity", "loud"])
    assert out.exit_code == 1 and "--min-severity must be one of" in out.output
