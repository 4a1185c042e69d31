"""DetectorSuite: configuration errors, overrides, wiring, state, hang watchdog."""

from __future__ import annotations

import math
import pickle
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stabmon.detect import DetectorSuite, HangWatchdog, apply_overrides, parse_config
from stabmon.events import Anomaly, Metric, StepRecord
from stabmon.pipeline import DetectorSuiteLike, Pipeline


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"spike": {"alpha": 1.5}}, "detectors.spike.alpha must be in (0, 1), got 1.5"),
        ({"spike": {"alpha": 0}}, "detectors.spike.alpha must be in (0, 1), got 0.0"),
        ({"robust_spike": {"window": -3}}, "detectors.robust_spike.window must be >= 2, got -3"),
        ({"step_time": {"short_window": 0}}, "detectors.step_time.short_window must be >= 2, got 0"),
        ({"spike": {"grace_period": -1}}, "detectors.spike.grace_period must be >= 0, got -1"),
        ({"spike": {"z_treshold": 5}}, "detectors.spike.z_treshold is not a known setting"),
        ({"spikes": {}}, "detectors.spikes is not a known detector"),
        ({"detectors": {"loss_scale": {"max_overflow_rate": 2}}},
         "detectors.loss_scale.max_overflow_rate must be in (0, 1), got 2.0"),
        ({"spike": {"grace_period": 2.5}}, "detectors.spike.grace_period must be an integer, got 2.5"),
        ({"spike": {"enabled": "maybe"}}, "detectors.spike.enabled must be true or false, got 'maybe'"),
        ({"drift": {"metrics": []}}, "detectors.drift.metrics must not be empty"),
        ({"no_progress": {"grad_fall": 1}}, "detectors.no_progress.grad_fall must be > 1, got 1.0"),
        ({"regression": {"records": 1}}, "detectors.regression.records must be >= 2, got 1"),
        ({"regression": {"z": -1}}, "detectors.regression.z must be > 0, got -1.0"),
        ({"no_progress": {"untrained_fraction": 1.5}}, "detectors.no_progress.untrained_fraction must be in (0, 1)"),
        ({"no_progress": {"untrained_loss": -2}}, "detectors.no_progress.untrained_loss must be >= 0, got -2.0"),
        ({"no_progress": {"early_step": -50}}, "detectors.no_progress.early_step must be >= 0, got -50"),
        ({"nonfinite": {"of": 30}}, "detectors.nonfinite.evidence must be >= detectors.nonfinite.of (30), got 20"),
        ({"spike": {"corroborate_records": 0}}, "detectors.spike.corroborate_records must be >= 1, got 0"),
        ({"nonfinite": {"metrics": [1]}}, "detectors.nonfinite.metrics must be a list of metric names"),
        ({"spike": 5}, "detectors.spike must be a mapping of settings, got 5"),
        ({"detectors": ["spike"]}, "detectors must be a mapping of detector names"),
    ],
)
def test_bad_configuration_is_one_line_naming_the_field(cfg: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        DetectorSuite.from_config(cfg)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(message)


def test_overrides_strings_and_mapping() -> None:
    cfg = apply_overrides({"spike": {"alpha": 0.1}}, ["spike.z_threshold=5", "detectors.drift.enabled=off",
                                                     "missing.metrics=[\"loss\"]"])
    assert cfg == {"spike": {"alpha": 0.1, "z_threshold": 5}, "drift": {"enabled": False},
                   "missing": {"metrics": ["loss"]}}
    parsed = parse_config(cfg)
    assert parsed["spike"].z_threshold == 5.0 and parsed["missing"].metrics == ("loss",)
    suite = DetectorSuite.from_config(overrides={"spike.alpha": "0.2", "robust_spike.enabled": False})
    assert suite.configs["spike"].alpha == 0.2
    assert not any(d.name == "robust_spike" for d in suite.detectors)
    with pytest.raises(ValueError, match="detectors.spike.alpha must be in"):
        DetectorSuite.from_config(overrides=["spike.alpha=7"])
    with pytest.raises(ValueError, match="must look like detector.param=value"):
        apply_overrides({}, ["spike.alpha"])
    with pytest.raises(ValueError, match="must name detector.param"):
        apply_overrides({}, ["alpha=0.3"])


def test_defaults_are_valid_and_documented() -> None:
    suite = DetectorSuite.from_config(None)
    names = {d.name for d in suite.detectors}
    assert {"spike", "robust_spike", "nonfinite", "missing", "loss_scale", "drift", "step_time"} <= names
    assert isinstance(suite, DetectorSuiteLike)


def _stream(n: int, start: int = 0) -> list[StepRecord]:
    return [StepRecord(step=s, metrics={Metric.LOSS: 3.0 - 1e-4 * s, Metric.GRAD_NORM: 0.5 + 0.01 * (s % 5),
                                        Metric.STEP_TIME: 1.0, "emb_update/wte": 1e-4, "act_rms/h.0": 1.0})
            for s in range(start, start + n)]


def test_glob_metrics_get_their_own_detectors_and_spikes_are_deduplicated() -> None:
    suite = DetectorSuite.from_config()
    for r in _stream(40):
        assert suite.update(r) == []
    metrics = {(d.name, d.metric) for d in suite.detectors}
    assert ("frozen_embedding", "emb_update/wte") in metrics and ("drift", "act_rms/h.0") in metrics
    found = suite.update(StepRecord(step=40, metrics={Metric.LOSS: 3.0, Metric.GRAD_NORM: 50.0}))
    spikes = [a for a in found if a.kind == "spike"]
    assert [(a.metric, a.step) for a in spikes] == [(Metric.GRAD_NORM, 40)]  # spike + robust_spike -> one


def test_nan_loss_is_flagged_in_grace_and_critical_once_it_persists() -> None:
    suite = DetectorSuite.from_config()
    for r in _stream(20):
        suite.update(r)
    suite.enter_grace()
    found = [suite.update(StepRecord(step=s, metrics={Metric.LOSS: math.nan, Metric.GRAD_NORM: 0.5}))
             for s in (20, 21, 22)]
    assert [[(a.kind, a.severity.value) for a in f] for f in found] == [
        [("nonfinite", "warning")], [("nonfinite", "warning")], [("nonfinite", "critical")]]


def test_nonfinite_persistence_is_counted_in_records_whatever_the_logging_interval() -> None:
    # a log written every 500 steps: three NaN losses in a row are three records, 1000 steps apart
    suite = DetectorSuite.from_config()
    for s in range(0, 10_000, 500):
        suite.update(StepRecord(step=s, metrics={Metric.LOSS: 2.0 - s * 1e-5}))
    found = [a for s in (10_000, 10_500, 11_000) for a in suite.update(StepRecord(s, {Metric.LOSS: math.nan}))]
    assert [a.severity.value for a in found] == ["warning", "warning", "critical"]
    # a NaN grad norm beside a finite loss (an fp16 skip the log did not mark) is info until it persists
    single = suite.update(StepRecord(11_500, {Metric.LOSS: 1.8, Metric.GRAD_NORM: math.nan}))
    assert [a.severity.value for a in single if a.kind == "nonfinite"] == ["info"]


def test_enter_grace_silences_spikes() -> None:
    suite = DetectorSuite.from_config()
    for r in _stream(40):
        suite.update(r)
    suite.enter_grace(3)
    assert suite.update(StepRecord(step=40, metrics={Metric.LOSS: 3.0, Metric.GRAD_NORM: 50.0})) == []


def _key(a: Anomaly) -> tuple:
    return a.kind, a.metric, a.step, a.score, a.severity, a.evidence, a.message


def test_state_dict_round_trip_and_pickle() -> None:
    stream = _stream(120)
    tail = [StepRecord(step=120 + i, metrics={Metric.LOSS: 3.0, Metric.GRAD_NORM: 0.5 * 3**i})
            for i in range(4)]
    a = DetectorSuite.from_config()
    for r in stream[:60]:
        a.update(r)
    b = DetectorSuite.from_config()
    b.load_state_dict(pickle.loads(pickle.dumps(a.state_dict())))
    c = pickle.loads(pickle.dumps(a))
    outs = [[_key(x) for r in stream[60:] + tail for x in s.update(r)] for s in (a, b, c)]
    assert outs[0] == outs[1] == outs[2]
    assert any(k[0] == "spike" for k in outs[0])
    with pytest.raises(ValueError, match="unsupported detector state version"):
        b.load_state_dict({"version": 99})


def test_pipeline_runs_the_suite() -> None:
    grace = {"spike.grace_period": 1, "robust_spike.grace_period": 1}
    pipe = Pipeline(DetectorSuite.from_config(overrides=grace))
    pipe.process(StepRecord(step=0, metrics={Metric.GRAD_NORM: 0.25}))
    events = pipe.process(StepRecord(step=1, metrics={Metric.GRAD_NORM: 25.0}))
    assert [(e.kind, e.metric) for e in events] == [("spike", Metric.GRAD_NORM)]
    assert pipe.state_dict()["detectors"]["version"] == 1


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_hang_watchdog_fires_once_per_hang_and_rearms() -> None:
    clock = _Clock()
    dog = HangWatchdog(timeout=60, callback=lambda a: None, clock=clock)
    dog.beat(5)
    clock.now += 59
    assert dog.check() is None
    clock.now += 2
    a = dog.check()
    assert a is not None and (a.kind, a.step, a.severity.value) == ("hang", 5, "error") and a.score >= 60
    clock.now += 600
    assert dog.check() is None  # reported once
    dog.beat(6)
    clock.now += 61
    assert dog.check() is not None
    with pytest.raises(ValueError, match="hang timeout must be > 0"):
        HangWatchdog(timeout=0, callback=lambda a: None)


def test_hang_watchdog_thread_survives_a_failing_callback() -> None:
    calls: list[Anomaly] = []
    done = threading.Event()

    def boom(a: Anomaly) -> None:
        calls.append(a)
        done.set()
        raise RuntimeError("alert sink down")

    dog = HangWatchdog(timeout=0.01, callback=boom, poll=0.005)
    dog.start()
    dog.beat(1)
    assert done.wait(10.0)
    assert dog.fired.wait(10.0)
    dog.stop()
    assert calls[0].kind == "hang" and dog.errors == 1


_VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=1e-6, max_value=1e6))
_RECORD = st.dictionaries(
    st.sampled_from([Metric.LOSS, Metric.GRAD_NORM, Metric.LOSS_SCALE, Metric.OVERFLOW, Metric.STEP_TIME,
                     Metric.LR, "act_rms/h.0", "emb_update/wte"]), _VALUES, max_size=8)


