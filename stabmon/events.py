"""Events passed between stabmon's stages.

Data flows one way, one event type per arrow::

    collectors -> StepRecord -> detectors -> Anomaly -> engine -> Decision
    executor -> InterventionRecord;  engine (after observing) -> Outcome

Every event is a frozen dataclass with plain-Python fields (str, int, float, enums, tuples, mappings of those), so
it can be pickled and compared. :func:`to_dict` is the one conversion to JSON-ready dicts (enums as values,
tuples as lists); the store maps events to table rows with :func:`stabmon.store.codec.event_row`, which also
encodes NaN and infinities for JSON columns.

Metric names are flat strings; the well-known ones are listed in :class:`Metric`. Per-module metrics append
``/<module name>`` to a base name, e.g. ``grad_norm/transformer.h.0``.

>>> r = StepRecord(step=3, metrics={"loss": 2.5, "grad_norm": 0.7})
>>> r.get("loss"), r.get("loss_scale")
(2.5, None)
>>> to_dict(r)["metrics"]["grad_norm"]
0.7
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Metric:
    """Well-known metric names. Importers and collectors must use these for the signals they share."""

    LOSS = "loss"
    VAL_LOSS = "val_loss"
    GRAD_NORM = "grad_norm"  # global L2 norm of the (unscaled) gradients, before clipping
    LOSS_SCALE = "loss_scale"  # fp16 dynamic loss scale in force for the step
    OVERFLOW = "overflow"  # 1.0 when the step overflowed (optimizer update skipped by the scaler), else 0.0
    SKIPPED = "skipped"  # 1.0 when stabmon's own skip_step guard discarded this update
    NONFINITE = "nonfinite"  # count of gradient tensors holding a NaN/inf (0 on healthy steps)
    STEP_TIME = "step_time"  # host wall-clock seconds for the step
    LR = "lr"  # learning rate in force (param group 0), overrides included
    BETA2 = "beta2"
    WEIGHT_DECAY = "weight_decay"
    CLIP = "clip"  # max_norm in force (inf when not clipping)
    TOKENS_PER_SEC = "tokens_per_sec"
    # where a run's wall time went between steps (host values, only on the steps they concern; stabmon.goodput)
    SEGMENT_START = "segment_start"  # UNIX time this process's monitor started: on the first step of each process
    CHECKPOINT_TIME = "checkpoint_time"  # seconds the monitor spent saving a checkpoint just before this step
    OUTSIDE_TIME = "outside_time"  # seconds the loop spent between the previous step's end and this step's begin
    MONITOR_TIME = "monitor_time"  # seconds the monitor spent between the previous step's end and this step's clock
    #                                start (its flush, a checkpoint), on a monotonic clock; >= 1 ms only
    STARTUP_TIME = "startup_time"  # seconds from this process's monitor start to its first step, monotonic clock
    # under torch.distributed: this rank's own values (gathered per rank, see stabmon.collect.cluster.ranks)
    GRAD_NORM_LOCAL = "grad_norm_local"  # norm of this rank's gradient shards (DDP: its reduced gradients)
    BUSY_TIME = "busy_time"  # host seconds from the step's start to the end of the model's forward
    PARAM_CHECKSUM = "param_checksum"  # position-weighted parameter sums and norms (DDP replicas: equal)
    # fleet summaries of the gathered per-rank values
    FLEET_STEP_TIME = "fleet/step_time"  # median over ranks of the step time
    STRAGGLER_RATIO = "fleet/straggler_ratio"  # slowest rank's time / median time
    STRAGGLER_RANK = "fleet/straggler_rank"
    DIVERGENCE = "fleet/divergence"  # largest relative distance from the median of values replicas share
    DIVERGENT_RANK = "fleet/divergent_rank"
    NONFINITE_RANKS = "fleet/nonfinite_ranks"  # ranks with a non-finite loss or local gradient norm
    # per-module prefixes: f"{prefix}/{name}"
    GRAD_NORM_PREFIX = "grad_norm/"
    ACT_RMS_PREFIX = "act_rms/"
    EMB_DRIFT_PREFIX = "emb_drift/"  # ||W - W0|| / ||W0||
    EMB_UPDATE_PREFIX = "emb_update/"  # ||W_t - W_{t-1}|| / ||W_t||
    UPDATE_RATIO = "update_ratio"  # ||Δθ|| / ||θ|| of the step applied (after clipping, overrides, skips)
    UPDATE_RATIO_PREFIX = "update_ratio/"  # the same per layer (the layers of the per-layer grad norms)
    # signals with lead (sampled steps, off by default; stabmon.collect.signals.moment_ratio / attention / logits)
    MOMENT_RATIO = "moment_ratio"  # max over tensors of RMS(g² / v̂): Adam's second moment under-estimating g²
    MOMENT_RATIO_PREFIX = "moment_ratio/"  # the same per tensor: f"moment_ratio/{parameter name}"
    ATTN_LOGIT = "attn_logit"  # max attention logit q·k·scale over layers and heads (a sampled sub-batch)
    ATTN_LOGIT_PREFIX = "attn_logit/"  # per layer f"attn_logit/{module}", per head f"attn_logit/{module}/{head}"
    LOGIT_MAX = "logit_max"  # max |output logit| (a sampled sub-batch)
    LOGIT_LOGZ = "logit_logz"  # max |log Z| of the output softmax over positions (what z-loss penalises)
    UNTRAINED_LOSS = "untrained_loss"  # ln(output classes): an untrained model's loss, recorded once (collect/vocab)


NOT_OF_THE_MODEL = frozenset({"step_time", "hang", "missing", "straggler"})
"""Anomaly kinds about time and bookkeeping, not the model's state: never a sign of damage (the runbook engine's
first signs) nor a reason to flush sooner (``MonitorConfig.watch``)."""


class Severity(str, Enum):
    """How bad an anomaly is. Ordered: ``INFO < WARNING < ERROR < CRITICAL``."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return _SEVERITY_RANK[self]

    def __ge__(self, other: object) -> bool:  # type: ignore[override]
        if not isinstance(other, Severity):
            return NotImplemented
        return self.rank >= other.rank

    def __gt__(self, other: object) -> bool:  # type: ignore[override]
        if not isinstance(other, Severity):
            return NotImplemented
        return self.rank > other.rank

    def __le__(self, other: object) -> bool:  # type: ignore[override]
        if not isinstance(other, Severity):
            return NotImplemented
        return self.rank <= other.rank

    def __lt__(self, other: object) -> bool:  # type: ignore[override]
        if not isinstance(other, Severity):
            return NotImplemented
        return self.rank < other.rank


_SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.ERROR: 2, Severity.CRITICAL: 3}


def new_id() -> str:
    """A short random identifier for events (12 hex characters)."""
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True, slots=True)
class StepRecord:
    """Everything measured for one optimizer step.

    ``metrics`` maps metric names (see :class:`Metric`) to floats; NaN and inf are legal values and mean the
    training produced them. A metric that was not measured this step is absent, not NaN.
    ``batch_index`` is the data position of the step's batch (the monitor's data cursor), when known.
    ``time`` is a UNIX timestamp taken when the step ended, when known.
    """

    step: int
    metrics: Mapping[str, float]
    batch_index: int | None = None
    time: float | None = None

    def get(self, name: str, default: float | None = None) -> float | None:
        return self.metrics.get(name, default)

    def finite(self, name: str) -> float | None:
        """The metric's value if present and finite, else None."""
        v = self.metrics.get(name)
        return v if v is not None and math.isfinite(v) else None


@dataclass(frozen=True, slots=True)
class Anomaly:
    """A detector's finding: ``metric`` behaved like ``kind`` at ``step``.

    ``evidence`` holds the recent (step, value) window the detector judged, oldest first, including the flagged
    point. ``score`` is detector-specific (higher = more anomalous); ``threshold`` is the score it had to reach.
    """

    kind: str  # spike | nonfinite | missing | loss_scale_collapse | drift | frozen_embedding | step_time | hang
    metric: str
    step: int
    score: float
    severity: Severity
    detector: str
    evidence: tuple[tuple[int, float], ...] = ()
    threshold: float | None = None
    message: str = ""
    id: str = field(default_factory=new_id)


class DecisionStatus(str, Enum):
    PROPOSED = "proposed"  # waiting for a human (propose mode)
    APPROVED = "approved"  # a human said yes; to be applied at the next flush
    APPLY = "apply"  # apply mode: apply now
    APPLIED = "applied"
    REJECTED = "rejected"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class Decision:
    """The engine's choice of ONE intervention in answer to an anomaly.

    ``action`` names an intervention (``scale_lr``, ``set_clip``, ``set_beta2``, ``set_weight_decay``,
    ``rollback``, ``checkpoint_and_stop``, ``skip_step``, ``alert_only``) or ``revert`` (undo the intervention
    named in ``params["intervention_id"]``). ``rule`` and ``rung`` locate it in the runbook.
    """

    step: int
    action: str
    params: Mapping[str, Any]
    status: DecisionStatus
    runbook: str
    rule: str
    rung: int
    reason: str
    anomaly_id: str | None = None
    incident_id: str | None = None
    id: str = field(default_factory=new_id)


