"""Edges fault injection found: `stabmon diff` with infinities and with nothing to compare; JSON-lines problems
reported at their own line; apprise's debug log showing token fragments; a hugely negative loss."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

from fault_support import report
from typer.testing import CliRunner

from stabmon.cli import app
from stabmon.detect.suite import DetectorSuite
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
            assert out["metrics"]["loss"]["rel_diff"] == "inf"  # not inf / inf
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


def _import_jsonl(tmp_path: Path, lines: list[str]) -> dict:
    path = tmp_path / "badstr.jsonl"
    path.write_text("\n".join(lines) + "\n")
    res = runner.invoke(app, ["import", str(path), "--run", "r", "--db", f"sqlite:///{tmp_path / 'imp.db'}", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_jsonl_problems_are_reported_at_their_own_line(tmp_path: Path) -> None:
    out = _import_jsonl(tmp_path, ['{"step": 1, "loss": 2.5}', '{"step": 2, "loss": "oops"}', "", "not json",
                                   '{"step": 5, "loss": 2.4}'])
    problems = " | ".join(out["problems"])
    assert "badstr.jsonl:2: loss: not a number" in problems, problems  # before: badstr.jsonl:3
    assert "badstr.jsonl:4: not a JSON object" in problems, problems  # before: badstr.jsonl:?
    report("jsonl line numbers", problems=len(out["problems"]), lines="2,4")


def test_a_jsonl_line_nested_too_deep_costs_only_itself(tmp_path: Path) -> None:
    deep = '{"a": ' * 10_000 + "1" + "}" * 10_000
    out = _import_jsonl(tmp_path, ['{"step": 1, "loss": 2.5}', deep, '{"step": 3, "loss": 2.4}'])
    assert (out["records"], out["malformed"]) == (2, 1), out  # before: a one-line error, every record lost
    assert "badstr.jsonl:2: not a JSON object" in " | ".join(out["problems"])
    report("jsonl nested 10k deep", records_kept="2/2", malformed=1)


_APPRISE_DEBUG = """
import logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout)
import apprise
from stabmon.alerts.config import ChannelConfig
from stabmon.alerts.delivery import Channel
url = sys.argv[1]
Channel(ChannelConfig(url=url), timeout=0.2)
apprise.Apprise.instantiate(url)  # as a send does
logging.getLogger("apprise").debug("probe")  # shown only while apprise's logger is at DEBUG
"""


def test_apprise_debug_log_shows_no_token_fragment(tmp_path: Path) -> None:
    tokens = ("T1234ABCD", "B5678EFGH", "abcdefghijklmnopqrstuvwx")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _APPRISE_DEBUG, "slack://" + "/".join(tokens)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    log = done.stdout + done.stderr
    fragments = [f"{t[0]}...{t[-1]}" for t in tokens] + list(tokens)
    assert not [f for f in fragments if f in log], log[-2000:]
    assert "probe" not in log
    report("apprise debug log", lines=len(log.splitlines()), token_fragments=0)


def test_a_hugely_negative_loss_is_an_anomaly() -> None:
    flagged = []
    for seed in range(10):  # every seed: the fault is far past the edge
        rng = random.Random(seed)
        suite = DetectorSuite()
        found = []
        for step in range(300):
            loss = (2.3 + 1.7 * math.exp(-step / 50)) * math.exp(rng.gauss(0.0, 0.02))  # falls to 2.3
            found += suite.update(StepRecord(step, {"loss": loss}))
        assert found == [], found  # a healthy loss raises nothing
        small = suite.update(StepRecord(300, {"loss": -1.0}))  # smaller than the loss itself: not observed
        big = suite.update(StepRecord(301, {"loss": -230.0}))
        assert small == [] and [(a.kind, a.metric, a.step) for a in big] == [("spike", "loss", 301)], big
        assert big[0].severity.value in ("warning", "error")
        flagged.append(big[0].severity.value)
    report("negative loss", seeds=10, flagged=len(flagged), severities=",".join(sorted(set(flagged))))
