"""``no_progress`` judges a run from scratch whose weights thrash at ``early_step`` (50), not only at ``by_step``
(100): the same verdict, made once its strongest corroboration is there, so the restart from step 0 re-trains
half as many steps. Without thrashing updates nothing changes."""

from __future__ import annotations

from typing import Any

from stabmon.detect.progress import NoProgress, NoProgressConfig
from stabmon.events import Severity

FLAT = 2.5  # a plateau less than 10% below the first losses


def _losses(step: int) -> float:
    return 2.7 - 0.01 * step if step < 10 else FLAT


def _run(d: NoProgress, steps: range, update_ratio: float | None, loss: Any = _losses) -> list[tuple[int, str]]:
    found = []
    for s in steps:
        x = {"loss": loss(s)} if update_ratio is None else {"loss": loss(s), "update_ratio": update_ratio}
        a = d.update(s, x)
        if a is not None:
            found.append((a.step, a.severity.value))
    return found


def test_a_run_that_thrashes_without_learning_is_an_error_at_step_50_and_not_reported_again_at_100() -> None:
    d = NoProgress("loss")
    assert _run(d, range(150), update_ratio=0.04) == [(50, "error")]


def test_without_thrashing_updates_the_judgement_waits_for_by_step() -> None:
    assert _run(NoProgress("loss"), range(150), update_ratio=0.004) == [(100, "info")]  # a healthy run's size
    assert _run(NoProgress("loss"), range(150), update_ratio=None) == [(100, "info")]  # nothing measured them


def test_a_run_that_learned_is_never_judged_early_however_hard_its_weights_move() -> None:
    falling = lambda s: 2.7 * 0.995 ** s  # noqa: E731 - 10% below its start by step 21
    assert _run(NoProgress("loss"), range(150), update_ratio=0.05, loss=falling) == []


def test_early_step_0_turns_it_off() -> None:
    d = NoProgress("loss", NoProgressConfig(early_step=0))
    assert _run(d, range(150), update_ratio=0.04) == [(100, "error")]


def test_after_a_rollback_to_the_start_the_run_is_judged_again_and_the_state_survives_a_resume() -> None:
    d = NoProgress("loss")
    assert _run(d, range(60), update_ratio=0.04) == [(50, "error")]
    resumed = NoProgress("loss")
    resumed.load_state_dict(d.state_dict())
    assert _run(resumed, range(60, 120), update_ratio=0.04) == []  # judged: not again at 100
    # a restart from step 0 with the LR capped: thrashing again, judged again at 50; calm, judged at by_step as
    # before (info: nothing else corroborates it in this stream)
    again = NoProgress("loss")
    again.load_state_dict(resumed.state_dict())
    assert _run(again, range(0, 60), update_ratio=0.04) == [(50, "error")]
    calm = NoProgress("loss")
    calm.load_state_dict(resumed.state_dict())
    assert _run(calm, range(0, 120), update_ratio=0.004) == [(100, "info")]


def test_a_sparse_log_is_judged_early_on_half_the_records_by_step_needs() -> None:
    d = NoProgress("loss")  # logged every 10 steps: by_step is 20 records (200 steps), the early judgement 10
    assert _run(d, range(0, 300, 10), update_ratio=0.04) == [(100, Severity.ERROR.value)]