@dataclass(frozen=True, slots=True)
class InterventionRecord:
    """What applying (or reverting) a decision changed: the values in force before and after.

    ``error`` is set when the application failed (the rung is judged failed), ``not_applied`` when the
    intervention was skipped because it would change nothing or only do harm (the runbook moves on); ``after``
    then holds no values. The store and :func:`to_dict` keep both reasons inside ``after`` (under those keys), the
    form every stored run has: :meth:`stored_after` folds them in, :meth:`from_stored` takes them out again.

    >>> rec = InterventionRecord("d1", 5, "set_clip", {}, {}, error="RuntimeError: boom")
    >>> dict(rec.stored_after())
    {'error': 'RuntimeError: boom'}
    >>> InterventionRecord.from_stored(decision_id="d1", step=5, action="set_clip", before={},
    ...                                after={"error": "RuntimeError: boom"}, id=rec.id) == rec
    True
    """

    decision_id: str
    step: int
    action: str
    before: Mapping[str, Any]
    after: Mapping[str, Any]
    reverted: bool = False  # True for the record of a revert
    simulated: bool = False  # True in replay
    id: str = field(default_factory=new_id)
    error: str | None = None  # the application failed: "ExceptionType: message"
    not_applied: str | None = None  # skipped: why it would change nothing or do harm

    @property
    def ok(self) -> bool:
        """Applied (or reverted) without an error; a skipped intervention is ok, it did no harm."""
        return self.error is None

    def stored_after(self) -> Mapping[str, Any]:
        """``after`` with the reason a failed or skipped application gives, as stored (``error`` / ``not_applied``
        keys)."""
        if self.error is None and self.not_applied is None:
            return self.after
        out = dict(self.after)
        if self.not_applied is not None:
            out["not_applied"] = self.not_applied
        if self.error is not None:
            out["error"] = self.error
        return out

    @classmethod
    def from_stored(cls, *, after: Mapping[str, Any], **fields: Any) -> InterventionRecord:
        """The record of a stored row or event dict (inverse of :meth:`stored_after`)."""
        values = dict(after)
        error, not_applied = values.pop("error", None), values.pop("not_applied", None)
        return cls(after=values, error=None if error is None else str(error),
                   not_applied=None if not_applied is None else str(not_applied), **fields)


class Verdict(str, Enum):
    RESOLVED = "resolved"
    ESCALATED = "escalated"  # not resolved; the next rung follows
    REVERTED = "reverted"  # not resolved and the change was undone
    STOPPED = "stopped"  # the ladder ended in a stop
    EXHAUSTED = "exhausted"  # not resolved and no rung left
    SUPERSEDED = "superseded"  # an alert-only incident closed early: an anomaly a rule acts on arrived
    RELEASED = "released"  # resolved, and the changes were given back with the run staying quiet
    KEPT = "kept"  # resolved, but the trouble came back when the changes were given back: they were put back


@dataclass(frozen=True, slots=True)
class Outcome:
    """The engine's judgement of an intervention after its observation window."""

    intervention_id: str | None
    decision_id: str
    step: int
    verdict: Verdict
    evidence: Mapping[str, Any]  # the metrics that judged it (e.g. signal max, loss vs baseline)
    incident_id: str | None = None
    id: str = field(default_factory=new_id)


Event = StepRecord | Anomaly | Decision | InterventionRecord | Outcome


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


_FOLDED = frozenset({"error", "not_applied"})  # InterventionRecord fields kept inside ``after`` when serialised


def to_dict(event: Event) -> dict[str, Any]:
    """A JSON-ready dict of an event (enums as their values, tuples as lists), with its type under ``type``.
    An intervention record's ``error`` / ``not_applied`` travel inside ``after`` (see
    :meth:`InterventionRecord.stored_after`)."""
    if isinstance(event, InterventionRecord):
        out = {f.name: _plain(getattr(event, f.name)) for f in dataclasses.fields(event) if f.name not in _FOLDED}
        out["after"] = _plain(event.stored_after())
    else:
        out = {f.name: _plain(getattr(event, f.name)) for f in dataclasses.fields(event)}
    out["type"] = type(event).__name__
    return out
