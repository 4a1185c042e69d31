"""The loss-regression detector after a rollback: judged against the best the run had reached before the step it went
back to, not against the best of the steps the rollback undid.

A restart from step 0 (the ``not_learning`` rule's answer to a run that does not learn) trains the early steps again,
whose loss is of course above the best reached later; judged against that best, every such restart was a
"regression" 20 steps in, and the runbook took its own cure for a recurrence.
"""

from __future__ import annotations

import pytest

from stabmon.detect.progress import BESTS, LossRegression, RegressionConfig


def falling(start: int, stop: int) -> list[tuple[int, float]]:
    """A loss falling from 3.0 by 1% a step, with a little noise (deterministic)."""
    return [(s, 3.0 * 0.99 ** s * (1 + 0.002 * (s % 3))) for s in range(start, stop)]


def reports(detector: LossRegression, points: list[tuple[int, float]]) -> list[int]:
    return [a.step for s, v in points if (a := detector.update(s, {"loss": v}))]


def test_a_restart_from_step_0_is_not_a_regression_against_the_steps_it_undid() -> None:
    d = LossRegression("loss")
    assert reports(d, falling(0, 150)) == []
    assert reports(d, falling(0, 150)) == []  # the same steps trained again: the best before step 0 is none


def test_a_rollback_mid_run_is_still_judged_against_the_best_before_it() -> None:
    d = LossRegression("loss")
    assert reports(d, falling(0, 150)) == []
    # back to step 100; the loss there is 1.5x the level it had at step 100, and stays: a regression of the state
    # restored (the best before step 100 holds), reported once it has lasted the patience
    found = reports(d, [(s, 1.5 * 3.0 * 0.99 ** 100) for s in range(100, 160)])
    assert found and 100 + 19 <= found[0] < 160
    assert d._best == pytest.approx(3.0 * 0.99 ** 90, rel=0.05)  # the best median (20 steps) before step 100


def test_the_bests_kept_are_bounded_and_a_state_saved_without_them_relearns_its_best() -> None:
    d = LossRegression("loss", RegressionConfig(window=2, records=2, patience=2, patience_records=2))
    reports(d, falling(0, 2000))
    assert 0 < len(d._bests) <= BESTS and [e[0] for e in d._bests] == sorted(e[0] for e in d._bests)
    state = d.state_dict()
    del state["stats"]["_bests"]  # written before the bests were kept
    again = LossRegression("loss", RegressionConfig(window=2, records=2, patience=2, patience_records=2))
    again.load_state_dict(state)
    assert reports(again, falling(1000, 1100)) == []  # back to step 1000: no best before it known, none assumed
