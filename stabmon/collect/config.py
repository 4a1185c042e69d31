"""Configuration of the live monitor and its collectors.

Each collector owns a small nested config; every field has a docstring and invalid values raise a one-line
``ValueError`` naming the dotted path.

>>> cfg = MonitorConfig(clip=1.0, activations=ActivationConfig(every=5))
>>> cfg.activations.every, cfg.flush_every
(5, 20)
>>> MonitorConfig(flush_every=0)
Traceback (most recent call last):
...
ValueError: config.flush_every must be >= 1, got 0
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from stabmon.checkpoints import STOP_EXIT_CODE

HANG_EXIT_CODE = 87
"""Suggested ``config.hang.exit_code``: the process ended itself because it was hung (distinct from success,
crashes, signals and :data:`EXIT_STOP`), so a scheduler can restart the job from its last checkpoint."""
EXIT_STOP = STOP_EXIT_CODE
"""Exit code a training script should use when the monitor asked it to stop (checkpoint-and-stop, kill
switch): the project-wide :data:`stabmon.checkpoints.STOP_EXIT_CODE`, distinct from success (0) and crashes
(1, signals)."""
DEFAULT_CHECKPOINT_EVERY = 100
"""Checkpoint cadence of a monitor given somewhere to save (``checkpoint_dir=``) and no ``checkpoint_every``: a
rollback then always has a checkpoint at most this many steps (plus a flush) before an incident's onset."""


@dataclass
class GradConfig:
    """Gradient norms: global (always) and per layer."""

    layers: tuple[str, ...] | None = None
    """Regular expressions matched (``re.match``) against parameter names; each distinct matched prefix is one
    layer, e.g. ``r"transformer\\.h\\.\\d+"``. None: one layer per block (each child of the first ModuleList)
    and per other leaf module. An empty tuple turns per-layer norms off."""
    skip_ema: float = 0.98
    """Decay of the running mean of the grad norm used by the skip_step guard."""

    def validate(self, path: str) -> None:
        if not 0.0 < self.skip_ema < 1.0:
            raise ValueError(f"{path}.skip_ema must be in (0, 1), got {self.skip_ema}")
        if self.layers is not None and isinstance(self.layers, str):
            raise ValueError(f"{path}.layers must be a sequence of patterns, not a string")


@dataclass
class ActivationConfig:
    """Activation RMS of selected modules' outputs, through forward hooks on sampled steps only."""

    every: int = 10
    """Sample every ``every`` steps (0 turns activation norms off)."""
    modules: tuple[str, ...] | None = None
    """Regular expressions fully matched against module names. None: each child of the first ModuleList
    (the transformer blocks), else each top-level child module."""

    def validate(self, path: str) -> None:
        if self.every < 0:
            raise ValueError(f"{path}.every must be >= 0, got {self.every}")
        if self.modules is not None and isinstance(self.modules, str):
            raise ValueError(f"{path}.modules must be a sequence of patterns, not a string")


@dataclass
class UpdateConfig:
    """Update norm ``||Δθ|| / ||θ||`` (global and per layer) of the step actually applied, on sampled steps
    (:mod:`stabmon.collect.signals.updates`)."""

    every: int | None = None
    """Sample every ``every`` steps (0: off). None (the default): every :data:`UPDATE_EVERY` steps where it costs
    no copy, torch's Adam/AdamW (without amsgrad or maximize) in one process, under DDP or FSDP2, whose step is
    recomputed from the optimizer state after it; off elsewhere. With another optimizer, or FSDP1's flat
    parameters, a sampled step holds one transient copy of the parameters from the optimizer's pre-hook to its
    post-hook, which is why it is on there only when asked for. The per-layer ratios feed the ``out_of_line``
    detector, which names the layer a ``scale_layer_lr`` rung cuts the LR of."""

    def validate(self, path: str) -> None:
        if self.every is not None and (isinstance(self.every, bool) or not isinstance(self.every, int)
                                       or self.every < 0):
            raise ValueError(f"{path}.every must be None or an int >= 0, got {self.every!r}")


UPDATE_EVERY = 20
"""``UpdateConfig.every``'s period where None turns it on (Adam/AdamW; not FSDP1)."""


