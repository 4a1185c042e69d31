"""One contract for every detector class: discovered, not listed, so a new detector is checked
automatically."""

from __future__ import annotations

import dataclasses
import math
import pickle
import random
import types
from collections import deque

import pytest

import stabmon.detect  # noqa: F401 - imports every detector module
from stabmon.detect import plain
from stabmon.detect.base import Detector
from stabmon.detect.rule import Rule
from stabmon.detect.scorer import Scorer
from stabmon.events import Anomaly, Severity


def _all_detectors() -> list[type[Detector]]:
    found, todo = [], list(Detector.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.name:
            found.append(cls)
    return sorted(found, key=lambda c: c.name)


DETECTORS = _all_detectors()
ids = [c.name for c in DETECTORS]


def test_every_registered_detector_is_discovered() -> None:
    assert {c.name for c in DETECTORS} == set(stabmon.detect.DETECTORS)
    assert len(DETECTORS) >= 8


def _feed(det: Detector, records: list[dict[str, float]], start: int = 0) -> list[Anomaly | None]:
    return [det.update(start + i, x) for i, x in enumerate(records)]


def _strip(a: Anomaly | None) -> tuple | None:
    if a is None:
        return None
    return a.kind, a.metric, a.step, a.score, a.severity, a.evidence, a.threshold, a.message


@pytest.mark.parametrize("cls", DETECTORS, ids=ids)
def test_docstring_has_a_runnable_example(cls: type[Detector]) -> None:
    assert cls.__doc__ and ">>>" in cls.__doc__
    assert cls.Config.__doc__ and ">>>" in cls.Config.__doc__


@pytest.mark.parametrize("cls", DETECTORS, ids=ids)
def test_example_is_flagged_with_a_complete_anomaly(cls: type[Detector]) -> None:
    metric, healthy, bad = cls.example()
    det = cls(metric)
    assert not any(_feed(det, healthy)), "the healthy example stream must not be flagged"
    found = [a for a in _feed(det, bad, len(healthy)) if a is not None]
    assert found
    a = found[0]
    assert (a.kind, a.detector, a.metric) == (cls.kind, cls.name, metric)
    assert isinstance(a.severity, Severity) and a.threshold is not None and a.score >= a.threshold
    assert a.evidence and a.evidence[-1][0] <= a.step and a.message  # missing: last arrival


@pytest.mark.parametrize("cls", DETECTORS, ids=ids)
def test_grace_period_scores_zero(cls: type[Detector]) -> None:
    metric, healthy, bad = cls.example()
    det = cls(metric)
    _feed(det, healthy)
    det.enter_grace(len(bad) + 5)
    if cls.grace_exempt:  # safety rules are never silenced: a NaN after an intervention is still critical
        assert any(_feed(det, bad, len(healthy)))
        return
    for i, x in enumerate(bad):
        assert det.in_grace
        assert det.score_one(x) == 0.0
        assert det.update(len(healthy) + i, x) is None


@pytest.mark.parametrize("cls", DETECTORS, ids=ids)
def test_protect_filter_does_not_learn_flagged_points(cls: type[Detector]) -> None:
    metric, healthy, bad = cls.example()
    det = cls(metric)
    _feed(det, healthy)
    for i, x in enumerate(bad):
        before = det.n_learned
        state = det.state_dict()["stats"]
        if det.update(len(healthy) + i, x) is not None:
            if issubclass(cls, Rule):  # a rule's rolling windows hold every value (see stabmon.detect.rule)
                return
            assert det.n_learned == before
            after = det.state_dict()["stats"]
            if cls.name == "step_time":  # its short recent window sees every point; the baseline is protected
                assert after["_baseline"] == state["_baseline"]
            elif cls.name == "loss_scale":  # at-floor flag tracks the scale; overflow window protected
                assert after["_overflows"] == state["_overflows"]
            elif cls.name == "nonfinite":  # it learns nothing; it counts the flagged steps (persistence)
                assert set(after) == {"_flagged"} and len(plain.load(after["_flagged"])) == 1
            elif cls.name in {"spike", "robust_spike"}:  # the excursion's size is recorded (it sets the severity
                # of the next one); the baseline statistics are protected
                history = {"_survived", "_peak", "_peak_error"}
                assert {k: v for k, v in after.items() if k not in history} == {
                    k: v for k, v in state.items() if k not in history
                }
            elif cls.name not in {"drift", "frozen_embedding", "missing", "straggler"}:  # restart on a report
                assert after == state
            return
    pytest.fail("example bad stream was never flagged")


@pytest.mark.parametrize("cls", DETECTORS, ids=ids)
def test_zero_variance_is_safe(cls: type[Detector]) -> None:
    metric, healthy, _ = cls.example()
    det = cls(metric)
    det.enter_grace(0)
    constant = [dict(healthy[0]) for _ in range(300)]
    for i, x in enumerate(constant):
        score = det.score_one(x)
        assert math.isfinite(score) and score >= 0
        found = det.update(i, x)
        assert found is None or cls.name == "no_progress"  # a loss that never falls is what it reports
    nudged = {k: v * 1.001 for k, v in healthy[0].items()}
    assert math.isfinite(det.score_one(nudged))


def _noisy(healthy: list[dict[str, float]], seed: int) -> list[dict[str, float]]:
    rng = random.Random(seed)
    return [{k: v * (1 + 0.02 * rng.random()) for k, v in x.items()} for x in healthy]


@pytest.mark.parametrize("cls", DETECTORS, ids=ids)
def test_state_dict_round_trip_gives_identical_scores(cls: type[Detector]) -> None:
    metric, healthy, bad = cls.example()
    stream = _noisy(healthy, 1)
    half = len(stream) // 2
    a = cls(metric)
    _feed(a, stream[:half])
    b = cls(metric)
    b.load_state_dict(a.state_dict())
    rest = stream[half:] + bad
    got_a = [(a.score_one(x), _strip(a.update(half + i, x))) for i, x in enumerate(rest)]
    got_b = [(b.score_one(x), _strip(b.update(half + i, x))) for i, x in enumerate(rest)]
    assert got_a == got_b


@pytest.mark.parametrize("cls", DETECTORS, ids=ids)
def test_pickle_round_trip(cls: type[Detector]) -> None:
    metric, healthy, bad = cls.example()
    a = cls(metric)
    _feed(a, healthy)
    b = pickle.loads(pickle.dumps(a))
    got_a = [_strip(a.update(i, x)) for i, x in enumerate(bad)]
    assert got_a == [_strip(b.update(i, x)) for i, x in enumerate(bad)]


@pytest.mark.parametrize("cls", DETECTORS, ids=ids)
def test_seeded_determinism(cls: type[Detector]) -> None:
    metric, healthy, bad = cls.example()

    def run(seed: int) -> list:
        det = cls(metric)
        stream = _noisy(healthy, seed) + bad
        return [(det.score_one(x), _strip(det.update(i, x))) for i, x in enumerate(stream)]

    assert run(7) == run(7)


@pytest.mark.parametrize("cls", DETECTORS, ids=ids)
def test_defaults_are_immutable_and_not_shared(cls: type[Detector]) -> None:
    cfg = cls.Config()
    field = dataclasses.fields(cfg)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, field, None)
    for f in dataclasses.fields(cfg):
        assert not isinstance(getattr(cfg, f.name), (list, dict, set)), f.name
    metric, healthy, _ = cls.example()
    a, b = cls(metric), cls(metric)
    _feed(a, healthy)
    assert b.n_learned == 0 and b.state_dict()["evidence"] == []


