"""Edges fault injection found: `stabmon diff` with infinities and with nothing to compare."""

from __future__ import annotations

import json
import math

from fault_support import report
from typer.testing import CliRunner

from stabmon.cli import app
from stabmon.events import StepRecord
from stabmon.store import open_store

runner = CliRunner()
INF = math.inf


def _runs(url: str, runs: dict[str, list[tuple[int, float]]]) -> None:
    with open_store(url) as store:
        for name, points in runs.items():
            run = store.start_run(name=name, environment={})
            store.write_steps(run_id=run, records=[StepRecord(step=s, metrics={"loss": v}) for s, v in points])
        assert store.flush(20)


def _diff(url: str, a: str, b: str, *args: str) -> tuple[int, dict]:
    res = runner.invoke(app, ["diff", a, b, "--json", "--db", url, *args])
    return res.exit_code, json.loads(res.stdout)


def test_diff_compares_infinities_by_identity_under_every_tolerance(sqlite_url: str) -> None:
    _runs(sqlite_url, {"pinf": [(0, 1.0), (1, INF)], "one": [(0, 1.0), (1, 1.0)], "minf": [(0, 1.0), (1, -INF)],
                       "pinf2": [(0, 1.0), (1, INF)]})
    tolerances = (["--preset", "tight"], ["--preset", "loose"], ["--rtol", "1"], ["--rtol", "1e9", "--atol", "1e9"])
    for tol in tolerances:
        for other in ("one", "minf"):
            code, out = _diff(sqlite_url, "pinf", other, *tol)
            assert (code, out["first_divergence"], out.get("verdict")) == (0, 1, "diverge"), (tol, other, out)
            assert out["metrics"]["loss"]["b"] == (1.0 if other == "one" else "-inf")
        code, out = _diff(sqlite_url, "pinf", "pinf2", *tol)
        assert (code, out["verdict"], out["compared"]) == (0, "agree", 2), (tol, out)
    report("diff infinities", tolerances=len(tolerances), inf_vs_finite="diverge", inf_vs_minus_inf="diverge")


def test_diff_with_nothing_to_compare_is_its_own_verdict(sqlite_url: str) -> None:
    _runs(sqlite_url, {"early": [(s, 1.0) for s in range(5)], "late": [(s, 1.0) for s in range(10, 15)],
                       "empty": []})
    for a, b in (("early", "late"), ("early", "empty"), ("empty", "empty")):
        code, out = _diff(sqlite_url, a, b)
        assert (code, out.get("verdict"), out.get("compared")) == (3, "no-overlap", 0), out
        text = runner.invoke(app, ["diff", a, b, "--db", sqlite_url])
        assert text.exit_code == 3 and "agree" not in text.stdout, text.stdout
        assert "nothing to compare: the runs share no step" in text.stdout
    report("diff no overlap", exit_code=3, verdict="no-overlap")