@dataclass
class MomentConfig:
    """Second-moment ratio ``RMS(g² / v̂)`` of each tensor, from Adam/AdamW's ``exp_avg_sq``
    (:mod:`stabmon.collect.signals.moment_ratio`): high when a tensor's gradient is far above what its second moment
    expects, which precedes loss spikes (StableAdamW, arXiv 2304.13013)."""

    every: int = 0
    """Sample every ``every`` steps (0: off, the default until the cost is measured). A sampled step makes one
    pass over each tensor's gradient and ``exp_avg_sq`` inside the optimizer's pre-hook (one tensor's fp32
    transient at a time); others pay nothing."""
    per_tensor: bool = True
    """Record ``moment_ratio/<parameter>`` for every tensor besides the max over tensors (``moment_ratio``)."""

    def validate(self, path: str) -> None:
        if self.every < 0:
            raise ValueError(f"{path}.every must be >= 0, got {self.every}")


@dataclass
class AttentionConfig:
    """Max attention logit ``q·k / sqrt(d)`` per layer and head on a sub-batch of sampled steps
    (:mod:`stabmon.collect.signals.attention`): attention-logit growth precedes the divergence of high-LR transformers
    without QK-layernorm (Wortsman et al. 2023)."""

    every: int = 0
    """Sample every ``every`` steps (0: off, the default until the cost is measured). Only sampled forward
    passes are hooked."""
    sub_batch: int = 1
    """Sequences of the batch (the first ones) whose query-key products are recomputed."""
    heads: bool = True
    """Record ``attn_logit/<layer>/<head>`` for every head besides the per-layer max ``attn_logit/<layer>``."""
    modules: tuple[str, ...] | None = None
    """Regular expressions fully matched against module names; None: every recognised attention module
    (``nn.MultiheadAttention``, modules calling ``F.scaled_dot_product_attention``, Hugging Face GPT-2/Llama
    attention, classes registered with :func:`stabmon.collect.signals.attention.register_attention`)."""

    def validate(self, path: str) -> None:
        if self.every < 0:
            raise ValueError(f"{path}.every must be >= 0, got {self.every}")
        if self.sub_batch < 1:
            raise ValueError(f"{path}.sub_batch must be >= 1, got {self.sub_batch}")
        if self.modules is not None and isinstance(self.modules, str):
            raise ValueError(f"{path}.modules must be a sequence of patterns, not a string")


@dataclass
class LogitConfig:
    """Scale of the output logits on a sub-batch of sampled steps (:mod:`stabmon.collect.signals.logits`): ``logit_max``
    (max |logit|) and ``logit_logz`` (max |log Z|, what z-loss penalises; Wortsman et al. 2023)."""

    every: int = 0
    """Sample every ``every`` steps (0: off, the default until the cost is measured)."""
    sub_batch: int = 1
    """Leading rows (sequences) of the output whose logits are measured."""
    module: str | None = None
    """Name of the output layer; None: the model's last ``nn.Linear`` when it maps onto the vocabulary (see
    :mod:`stabmon.collect.signals.vocab`), else the signal is not applicable."""

    def validate(self, path: str) -> None:
        if self.every < 0:
            raise ValueError(f"{path}.every must be >= 0, got {self.every}")
        if self.sub_batch < 1:
            raise ValueError(f"{path}.sub_batch must be >= 1, got {self.sub_batch}")