_ODD_VALUES = (math.nan, math.inf, -math.inf, 0.0, -1.0, 1e-40, 1e30)


def _random_stream(cls: type[Detector], seed: int, n: int = 600) -> list[tuple[int, dict[str, float]]]:
    """Stretches of the example's healthy and bad records (long enough for the slow detectors to fire),
    with noise on the watched metric, odd values, absent metrics and rewinds of the step counter."""
    metric, healthy, bad = cls.example()
    rng = random.Random(seed)
    out: list[tuple[int, dict[str, float]]] = []
    step = rng.randrange(0, 200)
    while len(out) < n:
        pool = bad if rng.random() < 0.4 else healthy
        for _ in range(rng.randint(1, 150)):
            x = dict(rng.choice(pool))
            if metric in x:
                x[metric] *= 1 + 0.1 * rng.gauss(0, 1)
            if rng.random() < 0.05:
                x[rng.choice(sorted(x))] = rng.choice(_ODD_VALUES)
            if rng.random() < 0.05:
                x.pop(rng.choice(sorted(x)))
            step = step + 1 if rng.random() > 0.02 else max(0, step - rng.randint(1, 30))
            out.append((step, x))
    return out[:n]


SCORERS = [c for c in DETECTORS if issubclass(c, Scorer)]


def test_every_detector_is_a_scorer_or_a_rule() -> None:
    assert all(issubclass(c, Scorer) != issubclass(c, Rule) for c in DETECTORS)
    assert SCORERS and len(SCORERS) < len(DETECTORS)


