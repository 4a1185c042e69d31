"""Grace semantics: counted in training steps at the start of training, in observations after enter_grace."""

from __future__ import annotations

from stabmon.detect import EWSpike, RobustSpike
from stabmon.detect.spike import SpikeConfig
from stabmon.events import Severity


def _feed(det, start, values):
    return [det.update(start + i, {"grad_norm": v}) for i, v in enumerate(values)]


def test_fresh_run_scores_from_step_grace_period() -> None:
    det = EWSpike("grad_norm", SpikeConfig(grace_period=10))
    assert not any(_feed(det, 0, [1.0] * 9 + [50.0]))  # steps 0-9: warm-up, learned, never scored
    assert det.n_learned == 10
    assert _feed(det, 10, [1e4])[0] is not None


def test_stream_starting_mid_run_scores_from_its_second_observation() -> None:
    for cls in (EWSpike, RobustSpike):
        det = cls("grad_norm")
        found = _feed(det, 7000, [1.0, 20.0])
        assert found[0] is None  # the first observation is the baseline
        assert found[1] is not None and found[1].step == 7001


def test_explicit_grace_is_counted_in_observations_even_mid_run() -> None:
    det = EWSpike("grad_norm", SpikeConfig(grace_period=3))
    det.enter_grace()
    assert not any(_feed(det, 7000, [1.0, 50.0, 1.0]))
    assert _feed(det, 7003, [1e4])[0] is not None
    det.enter_grace(2)
    assert not any(_feed(det, 7004, [40.0]))  # in grace: a 10-40x excursion is learned, not scored
    # ... except the prior that holds during grace: two orders of magnitude over the baseline is flagged (a
    # warning: one signal alone never changes training)
    [prior] = _feed(det, 7005, [1e6])
    assert prior is not None and prior.severity is Severity.WARNING


def test_grace_state_round_trips() -> None:
    det = EWSpike("grad_norm")
    _feed(det, 5, [1.0, 1.1])  # fresh run at step 5: scores from step 10
    clone = EWSpike("grad_norm")
    clone.load_state_dict(det.state_dict())
    assert clone._warmup_until == det._warmup_until == 10
    assert clone.in_grace is det.in_grace
    assert _feed(clone, 10, [1e4])[0] is not None