@settings(max_examples=40, deadline=None)
@given(st.lists(_RECORD, max_size=80))
def test_any_stream_gives_well_formed_anomalies(stream: list[dict[str, float]]) -> None:
    suite = DetectorSuite.from_config(overrides={"spike.grace_period": 1, "robust_spike.grace_period": 1,
                                                 "loss_scale.grace_period": 0, "step_time.grace_period": 2})
    for step, metrics in enumerate(stream):
        for a in suite.update(StepRecord(step=step, metrics=metrics)):
            assert a.step == step and math.isfinite(a.score) and a.threshold is not None
            assert a.score >= a.threshold and a.message
    clone = DetectorSuite.from_config(overrides={"spike.grace_period": 1, "robust_spike.grace_period": 1,
                                                 "loss_scale.grace_period": 0, "step_time.grace_period": 2})
    clone.load_state_dict(suite.state_dict())
    assert clone.state_dict() == suite.state_dict()



def test_state_dict_survives_torch_save_weights_only() -> None:
    import io

    import torch

    suite = DetectorSuite.from_config()
    for r in _stream(30):
        suite.update(r)
    buf = io.BytesIO()
    torch.save(suite.state_dict(), buf)
    buf.seek(0)
    restored = DetectorSuite.from_config()
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert restored.state_dict() == suite.state_dict()