@dataclass
class DiagnoseConfig:
    """What ``diagnose`` (a runbook rung, :mod:`stabmon.diagnose`) keeps while a runbook uses it."""

    batches: int = 256
    """Recent steps whose batch (a reference), RNG state and sample ids the batch log keeps: it must reach
    back from the flush that diagnoses to the checkpoint before the incident (checkpoint interval + the
    incident's length + ``flush_every``), else the verdict is inconclusive."""
    max_bytes: int | None = 1 << 30
    """The most bytes of batch tensors the batch log keeps alive (1 GiB; None: no bound). Past it the oldest
    batches are dropped first; a diagnosis that then cannot reach back to its checkpoint is inconclusive and the
    runbook goes on to its next rung. Token batches are small (256 batches of 8 x 2048 int64 tokens: 32 MiB);
    image batches are not. A loop that hands over batches already on a GPU keeps them there: the bound is then
    GPU memory, and a smaller one (or ``batches``) may suit. Objects other than tensors, lists, tuples and
    mappings count 0 bytes."""
    timeout: float = 300.0
    """Under torch.distributed: seconds each of diagnose's own exchanges between the ranks (plans, results,
    verdict; a gloo group of their own) may wait for a rank before the diagnosis is ``inconclusive``."""

    def validate(self, path: str) -> None:
        if self.batches < 1:
            raise ValueError(f"{path}.batches must be >= 1, got {self.batches}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ValueError(f"{path}.max_bytes must be >= 1 (or None: no bound), got {self.max_bytes}")
        if not self.timeout > 0:
            raise ValueError(f"{path}.timeout must be > 0 seconds, got {self.timeout}")


@dataclass
class EmbeddingConfig:
    """Drift ``||W - W0|| / ||W0||`` and update ratio ``||W_t - W_{t-1}|| / ||W_t||`` of every
    nn.Embedding."""

    every: int = 10
    """Sample every ``every`` steps (0 turns embedding signals off). The update ratio is always one step's."""
    rows: int | None = 1024
    """Track at most this many rows of each embedding (evenly spaced, fixed for the run); None tracks every
    row. The monitor keeps two copies of the tracked rows (``W0`` and a scratch buffer): 1024 rows of a
    4096-wide fp32 embedding are 32 MiB, the whole of a 128k x 4096 vocabulary would be 4 GiB."""
    reference: str = "device"
    """Where ``W0`` lives: ``"device"`` (beside the weights) or ``"cpu"`` (host memory, pinned on CUDA, copied to
    the device on sampled steps; the scratch buffer then exists only during a sampled step)."""

    def validate(self, path: str) -> None:
        if self.every < 0:
            raise ValueError(f"{path}.every must be >= 0, got {self.every}")
        if self.rows is not None and (isinstance(self.rows, bool) or self.rows < 1):
            raise ValueError(f"{path}.rows must be >= 1 or None, got {self.rows!r}")
        if self.reference not in ("device", "cpu"):
            raise ValueError(f"{path}.reference must be 'device' or 'cpu', got {self.reference!r}")


@dataclass
class HangConfig:
    """The hang watchdog's deadline and what it does when it fires (``MonitorConfig.hang_timeout`` turns it
    on and caps the deadline). The deadline is learned from the run: ``factor`` x the slowest step after the
    ``warmup``, at least ``floor``, at most ``hang_timeout`` (docs/distributed.md, "Hangs")."""

    factor: float = 10.0
    """Learned deadline: ``factor`` x the slowest step time since the warm-up (or of the last ``window``)."""
    floor: float = 40.0
    """Seconds: the learned deadline never goes below this. With steps of up to 4 s a frozen rank is named
    within ``floor`` + one poll (2 s) + 6 s for the other ranks' reports; NCCL's own watchdog waits 10 minutes.
    Work outside the steps is not judged by it: a declared pause (``monitor.paused``), the monitor's own
    checkpoint saves, the HF Trainer's evaluations and checkpoints, Lightning's validation (the cap applies to
    the last three)."""
    learn_after: int = 20
    """Steps timed after the warm-up before the learned deadline replaces ``hang_timeout``."""
    warmup: int = 5
    """First steps timed but not learned (compilation, autotuning, the first batches)."""
    window: int | None = None
    """None: the slowest step since the warm-up; a number: the slowest of the last ``window`` steps (a deadline
    that can shrink again, and then trip on a slow stretch that comes back less often than every ``window``)."""
    stacks: bool = True
    """Put every thread's stack (faulthandler) in the hang anomaly: stored, logged and sent with the alert."""
    exit_code: int | None = None
    """After reporting a hang, end the process with this exit code (suggested: :data:`HANG_EXIT_CODE`) so the
    scheduler restarts the job from its last checkpoint. None: report only, never exit."""

    def validate(self, path: str) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"{path}.factor must be >= 1, got {self.factor}")
        if not self.floor > 0:
            raise ValueError(f"{path}.floor must be > 0, got {self.floor}")
        if self.learn_after < 1:
            raise ValueError(f"{path}.learn_after must be >= 1, got {self.learn_after}")
        if self.window is not None and (isinstance(self.window, bool) or self.window < 1):
            raise ValueError(f"{path}.window must be >= 1 or None, got {self.window!r}")
        if self.warmup < 0:
            raise ValueError(f"{path}.warmup must be >= 0, got {self.warmup}")
        if self.exit_code is not None and not 1 <= self.exit_code <= 255:
            raise ValueError(f"{path}.exit_code must be in [1, 255] or None, got {self.exit_code}")


