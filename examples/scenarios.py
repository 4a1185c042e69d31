"""Training scenarios that fail for certain, each modelled on a real incident, on the tiny GPT of
``tiny_gpt.py``.

Every failing scenario fails for every seed on every machine when nobody intervenes: either by construction (a
fault injected at a known step: a corrupted data shard, a corrupted weight, a state that overflows float16, a
frozen embedding) or by a setting so far past the edge of stability that every seed of the published sweep
diverged (``benchmarks/recovery.py --sweep``; docs/recovery.md has the table). A run *failed* when its final
held-out loss is not within 10% of the same seed's healthy run (:func:`healthy_config`), or not finite.

All scenarios share :data:`BASE`, a smaller and faster version of the example's stable setting (300 steps of
a 2-block, d=48 model on 32-character windows), so that a benchmark can train hundreds of runs on a CPU.

>>> sorted(SCENARIOS)[:3]
['activation-drift', 'attn-logit-growth', 'bad-shard']
>>> config = SCENARIOS["bad-shard"].config(seed=3)
>>> config.seed, config.bad_batches
(3, (150, 250))
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_gpt  # noqa: E402 - the example sits beside this file, shipped or checked out

BASE: dict[str, Any] = dict(steps=300, block_size=32, n_embd=48, warmup=30, log_every=25)
"""The shared base: the example's stable setting (pre-LN, peak lr 3e-3, clip 1.0, beta2 0.95, wd 0.1), smaller."""

LR_TOO_HIGH = 0.3
"""Peak learning rate of ``lr-too-high``: 100x the stable 3e-3. The sweep (10 seeds each): 3e-2 and below
survive on some seeds; from 1e-1 up every seed fails. 100x sits past that edge with margin."""


