"""Interventions: the changes a runbook can make to a training run, one file per action.

``INTERVENTIONS`` maps action names to classes (each module registers its own,
:mod:`stabmon.interventions.registry`); :func:`get_intervention` looks one up, :func:`register` adds a custom one
(it then becomes usable in runbooks loaded afterwards). :class:`Executor` applies decisions.

>>> sorted(INTERVENTIONS)  # doctest: +NORMALIZE_WHITESPACE
['adaptive_clip', 'alert_only', 'checkpoint_and_stop', 'clip_update', 'diagnose', 'qk_clip', 'reset_moments',
 'rollback', 'scale_layer_lr', 'scale_lr', 'set_beta2', 'set_clip', 'set_weight_decay', 'skip_step']
"""

from __future__ import annotations

from stabmon.interventions._state import RunFacts, StateIntervention, not_applicable, run_facts
from stabmon.interventions.adaptive_clip import AdaptiveClip
from stabmon.interventions.alert_only import AlertOnly
from stabmon.interventions.base import Intervention, InterventionError, Params
from stabmon.interventions.checkpoint_and_stop import STOP_EXIT_CODE, CheckpointAndStop
from stabmon.interventions.clip_update import ClipUpdate
from stabmon.interventions.diagnose import Diagnose
from stabmon.interventions.executor import Executor
from stabmon.interventions.handle import CannotAct, Handle, Training, training_of
from stabmon.interventions.qk_clip import QkClip
from stabmon.interventions.registry import INTERVENTIONS, get_intervention, register
from stabmon.interventions.reset_moments import ResetMoments
from stabmon.interventions.rollback import Rollback
from stabmon.interventions.scale_layer_lr import ScaleLayerLr
from stabmon.interventions.scale_lr import ScaleLr
from stabmon.interventions.set_beta2 import SetBeta2
from stabmon.interventions.set_clip import SetClip
from stabmon.interventions.set_weight_decay import SetWeightDecay
from stabmon.interventions.skip_step import SkipStep
from stabmon.interventions.traits import REVERT, Traits, traits_of

__all__ = [
    "INTERVENTIONS", "STOP_EXIT_CODE", "AdaptiveClip", "AlertOnly", "CannotAct", "CheckpointAndStop", "ClipUpdate",
    "Diagnose", "Executor", "Handle", "Intervention", "InterventionError", "Params", "QkClip", "ResetMoments",
    "Rollback", "RunFacts", "ScaleLayerLr", "ScaleLr", "SetBeta2", "SetClip", "SetWeightDecay", "SkipStep",
    "StateIntervention", "REVERT", "Training", "Traits", "get_intervention", "not_applicable", "register", "run_facts",
    "traits_of", "training_of",
]
