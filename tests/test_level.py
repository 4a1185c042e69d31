"""The ``level`` detector: a value past an absolute bar (the max attention logits past QK-clip's tau = 100)."""

from __future__ import annotations

import math

import pytest

from stabmon.detect import DetectorSuite, Level
from stabmon.detect.rules import LevelConfig
from stabmon.events import Severity, StepRecord

HEAD = "attn_logit/h.0/1"


def test_warning_above_the_bar_then_error_when_it_persists() -> None:
    d = Level(HEAD, LevelConfig(bar=100.0, persist=2))
    found = [d.update(step, {HEAD: v}) for step, v in enumerate([5.0, 99.0, 100.0, 150.0, 160.0, 170.0, 20.0, 120.0])]
    assert [(a.step, a.severity) if a else None for a in found] == [
        None, None, None, (3, Severity.WARNING), (4, Severity.ERROR), (5, Severity.ERROR), None, (7, Severity.WARNING)]
    assert found[3].message == f"{HEAD} is 150, above its bar 100 (1 record(s) in a row)"


def test_the_evidence_starts_at_the_last_record_under_the_bar() -> None:
    # a runbook's onset (where a rollback restores to, where a diagnosis looks from) is the first evidence step:
    # on a metric sampled every 10 steps a window of 20 records would put it 200 steps before the trouble
    d = Level(HEAD, LevelConfig(persist=3))
    values = [5.0 + i for i in range(20)] + [150.0, 160.0, 170.0]  # sampled every 10 steps: 0, 10, ..., 220
    found = [d.update(10 * i, {HEAD: v}) for i, v in enumerate(values)]
    error = found[-1]
    assert error is not None and error.severity == Severity.ERROR
    assert [s for s, _ in error.evidence] == [190, 200, 210, 220]
    assert [s for s, _ in found[-3].evidence] == [190, 200]


def test_non_finite_and_slow_climbs() -> None:
    d = Level(HEAD)
    assert d.update(0, {HEAD: math.nan}) is None and d.update(1, {HEAD: math.inf}) is None  # NonFinite's to judge
    climb = [d.update(step, {HEAD: 50.0 + 10.0 * step}) for step in range(2, 12)]  # no baseline needed
    assert [a.step for a in climb if a][0] == 6


def test_the_default_suite_holds_attention_logits_under_100_and_nothing_else() -> None:
    suite = DetectorSuite.from_config()
    quiet = {"loss": 2.0, "grad_norm": 1.0, "attn_logit": 40.0, "attn_logit/h.0": 40.0, HEAD: 40.0}
    assert not [a for a in suite.update(StepRecord(0, quiet)) if a.kind == "level"]
    loud = suite.update(StepRecord(10, {**quiet, "attn_logit": 400.0, "attn_logit/h.0": 400.0, HEAD: 400.0,
                                        "logit_max": 400.0, "moment_ratio": 400.0}))
    assert sorted(a.metric for a in loud if a.kind == "level") == ["attn_logit/h.0", HEAD]


@pytest.mark.parametrize(("override", "message"), [
    ("level.bar=0", r"^detectors\.level\.bar must be > 0, got 0\.0$"),
    ("level.persist=0", r"^detectors\.level\.persist must be >= 1, got 0$"),
    ("level.bars=3", r"^detectors\.level\.bars is not a known setting"),
])
def test_bad_settings_are_one_line_errors(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DetectorSuite.from_config(overrides=[override])
