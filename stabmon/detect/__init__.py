"""Online anomaly detection on the StepRecord stream, built on river.

:class:`DetectorSuite` is what the pipeline runs; each detector follows the contract in :mod:`.base`
(``learn_one`` / ``score_one``, grace period, protect filter, ``state_dict``). :class:`HangWatchdog` is the
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
from stabmon.detect.rules import LossScaleCollapse, MissingMetric, NonFinite
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
    "LossScaleCollapse",
    "MissingMetric",
    "NonFinite",
    "RobustSpike",
    "StepTimeRegression",
    "Straggler",
    "apply_overrides",
    "parse_config",
]
