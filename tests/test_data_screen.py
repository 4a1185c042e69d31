"""The data screen (``rollback`` with ``screen``): after the restore, a batch whose loss stands out from the losses
before the incident has its update discarded on the device; the others train. A bad shard then costs its own
batches, not a fixed count of 200, and the detectors do not read the discarded batches' losses as the trouble
coming back. Where the screen cannot act (the loss observed after ``optimizer.step()``) the batches are skipped
as without it.

The faults are injected by construction: targets 100x their scale on the bad batches, so their loss is ~10^4
times the clean batches' on every seed (``STABMON_TEST_SEED``, ``STABMON_TEST_THREADS``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from stabmon.collect.config import MonitorConfig
from stabmon.events import InterventionRecord, Metric
from stabmon.monitor import Monitor
from stabmon.overrides import Overrides
from stabmon.runbook import loads_runbook

SEED = int(os.environ.get("STABMON_TEST_SEED", "0"))
THREADS = int(os.environ.get("STABMON_TEST_THREADS", "0"))
BAD = range(100, 120)  # the corrupted shard: batches 100-119

RUNBOOK = """
name: screen
cooldown: 10
rules:
  - name: bad_data
    when: {{kind: spike, metric: loss, severity: error}}
    ladder:
      - action: rollback
        params: {{lookback: 0, skip_batches: 40{screen}}}
        observe: 60
        success: {{quiet_steps: 60, loss_within: 0.1}}
      - action: rollback
        params: {{lookback: 0, lr_cap: 0.5}}
        observe: 60
"""


def _run(tmp_path: Path, *, screen: bool, bad: range = BAD, loss_first: bool = True,
         steps: int = 200) -> tuple[Monitor, float]:
    """A regression loop (checkpoints every 25 steps) whose batches in ``bad`` have targets 100x their scale;
    returns the monitor and the held-out loss at the end."""
    if THREADS:
        torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(SEED + 1)
    target = torch.nn.Linear(8, 1)
    data = [torch.randn(32, 8, generator=g) for _ in range(steps)]
    held_out = torch.randn(256, 8, generator=g)
    runbook = loads_runbook(RUNBOOK.format(screen=", screen: true" if screen else ""))
    mon = Monitor(model, opt, store=None, runbook=runbook, mode="apply", checkpoint_dir=str(tmp_path / "ckpt"),
                  config=MonitorConfig(flush_every=10, clip=1.0, hang_timeout=None, checkpoint_every=25))
    try:
        for step, x in mon.steps(data):
            with torch.no_grad():
                y = target(x) * (100.0 if step in bad else 1.0)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if loss_first:
                mon.observe(loss=loss)
            opt.step()
            if not loss_first:
                mon.observe(loss=loss)
            opt.zero_grad()
    finally:
        mon.close()
    with torch.no_grad():
        final = float(torch.nn.functional.mse_loss(model(held_out), target(held_out)))
    return mon, final


def _timeline(mon: Monitor) -> dict[int, Any]:
    return {r.step: r for r in mon.records}  # the last record of each step: what the run kept


def _rollbacks(mon: Monitor) -> list[InterventionRecord]:
    return [e for e in mon.events if isinstance(e, InterventionRecord) and e.action == "rollback"
            and not e.reverted]


def test_a_screen_discards_the_bad_shard_and_trains_on_the_rest(tmp_path: Path) -> None:
    mon, final = _run(tmp_path, screen=True)
    _, clean = _run(tmp_path / "clean", screen=True, bad=range(0))
    (rollback,) = _rollbacks(mon)  # one restart: the discarded losses were not read as the trouble coming back
    start, end = rollback.after["screened"]
    assert start <= BAD.start < BAD.stop <= end and rollback.after["skipped"] == [start, start]  # nothing skipped
    kept = _timeline(mon)
    discarded = {s for s, r in kept.items() if r.get(Metric.SKIPPED) == 1.0}
    assert set(BAD) <= discarded  # every bad batch's update was thrown away ...
    assert len(discarded - set(BAD)) <= 2  # ... and (nearly) every clean one in the window trained
    assert final < 1.1 * clean  # the run ends where the clean twin does
    assert mon.overrides.screen_bar is None  # the screen ended with its window
    # skipping blind costs the clean batches in its window too (and, counted from the restore, it ends before the
    # shard does here: the rest of the shard brings the trouble back)
    blind, _ = _run(tmp_path / "blind", screen=False)
    skipping = _rollbacks(blind)[0]
    assert skipping.after["skipped"][1] - skipping.after["skipped"][0] == 40 > len(discarded)


def test_a_loop_that_observes_the_loss_after_the_step_skips_the_batches_instead(tmp_path: Path) -> None:
    mon, _ = _run(tmp_path, screen=True, loss_first=False)
    first = _rollbacks(mon)[0]
    assert "screened" not in first.after
    start, end = first.after["skipped"]
    assert end - start == 40
    assert not any(r.get(Metric.SKIPPED) == 1.0 for r in mon.records)


def test_a_screen_is_in_the_saved_state_and_holds_after_a_resume(tmp_path: Path) -> None:
    """A checkpoint written inside the screen's window: the resumed run screens the rest of it."""
    o = Overrides(screen_bar=2.5, screen_until=150)
    resumed = Overrides()
    resumed.load_state_dict(o.state_dict())
    assert resumed.screening(149) == 2.5 and resumed.screening(150) is None
    old = {k: v for k, v in Overrides().state_dict().items() if not k.startswith("screen")}
    before_screens = Overrides()
    before_screens.load_state_dict(old)  # a state saved before the screen existed
    assert before_screens.screen_bar is None