@dataclass(frozen=True)
class Scenario:
    """One way a run goes wrong: what is changed from :data:`BASE`, where it comes from, what a rescue needs."""

    name: str
    origin: str
    """The real incident it is modelled on (docs/recovery.md has the sources)."""
    changes: dict[str, Any] = field(default_factory=dict)
    """TrainConfig fields changed from :data:`BASE`."""
    healthy: bool = False
    """A healthy control: no fault, no instability (any intervention on it is a false one)."""
    rescuable: bool = True
    """False where no automatic fix is expected (detect and alert or stop)."""
    healthy_changes: dict[str, Any] = field(default_factory=dict)
    """Fields the same run has without its fault (the reference it is judged against), beyond BASE."""

    def config(self, seed: int, **overrides: Any) -> tiny_gpt.TrainConfig:
        return tiny_gpt.TrainConfig(**{**BASE, **self.changes, **overrides}, seed=seed)

    def healthy_config(self, seed: int, **overrides: Any) -> tiny_gpt.TrainConfig:
        """The same run with nothing wrong: the reference a rescued run must come within 10% of."""
        return tiny_gpt.TrainConfig(**{**BASE, **self.healthy_changes, **overrides}, seed=seed)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "lr-too-high",
            "OPT-175B's early restarts: a peak learning rate far too high for the model (here 100x the stable "
            "one, reached after the 30-step warm-up); the attention saturates, the loss stops falling far above the "
            "healthy run's and the run never comes back (on this small model it stalls rather than spikes)",
            {"lr": LR_TOO_HIGH},
        ),
        Scenario(
            "bad-shard",
            "PaLM's loss spikes and BLOOM's corrupted data: batches 150-249 are random characters (a corrupted "
            "shard); the model unlearns the language on them and has too few clean steps left to relearn it",
            {"bad_batches": (150, 250)},
        ),
        Scenario(
            "fp16-overflow",
            "OPT-175B's loss-scale collapse: fp16 with a GradScaler; at step 100 the state starts overflowing "
            "float16 on every step (the output LayerNorm's gain jumps 2^14x), every update is skipped and "
            "the loss scale halves towards zero",
            {"amp": "fp16", "fault": "overflow_state", "fault_step": 100},
            healthy_changes={"amp": "fp16"},
        ),
        Scenario(
            "weight-corruption",
            "Silent data corruption (BLOOM, Megatron's re-run checks, Llama 3's faulty GPUs): at step 100, 16 "
            "weights of the first block's MLP get their top exponent bit flipped (x2^128): NaN from then on",
            {"fault": "corrupt_weight", "fault_step": 100},
        ),
        Scenario(
            "flaky-gpu",
            "Flaky GPUs (BLOOM's and Llama 3's hardware failures, Megatron's rerun state machine): at step 110 one "
            "execution of the first block computes an inf in its output; the loss and the update are NaN and "
            "stay NaN. Run again from the same state, the step computes correctly: a transient fault",
            {"fault": "flaky_activation", "fault_step": 110},
        ),
        Scenario(
            "frozen-pos-emb",
            "OPT-175B's frozen positional embeddings: wpe never receives a gradient; nothing diverges, it "
            "just does not learn. Not rescuable automatically: detect it and tell a human",
            {"fault": "freeze_wpe"},
            rescuable=False,
        ),
        Scenario(
            "activation-drift",
            "OPT-175B run 12.43: activation and gradient norms drift upward for a long time before the "
            "blow-up. Here the learning rate warms up over the whole run (a mis-set schedule) towards 100x "
            "the stable peak, so the norms grow step after step until the run diverges",
            {"lr": LR_TOO_HIGH, "warmup": 300},
        ),
        Scenario(
            "fp16-flaky-overflow",
            "A sustained fault that is not the learning rate's doing: fp16 with a GradScaler; from step 100, "
            "every 4th step one gradient element of the output head overflows float16 (a kernel whose "
            "intermediate passes 65504). The scaler skips those steps and backs off; a rollback does not cure "
            "it (the steps come round again) and a lower LR does not either. Left alone the run survives, "
            "worse than healthy; a runbook must not make it worse still",
            {"amp": "fp16", "fault": "flaky_overflow", "fault_step": 100, "fault_every": 4},
            healthy_changes={"amp": "fp16"},
            rescuable=False,
        ),
        Scenario(
            "attn-logit-growth",
            "Wortsman et al. 2023's attention-logit growth, scaled down: a model without QK-layernorm whose learning "
            "rate warms up over 150 steps to 100x the stable peak; the max attention logit grows from ~6 to the "
            "hundreds before the loss turns up, the softmax saturates and the run never comes back",
            {"lr": LR_TOO_HIGH, "warmup": 150},
        ),
        Scenario(
            "output-logit-divergence",
            "Wortsman et al. 2023's output-logit divergence, scaled down: no z-loss, no weight decay, and the output "
            "layer trained at 3000x the learning rate; the output logits run away from log Z = 0 during the warm-up "
            "and the run ends far above its healthy loss",
            {"head_lr": 3000.0, "weight_decay": 0.0},
        ),
        Scenario(
            "second-moment-spike",
            "SPAM's and StableAdamW's gradient spikes: no clipping and Adam's beta2 at 0.999; at step 60 one batch "
            "brings a gradient 10^4 times its usual size (g^2 10^8 times the second moment: it under-estimates the "
            "step by far). The second moment takes it in and, decaying by 0.1% a step, keeps every later update "
            "about 300x too small: the run stops learning where it was",
            {"clip": None, "beta2": 0.999, "fault": "grad_spike", "fault_step": 60},
            healthy_changes={"clip": None, "beta2": 0.999},
        ),
        Scenario("healthy", "The stable setting: the healthy control", {}, healthy=True),
    )
}


def scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"scenario must be one of {', '.join(SCENARIOS)}, got {name!r}") from None


def healthy_config(name: str, seed: int, **overrides: Any) -> tiny_gpt.TrainConfig:
    return scenario(name).healthy_config(seed, **overrides)


def replace(config: tiny_gpt.TrainConfig, **changes: Any) -> tiny_gpt.TrainConfig:
    return dataclasses.replace(config, **changes)