@dataclass
class SnapshotConfig:
    """The host-memory snapshot tier (:mod:`stabmon.collect.checkpoint.snapshots`): a copy of what a checkpoint
    holds every ``every`` steps, the last ``keep`` of them, that a rollback restores before it reaches for the disk.
    Off by default (``every=0``); it needs checkpoints (``checkpoint_dir=`` or ``checkpoints=``) and a model that is
    not sharded (FSDP: disk checkpoints only, said once at start)."""

    every: int = 0
    """Steps between snapshots (0: no snapshots)."""
    keep: int = 2
    """Snapshots held (the oldest is dropped)."""
    max_bytes: int | None = None
    """Host memory the snapshots may hold in all (None: ``keep`` copies of the state, whatever their size)."""

    def validate(self, path: str) -> None:
        if self.every < 0:
            raise ValueError(f"{path}.every must be >= 0, got {self.every}")
        if self.keep < 1:
            raise ValueError(f"{path}.keep must be >= 1, got {self.keep}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ValueError(f"{path}.max_bytes must be >= 1 or None, got {self.max_bytes}")


@dataclass
class WatchConfig:
    """Closer flushes while something is wrong: after an anomaly at warning or above (a slow step and a hang
    excepted), and while the runbook has an incident open, the monitor flushes every ``flush_every`` steps for the
    next ``steps`` steps instead of every ``MonitorConfig.flush_every``, so that the runbook answers the evidence
    within a few steps of its arrival, not up to a whole flush interval later (a rollback then re-trains fewer
    steps). Each of these flushes is one device-to-host copy, as every flush is, made more often only in that window.
    One process only: under torch.distributed the flushes keep their cadence (every rank must flush on the same
    step)."""

    steps: int = 60
    """Steps the closer cadence lasts after the last anomaly that asked for it (0: never closer)."""
    flush_every: int = 4
    """Steps between flushes meanwhile (a flush interval longer than ``MonitorConfig.flush_every`` changes
    nothing)."""

    def validate(self, path: str) -> None:
        if self.steps < 0:
            raise ValueError(f"{path}.steps must be >= 0, got {self.steps}")
        if self.flush_every < 1:
            raise ValueError(f"{path}.flush_every must be >= 1, got {self.flush_every}")


@dataclass
class MonitorConfig:
    """Everything the live :class:`~stabmon.monitor.Monitor` needs besides the objects it watches."""

    flush_every: int = 20
    """Steps between flushes: one device-to-host copy, then detectors, runbook engine and store."""
    flush_on_nonfinite: bool = True
    """Flush at the end of a step whose loss is NaN or inf (read a step or two late on an accelerator, never
    waiting for it: :mod:`stabmon.collect.signals.alarm`), so the runbook answers within steps, not up to
    ``flush_every`` later. One process only (under torch.distributed the flushes keep their cadence)."""
    flush_on_rise: float | None = 1.5
    """With ``flush_on_nonfinite``, also flush at the end of a step whose loss is this many times the running mean
    of the losses before it (after 20 steps; None: only NaN or inf). A loss spike is then seen, and answered, at
    its own step rather than up to ``flush_every`` steps later; it moves a flush, never a decision (the detectors
    judge the records as at any flush)."""
    clip: float | None = None
    """Gradient clipping max_norm applied by the monitor (do not clip yourself). None measures only; an
    intervention can still set one through overrides."""
    grads: GradConfig = field(default_factory=GradConfig)
    activations: ActivationConfig = field(default_factory=ActivationConfig)
    embeddings: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    updates: UpdateConfig = field(default_factory=UpdateConfig)
    moments: MomentConfig = field(default_factory=MomentConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    logits: LogitConfig = field(default_factory=LogitConfig)
    diagnose: DiagnoseConfig = field(default_factory=DiagnoseConfig)
    checkpoint_every: int | None = None
    """Save a checkpoint every N steps through the checkpoint manager, and one of the initial state before the
    first step. None (the default): every :data:`DEFAULT_CHECKPOINT_EVERY` steps when the monitor can save
    (``checkpoint_dir=``, or ``checkpoints=`` with a ``save=``), else never; 0: never (rollback then needs the
    checkpoints you save and register yourself)."""
    checkpoint_keep: int = 3
    """How many of its own checkpoints the manager keeps (the CheckpointManager's default). With
    ``checkpoint_every`` it bounds how far back a rollback can reach: PaLM's recipe looks 100-200 steps back, so
    with a checkpoint every 50 steps keep at least 6."""
    kill_switch: str | None = None
    """A file path: when it exists at a flush, the monitor checkpoints and asks the loop to stop."""
    exit_code: int = EXIT_STOP
    """Exit code reported by :attr:`Monitor.exit_code` after a requested stop."""
    grace_steps: int | None = None
    """Detector grace period after a resume (None: the detectors' own default)."""
    hang_timeout: float | None = 1800.0
    """Seconds without a completed step before a ``hang`` anomaly is raised from a watchdog thread, until a
    deadline is learned from step times (``hang``); it also caps that deadline. None: no watchdog."""
    hang: HangConfig = field(default_factory=HangConfig)
    snapshots: SnapshotConfig = field(default_factory=SnapshotConfig)
    """Host-memory snapshots a rollback restores first (off by default)."""
    watch: WatchConfig = field(default_factory=WatchConfig)
    """Closer flushes after a warning and during an incident (one process)."""
    history: int = 10_000
    """How many recent StepRecords :attr:`Monitor.records` keeps in memory, and how many recent events and
    anomalies :attr:`Monitor.events` / :attr:`Monitor.anomalies` keep (0 keeps none; the store holds them all):
    a run's memory does not grow with its length."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.flush_every < 1:
            raise ValueError(f"config.flush_every must be >= 1, got {self.flush_every}")
        if self.flush_on_rise is not None and not self.flush_on_rise > 1.0:
            raise ValueError(f"config.flush_on_rise must be > 1 or None, got {self.flush_on_rise}")
        if self.clip is not None and not (self.clip > 0 and not math.isnan(self.clip)):
            raise ValueError(f"config.clip must be > 0 or None, got {self.clip}")
        if self.checkpoint_every is not None and self.checkpoint_every < 0:
            raise ValueError(f"config.checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.hang_timeout is not None and not self.hang_timeout > 0:
            raise ValueError(f"config.hang_timeout must be > 0 or None, got {self.hang_timeout}")
        if self.history < 0:
            raise ValueError(f"config.history must be >= 0, got {self.history}")
        if self.checkpoint_keep < 1:
            raise ValueError(f"config.checkpoint_keep must be >= 1, got {self.checkpoint_keep}")
        if not 0 <= self.exit_code <= 255:
            raise ValueError(f"config.exit_code must be in [0, 255], got {self.exit_code}")
        self.grads.validate("config.grads")
        self.activations.validate("config.activations")
        self.embeddings.validate("config.embeddings")
        self.updates.validate("config.updates")
        self.moments.validate("config.moments")
        self.attention.validate("config.attention")
        self.logits.validate("config.logits")
        self.diagnose.validate("config.diagnose")
        self.hang.validate("config.hang")
        self.snapshots.validate("config.snapshots")
        self.watch.validate("config.watch")

    def checkpoint_cadence(self, *, can_save: bool) -> int:
        """The checkpoint cadence in force for a monitor that can (or cannot) save checkpoints itself.

        >>> MonitorConfig().checkpoint_cadence(can_save=True), MonitorConfig().checkpoint_cadence(can_save=False)
        (100, 0)
        >>> MonitorConfig(checkpoint_every=0).checkpoint_cadence(can_save=True)
        0
        """
        if self.checkpoint_every is not None:
            return self.checkpoint_every
        return DEFAULT_CHECKPOINT_EVERY if can_save else 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MonitorConfig:
        data = dict(data)
        for key, sub in (
            ("grads", GradConfig),
            ("activations", ActivationConfig),
            ("embeddings", EmbeddingConfig),
            ("updates", UpdateConfig),
            ("moments", MomentConfig),
            ("attention", AttentionConfig),
            ("logits", LogitConfig),
            ("diagnose", DiagnoseConfig),
            ("hang", HangConfig),
            ("snapshots", SnapshotConfig),
            ("watch", WatchConfig),
        ):
            if isinstance(data.get(key), dict):
                data[key] = sub(**data[key])
        return cls(**data)