@pytest.mark.parametrize(("params", "expected"), [
    ("{lookback: 0, screen: true}", "screen needs skip_batches > 0"),
    ("{lookback: 0, skip_batches: 10, screen: maybe}", "params.screen: Input should be a valid boolean"),
])
def test_a_bad_screen_is_one_line_naming_where(params: str, expected: str) -> None:
    from stabmon.runbook.loader import RunbookError

    text = RUNBOOK.format(screen="").replace("{lookback: 0, skip_batches: 40}", params)
    with pytest.raises(RunbookError) as err:
        loads_runbook(text)
    assert expected in str(err.value) and "rules[0].ladder[0]" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_saved_screen_without_its_end_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^overrides.screen_bar and screen_until go together") as err:
        Overrides().load_state_dict({"screen_bar": 2.0})
    assert "\n" not in str(err.value)


def test_a_discarded_update_hides_its_finite_loss_from_the_detectors_but_not_a_nan() -> None:
    from stabmon.detect.suite import DetectorSuite
    from stabmon.events import StepRecord

    suite = DetectorSuite()
    for s in range(60):
        suite.update(StepRecord(s, {"loss": 2.0 + 0.01 * (s % 3), "grad_norm": 1.0}))
    assert suite.update(StepRecord(60, {"loss": 400.0, "grad_norm": 90.0, "skipped": 1.0})) == []
    found = suite.update(StepRecord(61, {"loss": float("nan"), "grad_norm": 1.0, "skipped": 1.0}))
    assert any(a.kind == "nonfinite" for a in found)
    assert any(a.kind == "spike" for a in suite.update(StepRecord(62, {"loss": 400.0, "grad_norm": 90.0})))


@pytest.mark.parametrize(("halves", "discarded"), [((1.0, 5.0), False), ((3.0, 5.0), True)])
def test_a_screen_judges_the_mean_of_a_steps_micro_batch_losses(halves: tuple[float, float], discarded: bool,
                                                                tmp_path: Path) -> None:
    """Two micro-batches per step, observed one by one (nanoGPT's way); the bar is 3.5. Their mean is what the
    step's record holds and what the screen compares: 3.0 trains, 4.0 is discarded, whichever micro-batch
    came last."""
    torch.manual_seed(SEED)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = Monitor(model, opt, store=None, config=MonitorConfig(flush_every=5, hang_timeout=None))
    mon.overrides.screen_bar, mon.overrides.screen_until = 3.5, 4
    before = [p.detach().clone() for p in model.parameters()]
    try:
        for step in range(6):
            for scale in halves:
                out = model(torch.ones(2, 4)).sum()
                mon.observe(loss=out * 0 + scale)  # the value the step's micro-batch reports
                (out / len(halves)).backward()
            opt.step()
            opt.zero_grad()
            mon.end_step()
            if step == 0:
                moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
                assert moved is not discarded
    finally:
        mon.close()
    flags = [r.get(Metric.SKIPPED) for r in mon.records]
    assert flags[:4] == [1.0 if discarded else 0.0] * 4 and all(not f for f in flags[4:])  # off at screen_until
