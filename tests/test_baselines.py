"""Peer rules: each follows its reference implementation's semantics and round-trips its state."""

from __future__ import annotations

import math
import pickle

import pytest

from stabmon.events import StepRecord
from stabmon.replay.baselines import (
    PEER_RULES,
    KillLossSpike,
    LightningSpikeDetection,
    MegatronSpikyLoss,
    OlmoStabilityMonitor,
    ZClip,
    peer_rules,
)


def feed(rule, values, metric="loss", start=0):
    return [rule.update(StepRecord(start + i, {metric: v})) for i, v in enumerate(values)]


def test_kill_loss_spike_window_and_patience() -> None:
    assert KillLossSpike(total_steps=143_000).window_size == 7150  # 5% of the run
    assert KillLossSpike(total_steps=1000).window_size == 100  # never below 100
    rule = KillLossSpike(total_steps=0)
    flags = feed(rule, [2.0] * 100 + [5.0] * 4 + [2.0] + [5.0] * 5)
    assert not any(flags[:109])  # 4 outliers, a normal loss resets the count, then 4 more
    assert flags[109]  # the 5th consecutive outlier (> patience 4)


def test_kill_loss_spike_high_loss() -> None:
    rule = KillLossSpike(total_steps=0)
    flags = feed(rule, [11.0] * 201)
    assert not any(flags[:200]) and flags[200]  # after 2 windows, half the window above the cap of 10


def test_olmo_needs_history_and_uses_six_sigma() -> None:
    rule = OlmoStabilityMonitor()
    base = [2.0 + (0.1 if i % 2 else -0.1) for i in range(63)]
    assert not any(feed(rule, base + [100.0]))  # only 63 values before the jump: not active yet
    rule = OlmoStabilityMonitor()
    feed(rule, base + [2.1])
    assert rule.update(StepRecord(64, {"loss": 2.0 + 0.65}))  # mean 2, std 0.1 -> threshold 2.6
    assert not OlmoStabilityMonitor().update(StepRecord(0, {"grad_norm": 5.0}))


def test_olmo_constant_series_never_flags() -> None:
    rule = OlmoStabilityMonitor()
    assert not any(feed(rule, [1.0] * 200 + [1.5]))  # std < 1e-10: no check, as in OLMo-core


def test_zclip_warmup_then_zscore() -> None:
    rule = ZClip()
    flags = feed(rule, [1.0, 1.2] * 12 + [1.0], metric="grad_norm")  # 25 warm-up norms
    assert not any(flags)
    assert rule.mean == pytest.approx(sum([1.0, 1.2] * 12 + [1.0]) / 25)
    assert not rule.update(StepRecord(25, {"grad_norm": 1.2}))
    assert rule.update(StepRecord(26, {"grad_norm": 3.0}))
    assert not ZClip().update(StepRecord(0, {"loss": 9.0}))  # needs a grad norm


def test_lightning_spike_rules() -> None:
    rule = LightningSpikeDetection()
    assert not rule.update(StepRecord(0, {"loss": 100.0}))  # warm-up: batch 0 is never a spike
    rule = LightningSpikeDetection()
    flags = feed(rule, [1.0] * 5 + [2.9, 4.5, float("nan"), 0.5])
    assert flags == [False] * 5 + [False, True, True, False]  # >= rtol 2 above the mean; NaN; improvement


def test_megatron_reference_is_first_hundred() -> None:
    rule = MegatronSpikyLoss()
    flags = feed(rule, [5.0] + [2.0] * 99 + [49.0, 50.0, float("inf")])
    assert flags[-3:] == [False, True, True]


@pytest.mark.parametrize("cls", PEER_RULES)
def test_state_round_trip_and_pickle(cls) -> None:
    values = [2.0 + 0.01 * math.sin(i) for i in range(300)] + [9.0, 2.0, 8.0]
    a = cls()
    feed(a, values[:150], metric="grad_norm" if cls is ZClip else "loss")
    b = cls()
    b.load_state_dict(pickle.loads(pickle.dumps(a.state_dict())))
    metric = "grad_norm" if cls is ZClip else "loss"
    assert feed(a, values[150:], metric=metric, start=150) == feed(b, values[150:], metric=metric, start=150)


def test_peer_rules_names() -> None:
    assert [r.name for r in peer_rules(total_steps=10)] == [
        "llm_foundry",
        "olmo_core",
        "zclip",
        "lightning",
        "megatron",
    ]