@pytest.mark.parametrize("cls", SCORERS, ids=lambda c: c.name)
@pytest.mark.parametrize("seed", range(4))
def test_the_fast_observe_hook_equals_the_general_path(cls: type[Scorer], seed: int) -> None:
    """A scorer's own ``_observe`` (its replay hot path) gives the anomalies and the state that the default
    (``_value``, ``_score``, ``_learn``) gives, record by record, through grace and re-entered grace, whether it
    fills its own evidence window or shares the suite's."""
    metric = cls.example()[0]
    if seed % 2:
        windows = [deque(maxlen=cls.Config().evidence) for _ in range(2)]
        fast, general = (cls(metric, evidence=window) for window in windows)
    else:
        windows = []
        fast, general = cls(metric), cls(metric)
    general._observe = types.MethodType(Scorer._observe, general)  # type: ignore[method-assign]
    rng = random.Random(seed)
    for step, x in _random_stream(cls, seed):
        if rng.random() < 0.02:
            steps = rng.choice([None, 0, rng.randint(1, 20)])
            fast.enter_grace(steps)
            general.enter_grace(steps)
        if metric in x:
            for window in windows:
                window.append((step, x[metric]))
        assert _strip(fast.update(step, x)) == _strip(general.update(step, x)), (step, x)
        assert fast.state_dict() == general.state_dict(), (step, x)


@pytest.mark.parametrize("cls", SCORERS, ids=lambda c: c.name)
@pytest.mark.parametrize("seed", range(3))
def test_the_guards_common_case_equals_its_general_path(cls: type[Scorer], seed: int) -> None:
    """A settled scorer in a suite (past warm-up and grace, no streak) takes the guard's common case; it gives
    the anomalies and the state of a twin kept off it, record by record, through grace, re-entered grace and
    rewinds of the step counter."""
    metric = cls.example()[0]
    windows = [deque(maxlen=cls.Config().evidence) for _ in range(2)]
    settled, general = (cls(metric, evidence=window) for window in windows)
    rng = random.Random(seed)
    for step, x in _random_stream(cls, seed):
        if rng.random() < 0.02:
            steps = rng.choice([None, 0, rng.randint(1, 20)])
            settled.enter_grace(steps)
            general.enter_grace(steps)
        if metric in x:
            for window in windows:
                window.append((step, x[metric]))
        general._settled_from = math.inf
        assert _strip(settled.update(step, x)) == _strip(general.update(step, x)), (step, x)
        assert settled.state_dict() == general.state_dict(), (step, x)


@pytest.mark.parametrize("cls", SCORERS, ids=lambda c: c.name)
def test_a_settled_scorer_in_a_suite_takes_the_common_case(cls: type[Scorer]) -> None:
    """On a healthy stream a scorer in a suite settles once past warm-up and grace; one alone (which fills its
    own evidence window) never does."""
    metric, healthy, _ = cls.example()
    window: deque[tuple[int, float]] = deque(maxlen=cls.Config().evidence)
    shared, alone = cls(metric, evidence=window), cls(metric)
    stream = [healthy[i % len(healthy)] for i in range(240)]
    served = 0
    for step, x in enumerate(stream):
        served += step >= shared._settled_from
        if metric in x:
            window.append((step, x[metric]))
        assert shared.update(step, x) is None and alone.update(step, x) is None
    assert served >= len(stream) - cls.Config().grace_period - 2
    assert alone._settled_from == math.inf


@pytest.mark.parametrize("cls", [c for c in DETECTORS if c.skips_finite], ids=lambda c: c.name)
@pytest.mark.parametrize("seed", range(4))
def test_a_detector_that_skips_finite_values_reports_the_same_without_them(cls: type[Detector], seed: int) -> None:
    """``skips_finite``: fed only the records whose value of its metric is not finite (what a suite does), the
    detector reports what it reports when it sees every record, and nothing on the records it skipped. Both
    share the metric's evidence window, filled on every record that has the metric, as in a suite."""
    metric = cls.example()[0]
    window: deque[tuple[int, float]] = deque(maxlen=cls.Config().evidence)
    every, skipping = cls(metric, evidence=window), cls(metric, evidence=window)
    for step, x in _random_stream(cls, seed):
        if metric in x:
            window.append((step, x[metric]))
        found = _strip(every.update(step, x))
        if metric in x and not math.isfinite(x[metric]):
            assert _strip(skipping.update(step, x)) == found, (step, x)
        else:
            assert found is None, (step, x)
