"""Online anomaly detection on the StepRecord stream, built on river.

:class:`DetectorSuite` is what the pipeline runs; each detector follows the contract in :mod:`.base`
(``learn_one`` / ``score_one``, ``state_dict``): a :class:`Scorer` behind the one guard (grace period, protect
filter, streak, evidence), or a :class:`Rule` that judges the history itself. :class:`HangWatchdog` is the
live-only hang detector the Monitor starts.

>>> suite = DetectorSuite.from_config({"spike": {"z_threshold": 5}}, overrides=["drift.enabled=false"])
>>> sorted(d.name for d in suite.detectors)[:3]
['divergence', 'loss_scale', 'missing']
"""

from __future__ import annotations

from stabmon.detect.base import Detector
from stabmon.detect.config import apply_overrides
from stabmon.detect.fleet import Divergence, Straggler
from stabmon.detect.hang import HangWatchdog
from stabmon.detect.progress import LossRegression, NoProgress
from stabmon.detect.rule import Rule
from stabmon.detect.rules import Level, LossScaleCollapse, MissingMetric, NonFinite, OutOfLine
from stabmon.detect.scorer import Scorer
from stabmon.detect.spike import EWSpike, RobustSpike
from stabmon.detect.suite import DETECTORS, DetectorSuite, parse_config
from stabmon.detect.trends import Drift, FrozenEmbedding, StepTimeRegression

__all__ = [
    "DETECTORS",
    "Detector",
    "DetectorSuite",
    "Divergence",
    "Drift",
    "EWSpike",
    "FrozenEmbedding",
    "HangWatchdog",
    "Level",
    "OutOfLine",
    "LossRegression",
    "LossScaleCollapse",
    "MissingMetric",
    "NoProgress",
    "NonFinite",
    "RobustSpike",
    "Rule",
    "Scorer",
    "StepTimeRegression",
    "Straggler",
    "apply_overrides",
    "parse_config",
]
