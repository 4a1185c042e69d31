"""The failure scenarios of examples/scenarios.py fail for certain, and the default runbook rescues them.

Nothing here depends on one seed tipping over: the fault scenarios fail by construction (checked on a seed no
other test uses), the learning-rate scenarios are far past the edge (the sweep in docs/recovery.md: every seed
fails), and every claim about a rescue or a healthy control holds for a majority of three seeds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from stabmon.interventions.traits import changed_training

REPO = Path(__file__).resolve().parent.parent
# another seed set and thread count for a re-run: STABMON_TEST_SEED=50 STABMON_TEST_THREADS=2 pytest ...
FIRST = int(os.environ.get("STABMON_TEST_SEED", "21"))
SEEDS = (FIRST, FIRST + 1, FIRST + 2)
THREADS = int(os.environ.get("STABMON_TEST_THREADS", "1"))


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@cache
def lead_time() -> ModuleType:
    """benchmarks/lead_time.py: the same code the published lead table comes from."""
    return _load(REPO / "benchmarks" / "lead_time.py", "lead_time_benchmark")


@cache
def recovery() -> ModuleType:
    """benchmarks/recovery.py: the same code the published rescue table comes from."""
    return _load(REPO / "benchmarks" / "recovery.py", "recovery_benchmark")


def config(name: str, seed: int, *, healthy: bool = False) -> Any:
    s = recovery().sc.scenario(name)
    return (s.healthy_config if healthy else s.config)(seed, threads=THREADS)


@cache
def healthy_loss(scenario: str, seed: int) -> float:
    return float(recovery().tiny_gpt.train(config(scenario, seed, healthy=True)).val_loss)


def test_every_scenario_names_its_origin_and_builds_a_valid_config() -> None:
    sc = recovery().sc
    assert {"lr-too-high", "bad-shard", "fp16-overflow", "weight-corruption", "frozen-pos-emb",
            "activation-drift", "healthy"} <= set(sc.SCENARIOS)
    for s in sc.SCENARIOS.values():
        assert len(s.origin) > 20
        s.config(seed=5).validate()
        s.healthy_config(seed=5).validate()
        assert s.healthy_config(5).fault is None and s.healthy_config(5).lr == 3e-3
    with pytest.raises(ValueError, match=r"^scenario must be one of .*, got 'nope'$"):
        sc.scenario("nope")


def test_fault_config_errors_name_the_field() -> None:
    tg = recovery().tiny_gpt
    with pytest.raises(ValueError, match=r"^config\.fault must be one of"):
        tg.TrainConfig(fault="cosmic_ray").validate()
    with pytest.raises(ValueError, match=r"^config\.fault 'overflow_state' needs config\.amp = 'fp16'$"):
        tg.TrainConfig(fault="overflow_state").validate()
    with pytest.raises(ValueError, match=r"^config\.amp must be None or 'fp16'"):
        tg.TrainConfig(amp="bf17").validate()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["weight-corruption", "fp16-overflow", "bad-shard", "flaky-gpu",
                                  "second-moment-spike"])
def test_fault_scenarios_fail_unmonitored_by_construction(name: str) -> None:
    result = recovery().tiny_gpt.train(config(name, FIRST + 10))
    healthy = healthy_loss(name, FIRST + 10)
    assert not result.val_loss <= 1.1 * healthy, (result.val_loss, healthy)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lr-too-high", "activation-drift"])
def test_learning_rate_scenarios_fail_unmonitored_on_every_seed(name: str) -> None:
    losses = {seed: recovery().tiny_gpt.train(config(name, seed)).val_loss for seed in SEEDS}
    failed = [seed for seed, loss in losses.items() if not loss <= 1.1 * healthy_loss(name, seed)]
    assert failed == list(SEEDS), losses


def _monitored(name: str, seed: int, runbook: str, tmp_path: Path, detectors: dict[str, Any] | None = None,
               **monitor_config: Any) -> Any:
    where = tmp_path / f"{name}-{seed}-{runbook}{'-' if monitor_config else ''}{'-'.join(monitor_config)}"
    return recovery().monitored(config(name, seed), runbook, str(where), detectors, **monitor_config)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lr-too-high", "bad-shard", "fp16-overflow", "weight-corruption",
                                  "activation-drift"])
def test_default_runbook_rescues_a_majority_of_seeds(name: str, tmp_path: Path) -> None:
    outcomes = {}
    for seed in SEEDS:
        result = _monitored(name, seed, "default", tmp_path)
        changes = [e for e in result.monitor.events if type(e).__name__ == "InterventionRecord"
                   and changed_training(e)]
        outcomes[seed] = (result.val_loss, healthy_loss(name, seed), [c.action for c in changes])
        restarts = [c for c in changes if c.action != "diagnose"]
        assert restarts and restarts[0].action == "rollback", outcomes  # it restarts before it changes recipes
        for i, diagnosis in enumerate(changes):
            if diagnosis.action != "diagnose":
                continue
            verdict = diagnosis.after["verdict"]
            assert verdict == BY_CONSTRUCTION.get(name, verdict), (seed, diagnosis.after["summary"])
            if i + 1 == len(changes):  # nothing changed after it: the verdict's restarts were spent earlier in
                # this run (they did not keep this trouble away), so they are passed over and a human is told
                after = result.monitor.events[result.monitor.events.index(diagnosis):]
                told = [e for e in after if type(e).__name__ == "Decision" and "passed over" in e.reason]
                assert told, (seed, outcomes)
                continue
            restart = changes[i + 1]  # the restart the verdict chose
            assert restart.action == "rollback", outcomes
            skipped, cap = restart.after.get("skipped"), restart.after.get("lr_cap")
            data = bool(skipped and skipped[1] > skipped[0]) or "screened" in restart.after  # skipped, or screened
            assert (verdict, data, cap is not None) in {
                ("data", True, False), ("state", False, True), ("hardware_suspect", False, False),
                ("inconclusive", True, False)}, (seed, verdict, restart.after)
    rescued = [s for s, (loss, healthy, _) in outcomes.items() if loss <= 1.1 * healthy]
    assert len(rescued) >= 2, outcomes


BY_CONSTRUCTION = {"bad-shard": "data", "weight-corruption": "hardware_suspect", "fp16-overflow": "hardware_suspect"}
"""The verdicts the faults force: a corrupted shard stands out from any good state; a flipped exponent and a state
pushed past float16, injected once, are not computed again when the step is re-run. (A learning rate far too high
is a run not learning, which is not diagnosed; activation drift's verdict is the evidence's.)"""


@pytest.mark.slow
def test_runbooks_leave_healthy_runs_alone(tmp_path: Path) -> None:
    runs = [("default", seed) for seed in SEEDS] + [("opt175b", SEEDS[0]), ("palm-rollback", SEEDS[1]),
                                                    ("in-place-first", SEEDS[2])]
    for runbook, seed in runs:
        mon = _monitored("healthy", seed, runbook, tmp_path).monitor
        changed = [e for e in mon.events if type(e).__name__ == "InterventionRecord" and changed_training(e)]
        assert changed == [], (runbook, seed, changed)
        assert not [a for a in mon.anomalies if a.severity.value in ("error", "critical")], (runbook, seed)


@pytest.mark.slow
def test_frozen_positional_embedding_is_reported_and_alerted_without_a_change(tmp_path: Path) -> None:
    # step times follow the machine's load: a slow-step alert open at the time would hold this one back
    no_step_time = {"step_time": {"enabled": False}}
    mon = _monitored("frozen-pos-emb", FIRST + 11, "default", tmp_path, no_step_time).monitor
    frozen = [a for a in mon.anomalies if a.kind == "frozen_embedding"]
    assert frozen and {a.metric for a in frozen} == {"emb_update/wpe"}  # the token embedding still learns
    assert frozen[0].step <= 150  # OPT's went unnoticed; the target is 500 steps
    alerts = [d for d in mon.events if type(d).__name__ == "Decision" and d.anomaly_id == frozen[0].id]
    assert alerts and alerts[0].action == "alert_only"
    assert not [e for e in mon.events if type(e).__name__ == "InterventionRecord" and changed_training(e)]


def test_peer_responses_act_as_their_projects_do() -> None:
    import torch

    peers = _load(REPO / "benchmarks" / "peers.py", "peer_responses")
    model = torch.nn.Linear(4, 1)

    def grads(scale: float) -> None:
        for p in model.parameters():
            p.grad = torch.full_like(p, scale)

    zclip, olmo = peers.ZClipResponse(), peers.OlmoSkipStep()
    stopper = peers.KillLossSpikeResponse(total_steps=100)
    for step in range(150):
        grads(1.0 + 0.01 * (step % 3))
        assert zclip.on_step(step, torch.tensor(2.0), model) == "step"
        assert olmo.on_step(step, torch.tensor(2.0 + 0.01 * (step % 3)), model) == "step"
        assert stopper.on_step(step, torch.tensor(2.0), model) == "step"
    grads(50.0)
    assert zclip.on_step(150, torch.tensor(2.0), model) == "step"
    assert float(peers.grad_norm(model)) < 10.0  # clipped to ZClip's adaptive threshold
    grads(50.0)
    assert olmo.on_step(150, torch.tensor(2.0), model) == "skip"  # grad norm far above mean + 6 sigma
    grads(float("nan"))
    assert olmo.on_step(151, torch.tensor(float("nan")), model) == "step"  # NaN compares False: applied
    answers = [stopper.on_step(151 + i, torch.tensor(9.0), model) for i in range(6)]
    assert answers[:4] == ["step"] * 4 and answers[4] == "stop"  # more than 4 outliers in a row


@pytest.mark.slow
def test_recovery_benchmark_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "recovery.py"), "--seeds", "1", "--first-seed", "33",
           "--scenarios", "weight-corruption", "--arms", "unmonitored,stabmon:default,olmo-skip-step",
           "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "rescue rate over the runs that failed unmonitored" in done.stdout
    rows = json.loads(out.read_text())
    keys = {"scenario", "seed", "arm", "healthy_control", "failed_unmonitored", "rescued", "final_loss",
            "wasted_steps_pct", "detect_step", "interventions", "false_interventions"}
    assert [r["arm"] for r in rows] == ["unmonitored", "stabmon:default", "olmo-skip-step"]
    assert all(keys <= set(r) for r in rows)
    by_arm = {r["arm"]: r for r in rows}
    assert by_arm["unmonitored"]["failed_unmonitored"] and not by_arm["unmonitored"]["rescued"]
    assert by_arm["stabmon:default"]["rescued"] and by_arm["stabmon:default"]["detect_step"] >= 100
    assert not by_arm["olmo-skip-step"]["rescued"]  # NaN is not a spike to a z-score: the update poisons the run
    bad = subprocess.run([*cmd[:2], "--arms", "nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--arms: unknown arm 'nope'" in bad.stderr


@pytest.mark.slow
def test_attention_logit_growth_is_warned_before_the_loss_shows_it() -> None:
    lt = lead_time()
    for seed in SEEDS:
        healthy = lt.records(config("attn-logit-growth", seed, healthy=True))
        assert lt.replay(healthy, 20)[0] == [], seed  # no warning on the signals of the healthy twin
        recs = lt.records(config("attn-logit-growth", seed))
        fired, error, _ = lt.replay(recs, 20)
        loss = [(r.step, r.metrics["loss"]) for r in recs if "loss" in r.metrics]
        twin = [(r.step, r.metrics["loss"]) for r in healthy if "loss" in r.metrics]
        leaves = lt.off_twin(loss, twin, factor=1.2, start=20)
        assert fired and fired[0][1].startswith("attn_logit/"), seed
        assert leaves is not None and error is not None and fired[0][0] < min(leaves, error), (seed, fired[0], leaves,
                                                                                            error)


@pytest.mark.slow
def test_in_place_first_answers_attention_logit_growth_with_a_standing_qk_clip(tmp_path: Path) -> None:
    firsts, outcomes = [], {}
    for seed in SEEDS:
        result = _monitored("attn-logit-growth", seed, "in-place-first", tmp_path)
        changes = [e for e in result.monitor.events if type(e).__name__ == "InterventionRecord"
                   and changed_training(e)]
        firsts.append(changes[0].action if changes else None)
        unmonitored = recovery().tiny_gpt.train(config("attn-logit-growth", seed)).val_loss
        outcomes[seed] = (result.val_loss, unmonitored, [c.action for c in changes])
        assert result.val_loss < unmonitored, outcomes  # never worse than leaving it alone
    assert firsts.count("qk_clip") >= 2, outcomes  # the cheap fix the evidence points at, before any restart
    # where the clip alone does not bring the loss back, the diagnosed restart does (5/5 on seeds 0-4)
    rescued = [s for s, (loss, _, _) in outcomes.items() if loss <= 1.1 * healthy_loss("attn-logit-growth", s)]
    assert len(rescued) >= 2, outcomes


@pytest.mark.slow
def test_in_place_first_rescues_a_second_moment_spike_without_a_restart(tmp_path: Path) -> None:
    outcomes = {}
    for seed in SEEDS:
        result = _monitored("second-moment-spike", seed, "in-place-first", tmp_path)
        changes = [e for e in result.monitor.events if type(e).__name__ == "InterventionRecord"
                   and changed_training(e)]
        outcomes[seed] = (result.val_loss, healthy_loss("second-moment-spike", seed), [c.action for c in changes],
                          result.steps)
    # Adam's moments reset (first and second) and the LR re-warmed: the run learns again, nothing re-trained
    rescued = [s for s, (loss, healthy, actions, steps) in outcomes.items()
               if loss <= 1.1 * healthy and actions[:1] == ["reset_moments"] and "rollback" not in actions
               and steps == config("second-moment-spike", s).steps]
    assert len(rescued) >= 2, outcomes


@pytest.mark.slow
def test_closer_flushes_after_a_first_sign_bring_the_restart_sooner(tmp_path: Path) -> None:
    """second-moment-spike (a 10^4x gradient at step 60, injected): the first sign is a warning, so the flushes come
    every 4 steps while the regression builds; the restart is decided and made within 4 steps of the record
    that shows it, not up to 20 later, and re-trains fewer steps. Off (``WatchConfig(steps=0)``), the same run
    restarts at a multiple of 20."""
    from stabmon.collect.config import WatchConfig

    seed = SEEDS[0]
    restarts = {}
    for label, watch in (("closer", WatchConfig()), ("cadence", WatchConfig(steps=0))):
        result = _monitored("second-moment-spike", seed, "default", tmp_path, watch=watch)
        rollbacks = [e for e in result.monitor.events
                     if type(e).__name__ == "InterventionRecord" and e.action == "rollback" and e.ok]
        assert rollbacks, (label, [f"{e.action}@{e.step}" for e in result.monitor.events
                                   if type(e).__name__ == "Decision"])
        first = rollbacks[0]
        regression = min(a.step for a in result.monitor.anomalies if a.kind == "regression")
        restarts[label] = (first.after["from_step"], regression, result.steps, result.val_loss)
        assert result.val_loss <= 1.1 * healthy_loss("second-moment-spike", seed), restarts
    (closer_at, closer_seen, closer_trained, _), (cadence_at, _, cadence_trained, _) = (
        restarts["closer"], restarts["cadence"])
    assert cadence_at % 20 == 0, restarts
    assert closer_at - closer_seen <= 4 and closer_at < cadence_at, restarts
    assert closer_trained < cadence_trained, restarts  # fewer steps trained again
