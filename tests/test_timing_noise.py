"""Step-time and straggler alerts are judged against the run's own measured noise: a shared machine's
contention bursts, sub-millisecond slow-downs and two ranks that take turns being the slowest are not reported;
a sustained slow-down and one rank that stays slow are, with a message that says what was seen.

The streams are built, not sampled: a low-discrepancy sequence (multiples of the golden ratio, mod 1) gives
jitter and rank flips that look random but are the same on every machine.
"""

from __future__ import annotations

import pytest

from stabmon.detect import DetectorSuite
from stabmon.detect.fleet import Straggler, StragglerConfig
from stabmon.detect.trends import StepTimeConfig, StepTimeRegression
from stabmon.events import Anomaly, Decision, Metric, Severity, StepRecord

GOLDEN = 0.6180339887498949


def jitter(i: int, k: float = 1.0) -> float:
    """A value in [0, 1) that moves like noise, from the step alone."""
    return (i * GOLDEN * k) % 1.0


def shared_machine(steps: int, base: float = 0.1) -> list[float]:
    """Step times of a healthy run on a loaded machine: +-10% jitter and, every 80 steps, a 15-step contention
    burst that makes the steps 60% slower (another job's test suite)."""
    return [base * (0.9 + 0.2 * jitter(i)) * (1.6 if i % 80 >= 65 else 1.0) for i in range(steps)]


def step_time_anomalies(times: list[float], config: StepTimeConfig | None = None) -> list[object]:
    det = StepTimeRegression(Metric.STEP_TIME, config)
    return [a for s, t in enumerate(times) if (a := det.update(s, {Metric.STEP_TIME: t})) is not None]


def test_contention_bursts_on_a_shared_machine_are_not_a_regression() -> None:
    assert step_time_anomalies(shared_machine(1000)) == []


def test_a_sustained_slowdown_is_reported_with_what_was_seen() -> None:
    times = shared_machine(600)[:300] + [0.2 * (0.95 + 0.1 * jitter(i)) for i in range(300)]
    found = step_time_anomalies(times)
    assert len(found) == 1, [a.message for a in found]  # one episode, reported once
    a = found[0]
    assert 300 < a.step < 300 + 2 * 20 + 10  # past half the window, then 20 steps of patience
    assert a.message.startswith("step time regressed by ") and "for 20 steps" in a.message
    median, base = (float(a.message.split(key)[1].split(" s")[0]) for key in ("recent median ", "vs baseline "))
    assert median == pytest.approx(0.2, rel=0.05) and base == pytest.approx(0.1, rel=0.05)
    assert f"(+{median - base:.3g} s per step; noise " in a.message


def test_a_slowdown_of_milliseconds_is_below_the_minimum_effect() -> None:
    # a 5 ms step that takes 10 ms for good: 100% slower, but 5 ms per step is not worth a page
    times = [0.005 * (0.95 + 0.1 * jitter(i)) for i in range(300)] + [0.010] * 300
    assert step_time_anomalies(times) == []
    assert len(step_time_anomalies(times, StepTimeConfig(min_seconds=0.001))) == 1  # the knob works


def fleet_records(steps: int, slow_rank: int | None = None) -> list[dict[str, float]]:
    """Two DDP ranks that take turns being the slowest by 5-35% (a shared CPU), or ``slow_rank`` slower by
    60% in 9 steps of 10 (twice what the fleet's noise reaches)."""
    out = []
    for i in range(steps):
        rank, ratio = float(jitter(i, 1.3247) >= 0.5), 1.05 + 0.3 * jitter(i)
        if slow_rank is not None and i % 10:
            rank, ratio = float(slow_rank), 1.6 + 0.05 * jitter(i)
        out.append({Metric.STRAGGLER_RATIO: ratio, Metric.STRAGGLER_RANK: rank, Metric.FLEET_STEP_TIME: 0.1})
    return out


def straggler_anomalies(records: list[dict[str, float]], config: StragglerConfig | None = None) -> list[object]:
    det = Straggler(Metric.STRAGGLER_RATIO, config)
    return [a for s, x in enumerate(records) if (a := det.update(s, x)) is not None]


def test_two_ranks_taking_turns_are_not_stragglers() -> None:
    assert straggler_anomalies(fleet_records(300)) == []


def test_a_rank_that_stays_slow_is_named_with_what_was_seen() -> None:
    found = straggler_anomalies(fleet_records(64) + fleet_records(100, slow_rank=1))
    assert found, "a rank 60% slower in 9 steps of 10 must be reported"
    a = found[0]
    assert 64 < a.step <= 64 + 20
    assert a.message.startswith("rank 1 was the slowest in ") and "x the fleet median (+0.06" in a.message
    assert "s per step; bar " in a.message and "fleet noise" in a.message


def test_a_straggler_costing_milliseconds_is_below_the_minimum_effect() -> None:
    records = [dict(x, **{Metric.FLEET_STEP_TIME: 0.01}) for x in fleet_records(100, slow_rank=1)]
    assert straggler_anomalies(records) == []  # 60% of a 10 ms step: 6 ms


def test_the_default_suite_is_quiet_on_a_healthy_noisy_fleet() -> None:
    suite = DetectorSuite.from_config(None)
    times = shared_machine(400)
    found = []
    for s, x in enumerate(fleet_records(400)):
        found += suite.update(StepRecord(s, {**x, Metric.STEP_TIME: times[s], Metric.FLEET_STEP_TIME: times[s]}))
    assert [(a.kind, a.metric, a.message) for a in found] == []


@pytest.mark.parametrize(("key", "value", "message"), [
    ("step_time.min_seconds", -1, "detectors.step_time.min_seconds must be >= 0, got -1"),
    ("straggler.noise_window", 1, "detectors.straggler.noise_window must be >= 2, got 1"),
])
def test_new_settings_are_checked_by_name(key: str, value: float, message: str) -> None:
    name, field = key.split(".")
    with pytest.raises(ValueError, match=message):
        DetectorSuite.from_config({name: {field: value}})


def test_an_alert_without_text_says_what_the_detector_saw() -> None:
    """The default runbook answers a warning with ``alert_only`` and no message: the decision (and so the alert
    and the trace) now carries the anomaly's own first line instead of an empty ``message``."""
    from stabmon.runbook import Engine, load_runbook

    engine = Engine(load_runbook("default"), mode="apply")
    seen = ("step time regressed by 96.4% for 20 steps: recent median 0.1996 s vs baseline 0.1016 s "
            "(+0.098 s per step; noise 3.9%, bar 7.8%)")
    a = Anomaly(kind="step_time", metric="step_time", step=120, score=0.96, severity=Severity.WARNING,
                detector="step_time", message=seen + "\nsecond line")
    decisions = [e for e in engine.process(StepRecord(120, {Metric.STEP_TIME: 0.2}), [a])
                 if isinstance(e, Decision)]
    assert [(d.action, d.params["message"]) for d in decisions] == [("alert_only", seen)]
