"""The goodput ledger: a run built with each badput cause injected for a known number of seconds gets every
cause back within 1%, and the causes add up to the wall time; a monitored loop with a rollback and a
Ctrl-C/resume gets the rollback's re-trained steps and the restart gap."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from stabmon.cli import app
from stabmon.events import Anomaly, InterventionRecord, Metric, Severity, StepRecord
from stabmon.goodput import CAUSES, compute_ledger, load_input
from stabmon.store import open_store

STEP, FLUSH = 1.0, 0.5  # every step takes 1 s, every gap between steps holds a 0.5 s flush


class Timeline:
    """A run written step by step on a synthetic clock, with known badput."""

    def __init__(self, store: Any, run_id: str, start: float) -> None:
        self.store, self.run_id, self.clock = store, run_id, start

    def step(self, n: int, *, before: float = FLUSH, seconds: float = STEP, **metrics: float) -> None:
        """Step ``n`` starts ``before`` seconds after the previous one ended and takes ``seconds``."""
        self.clock += before + seconds
        record = StepRecord(step=n, metrics={Metric.STEP_TIME: seconds, Metric.LOSS: 1.0, **metrics}, time=self.clock)
        self.store.write_steps(run_id=self.run_id, records=[record])

    def event(self, event: Any) -> None:
        self.store.write_events(run_id=self.run_id, events=[event])


INJECTED = {"startup": 3.0, "checkpoint": 2.0 + 4.0, "outside_steps": 6.0, "skipped_update": STEP,
            "rollback": 8.0 + 4 * (STEP + FLUSH), "hang": 30.0, "restart": 20.0}


def build(url: str) -> str:
    store = open_store(url)
    run_id = store.start_run(name="constructed")
    t0 = 1_000_000.0
    tl = Timeline(store, run_id, t0)
    tl.step(0, before=3.0 + 2.0, **{Metric.SEGMENT_START: t0, Metric.CHECKPOINT_TIME: 2.0})  # start-up, first save
    for n in range(1, 10):
        if n == 3:
            tl.step(n, seconds=STEP + 6.0, **{Metric.OUTSIDE_TIME: 6.0, Metric.VAL_LOSS: 1.0})  # an evaluation
        elif n == 4:
            tl.step(n, **{Metric.SKIPPED: 1.0})  # the skip guard discarded this update
        elif n == 5:
            tl.step(n, before=FLUSH + 4.0, **{Metric.CHECKPOINT_TIME: 4.0})  # a 4 s save before step 5
        else:
            tl.step(n)
    tl.event(InterventionRecord(decision_id="d1", step=9, action="rollback", before={"step": 10},
                                after={"checkpoint_step": 6}))  # steps 6-9 (4 x (1 s + a flush)) abandoned
    for n in range(6, 15):
        tl.step(n, before=8.0 if n == 6 else FLUSH)  # 8 s restoring the checkpoint
    tl.event(Anomaly(kind="hang", metric="step", step=14, score=30.0, severity=Severity.ERROR, detector="hang"))
    restart_at = tl.clock + 30.0 + 15.0
    tl.step(15, before=30.0 + 20.0, **{Metric.SEGMENT_START: restart_at})  # hung 30 s, then 20 s to restart
    for n in range(16, 20):
        tl.step(n)
    store.flush()
    store.close()  # the run is left "running": no end time, the ledger ends at the last step
    return run_id


def test_each_injected_cause_comes_back_within_one_percent(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'g.db'}"
    run_id = build(url)
    store = open_store(url)
    with store.session() as s:
        ledger = compute_ledger(load_input(session=s, run_id=run_id))
    store.close()
    for cause, seconds in INJECTED.items():
        assert ledger.cause(cause).seconds == pytest.approx(seconds, rel=0.01), cause
    kept = 20 - 1  # steps 0-19 kept, step 4's update skipped
    assert ledger.cause("productive").seconds == pytest.approx(kept * STEP, rel=0.01)
    assert ledger.cause("productive").steps == kept and ledger.cause("rollback").steps == 4
    # flushes: 19 gaps between the 24 records, minus the rollback's and the restart's gaps (booked there)
    assert ledger.cause("monitor").seconds == pytest.approx((23 - 2) * FLUSH - 4 * FLUSH, rel=0.01)
    assert sum(c.seconds for c in ledger.causes) == pytest.approx(ledger.wall_seconds, rel=1e-9)
    assert ledger.segments == 2
    assert ledger.goodput == pytest.approx(kept * STEP / ledger.wall_seconds)


def test_the_cli_prints_the_ledger_and_its_json(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'g.db'}"
    build(url)
    res = CliRunner().invoke(app, ["goodput", "constructed", "--db", url, "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert set(data["causes"]) == set(CAUSES) and data["causes"]["hang"]["seconds"] == pytest.approx(30.0)
    res = CliRunner().invoke(app, ["goodput", "constructed", "--db", url])
    assert res.exit_code == 0 and "goodput" in res.stdout and "rollback" in res.stdout
    res = CliRunner().invoke(app, ["goodput", "nope", "--db", url])
    assert res.exit_code == 1 and "nope" in res.output


def test_the_report_has_a_goodput_section(tmp_path: Path) -> None:
    from stabmon.report import load_report, render_html

    url = f"sqlite:///{tmp_path / 'g.db'}"
    run_id = build(url)
    store = open_store(url)
    with store.session() as s:
        data = load_report(session=s, run_id=run_id)
    store.close()
    page = render_html(data)
    assert "<h2 id='goodput'>Goodput</h2>" in page and "data-cause='hang'" in page
    assert f"goodput <b>{100 * data.goodput.goodput:.1f}%</b>" in page


def test_a_log_without_step_times_has_no_ledger() -> None:
    from stabmon.goodput import LedgerInput, Timed

    steps = [Timed(seq=s, record=StepRecord(step=s, metrics={Metric.LOSS: 1.0})) for s in range(5)]
    ledger = compute_ledger(LedgerInput(run_id="imported", steps=steps))
    assert ledger.wall_seconds == 0 and all(c.seconds == 0 for c in ledger.causes)


def test_a_fleet_run_shows_per_rank_straggler_seconds() -> None:
    """Rank 1 the slowest by 1.5x of a 0.2 s median in 10 steps, rank 0 by 1.1x in 10: 1.0 s and 0.2 s."""
    from stabmon.goodput import LedgerInput, Timed

    steps = []
    for s in range(20):
        rank, ratio = (1.0, 1.5) if s % 2 else (0.0, 1.1)
        metrics = {Metric.STEP_TIME: 0.3, Metric.FLEET_STEP_TIME: 0.2, Metric.STRAGGLER_RANK: rank,
                   Metric.STRAGGLER_RATIO: ratio}
        steps.append(Timed(seq=s, record=StepRecord(step=s, metrics=metrics, time=0.3 * (s + 1))))
    ledger = compute_ledger(LedgerInput(run_id="fleet", steps=steps))
    assert ledger.stragglers == pytest.approx({0: 0.2, 1: 1.0})
    assert ledger.to_dict()["stragglers"] == pytest.approx({"0": 0.2, "1": 1.0})
