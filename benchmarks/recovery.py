"""Rescue rate: what stabmon's runbooks save, beside the peers' automatic responses, on scenarios that fail
for certain (``examples/scenarios.py``).

For each scenario and seed, on the same batches: the healthy reference (the same run without its fault), the
run left alone, stabmon in apply mode with each shipped runbook, and each peer's automatic response
(``benchmarks/peers.py``). A run is *rescued* when its final held-out loss is finite and within 10% of the same
seed's healthy run; *wasted steps* are steps trained again after rollbacks, plus skipped batches and skipped
updates, plus the passes ``diagnose`` runs (its re-run steps and replayed batches, one step each), as a
percentage of the run; a *false intervention* is any action that changed training on a healthy
control.

    python benchmarks/recovery.py                         # 12 scenarios x 5 seeds (0-4) x 15 arms
    python benchmarks/recovery.py --first-seed 5 --jobs 2 --json recovery.json
    python benchmarks/recovery.py --scenarios bad-shard,healthy --arms unmonitored,stabmon:default
    python benchmarks/recovery.py --arms unmonitored,stabmon:in-place-first,stabmon:only-reset_moments
    python benchmarks/recovery.py --arms unmonitored,stabmon:restart-only   # restart-first minus its in-place rung
    python benchmarks/recovery.py --signals 0             # at the monitor's defaults
    python benchmarks/recovery.py --arms unmonitored,stabmon:my-runbook.yaml   # a runbook of your own
    python benchmarks/recovery.py --sweep --seeds 10      # the learning-rate sweep behind lr-too-high
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]

import scenarios as sc  # noqa: E402
import tiny_gpt  # noqa: E402
from peers import PEERS  # noqa: E402

RUNBOOKS = ("default", "restart-first", "opt175b", "palm-rollback", "in-place-first")
ALONE = {  # each state-level intervention alone: its one rung answers every incident a runbook acts on
    "reset_moments": {"rewarm_steps": 20, "second_moment": True}, "adaptive_clip": {"lambda_rel": 1.05, "beta": 0.98},
    "clip_update": {"max_rms": 1.0}, "qk_clip": {"tau": 50.0}, "skip_step": {"factor": 5.0, "theta": 5000.0},
    "scale_layer_lr": {"factor": 0.01},
}
ARMS = ("unmonitored", *(f"stabmon:{r}" for r in RUNBOOKS), "stabmon:restart-only",
        *(f"stabmon:only-{a}" for a in ALONE), *PEERS)
RESCUE_TOLERANCE = 0.10
CHECKPOINT_EVERY = 25
SNAPSHOTS, SNAPSHOT_EVERY, SNAPSHOT_KEEP = "+snapshots", 5, 10
"""``stabmon:RUNBOOK+snapshots``: that arm with a host-memory snapshot every 5 steps (the last 10 kept) in front of
the disk checkpoints every 25 (``MonitorConfig.snapshots``)."""
ATTENTION_EVERY = 10
"""Every stabmon arm samples the max attention logits and the per-layer update ratios every 10 steps (both off in
the monitor's defaults), so that the ``level`` detector can see attention-logit growth (``in-place-first`` answers
it with ``qk_clip``) and the ``out_of_line`` detector a layer out of line (``scale_layer_lr``). ``--signals 0``
runs the arms at the monitor's defaults instead (no attention logits; the update ratios every 20 steps, as
``UpdateConfig`` samples them by default with Adam/AdamW)."""


@dataclass
class Row:
    scenario: str
    seed: int
    arm: str
    healthy_control: bool
    rescuable: bool
    failed_unmonitored: bool
    rescued: bool
    final_loss: float
    healthy_loss: float
    unmonitored_loss: float
    worse_than_unmonitored: bool
    stopped_at: int | None
    wasted_steps_pct: float
    wasted_steps: int
    """Steps trained again, batches skipped and diagnosis passes: what the rescue cost, in steps."""
    goodput_pct: float
    """The run's steps over the steps it spent (``steps / (steps + wasted)``)."""
    detect_step: int | None
    interventions: int
    false_interventions: int
    actions: list[str]
    seconds: float


def alone_runbook(action: str) -> Any:
    """A runbook whose every error-severity incident gets ``action`` alone (observed 60 steps, then nothing)."""
    from stabmon.runbook import Runbook

    rung = {"action": action, "params": ALONE[action], "observe": 60,
            "success": {"quiet_steps": 60, "loss_within": 0.1}}
    kinds = ["spike", "regression", "loss_scale_collapse", "nonfinite", "no_progress", "level"]
    return Runbook.model_validate({"name": f"only-{action}", "cooldown": 10, "rules": [
        {"name": "trouble", "when": {"kind": kinds, "severity": "error"}, "ladder": [rung]},
        {"name": "other", "when": {"kind": "*", "severity": "warning"}, "ladder": [{"action": "alert_only",
                                                                                    "observe": 1}]}]})


def restart_only_runbook() -> Any:
    """``restart-first`` without its in-place rung (``scale_layer_lr``): restarts and LR cuts only, the default
    before any in-place intervention existed; the baseline an in-place runbook is measured against."""
    from stabmon.runbook import Runbook, load_runbook

    data = load_runbook("restart-first").model_dump(mode="json", exclude_none=True)
    for rule in data["rules"]:
        rule["ladder"] = [rung for rung in rule["ladder"] if rung["action"] != "scale_layer_lr"]
    return Runbook.model_validate({**data, "name": "restart-only",
                                   "description": "restart-first without its in-place rung"})


def monitored(
    config: tiny_gpt.TrainConfig, runbook: str, ckpt: str, detectors: dict[str, Any] | None = None,
    signals: int = ATTENTION_EVERY, **monitor_config: Any,
) -> tiny_gpt.TrainResult:
    """``config`` trained under stabmon in apply mode with ``runbook`` (see :data:`ARMS`); ``monitor_config``: more
    ``MonitorConfig`` fields."""
    from stabmon.collect.config import AttentionConfig, SnapshotConfig, UpdateConfig
    from stabmon.monitor import Monitor, MonitorConfig

    # signals=0: the monitor's defaults (no attention logits; update ratios where they cost no copy)
    sampled = {"attention": AttentionConfig(every=signals), "updates": UpdateConfig(every=signals)} if signals else {}
    if runbook.endswith(SNAPSHOTS):  # the host-memory snapshot tier in front of the disk checkpoints
        runbook = runbook.removesuffix(SNAPSHOTS)
        sampled["snapshots"] = SnapshotConfig(every=SNAPSHOT_EVERY, keep=SNAPSHOT_KEEP)
    book: Any = (alone_runbook(runbook.removeprefix("only-")) if runbook.startswith("only-") else
                 restart_only_runbook() if runbook == "restart-only" else runbook)

    def factory(model: Any, opt: Any, sched: Any, scaler: Any = None) -> Monitor:
        return Monitor(model, opt, scheduler=sched, scaler=scaler, store=None, runbook=book, mode="apply",
                       detectors=detectors,
                       checkpoint_dir=ckpt, run_name=f"recovery-{runbook}",
                       config=MonitorConfig(clip=config.clip, checkpoint_every=CHECKPOINT_EVERY,
                                            checkpoint_keep=40, hang_timeout=None, **sampled,
                                            **monitor_config))

    return tiny_gpt.train(config, monitor=factory)


def _stabmon_facts(result: tiny_gpt.TrainResult, steps: int) -> dict[str, Any]:
    from stabmon.events import Metric
    from stabmon.interventions.traits import changed_training

    mon = result.monitor
    kinds = [type(e).__name__ for e in mon.events]
    changes = [e for e in mon.events if type(e).__name__ == "InterventionRecord" and changed_training(e)]
    decisions = [e for e in mon.events if type(e).__name__ == "Decision"]
    recomputed = result.steps - min(mon.step, steps)
    kept = {r.step: r for r in mon.records}  # the last record of each step: the run's own timeline
    discarded = sum(1 for r in kept.values() if r.get(Metric.SKIPPED) == 1.0)  # the guard's, a screen's
    diagnosed = sum(diagnose_passes(e.after) for e in mon.events
                    if type(e).__name__ == "InterventionRecord" and e.action == "diagnose")
    return {
        "wasted": recomputed + len(mon.cursor.skip) + discarded + diagnosed,
        "detect_step": detect_step(mon.anomalies),
        "interventions": len(changes),
        "actions": [f"{e.action}@{e.step}" for e in decisions if e.action != "revert"][:12],
        "events": len(kinds),
    }


def diagnose_passes(after: dict[str, Any]) -> int:
    """The training passes a diagnosis ran: the steps it re-ran from the checkpoint (``from_step`` to ``to_step``,
    each trained again; one process stops at the first step that did not reproduce) and the batches it replayed
    (``replay.replayed``: one process may stop after half of them; none when the replay was skipped: one process,
    a re-run that did not reproduce).

    >>> rerun = {"from_step": 10, "to_step": 13, "reproduced": True}
    >>> diagnose_passes({"rerun": rerun, "incident_steps": [13, 14], "reference_steps": [8, 9], "replay": {}})
    8
    >>> diagnose_passes({"rerun": {"from_step": 10, "to_step": 13, "reproduced": None}, "incident_steps": [13]})
    1
    >>> diagnose_passes({"rerun": {**rerun, "reproduced": False}, "incident_steps": [13, 14],
    ...                  "reference_steps": [8, 9], "replay": {"recurs": None, "skipped": "not needed"}})
    4
    >>> diagnose_passes({"rerun": rerun, "incident_steps": [13, 14], "reference_steps": [8, 9],
    ...                  "replay": {"recurs": False, "replayed": 2}})
    6
    """
    rerun = after.get("rerun") or {}
    ran = rerun.get("reproduced") is not None and isinstance(rerun.get("from_step"), int)
    reran = rerun["to_step"] - rerun["from_step"] + 1 if ran else 0  # (a re-run skipped says why, and ran none)
    replay = after.get("replay") or {}
    if replay.get("skipped"):
        return reran
    if isinstance(replay.get("replayed"), int):
        return reran + replay["replayed"]
    return reran + len(after.get("incident_steps", ())) + len(after.get("reference_steps", ()))


def detect_step(anomalies: list[Any]) -> int | None:
    """The first anomaly at error severity or above (what runbooks act on); where there is none, the first
    warning other than a slow step (the only level a frozen embedding or a drift reaches)."""
    from stabmon.events import Severity

    errors = [a.step for a in anomalies if a.severity >= Severity.ERROR]
    warnings = [a.step for a in anomalies if a.kind != "step_time"]
    return errors[0] if errors else (warnings[0] if warnings else None)


class _Counting:
    """Wraps a peer response to count what it did (skips, stops, clipped steps) and when it first acted."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.clips, self.acted, self.skips, self.first = inner, inner.clips, 0, 0, None

    def on_step(self, step: int, loss: Any, model: Any) -> str:
        action = self.inner.on_step(step, loss, model)
        adaptive_clip = getattr(getattr(self.inner, "rule", None), "clip_to", None) is not None  # ZClip clipped
        if action != "step" or adaptive_clip:
            self.acted += 1
            self.first = step if self.first is None else self.first
        self.skips += action == "skip"
        return action


def run_arm(arm: str, config: tiny_gpt.TrainConfig,
            signals: int = ATTENTION_EVERY) -> tuple[tiny_gpt.TrainResult, dict[str, Any]]:
    if arm == "unmonitored":
        result = tiny_gpt.train(config)
        return result, {"wasted": 0, "detect_step": None, "interventions": 0, "actions": []}
    if arm.startswith("stabmon:"):
        with tempfile.TemporaryDirectory(prefix="stabmon-recovery-") as ckpt:
            result = monitored(config, arm.split(":", 1)[1], ckpt, signals=signals)
        return result, _stabmon_facts(result, config.steps)
    response = _Counting(PEERS[arm](config.steps))
    result = tiny_gpt.train(config, response=response)
    actions = [f"{'stop' if result.stopped_at is not None else arm}@{response.first}"] if response.first else []
    return result, {"wasted": response.skips, "detect_step": response.first, "interventions": response.acted,
                    "actions": actions}


def run_case(scenario: str, seed: int, arms: Iterable[str], signals: int = ATTENTION_EVERY) -> list[Row]:
    """Every arm of one (scenario, seed); the healthy reference and the unmonitored run first."""
    import torch

    torch.set_num_threads(1)
    s = sc.scenario(scenario)
    healthy = tiny_gpt.train(s.healthy_config(seed)).val_loss
    config = s.config(seed)
    base, _ = run_arm("unmonitored", config)
    failed = not _within(base.val_loss, healthy)
    rows = []
    for arm in arms:
        result, facts = (base, {"wasted": 0, "detect_step": None, "interventions": 0, "actions": []}) \
            if arm == "unmonitored" else run_arm(arm, config, signals)
        stopped = result.stopped_at is not None
        rows.append(Row(
            scenario=scenario, seed=seed, arm=arm, healthy_control=s.healthy, rescuable=s.rescuable,
            failed_unmonitored=failed, rescued=_within(result.val_loss, healthy), final_loss=result.val_loss,
            healthy_loss=healthy, unmonitored_loss=base.val_loss,
            worse_than_unmonitored=not stopped and result.val_loss > base.val_loss * 1.02 + 1e-9,
            stopped_at=result.stopped_at, wasted_steps_pct=100.0 * facts["wasted"] / config.steps,
            wasted_steps=int(facts["wasted"]), goodput_pct=100.0 * config.steps / (config.steps + facts["wasted"]),
            detect_step=facts["detect_step"], interventions=facts["interventions"],
            false_interventions=facts["interventions"] if s.healthy else 0, actions=facts["actions"],
            seconds=round(result.seconds, 2)))
    return rows


def _within(loss: float, healthy: float) -> bool:
    return math.isfinite(loss) and loss <= healthy * (1 + RESCUE_TOLERANCE)


# -- reporting ------------------------------------------------------------------------------------------------
def table(rows: list[Row], arms: list[str]) -> list[str]:
    out = [f"{'scenario':<18} {'arm':<24} {'failed':>6} {'rescued':>8} {'worse':>5} {'stops':>5} "
           f"{'wasted%':>8} {'detect':>7} {'interv':>6}  final loss (healthy)"]
    by = defaultdict(list)
    for r in rows:
        by[(r.scenario, r.arm)].append(r)
    for scenario in dict.fromkeys(r.scenario for r in rows):
        for arm in arms:
            rs = by[(scenario, arm)]
            if not rs:
                continue
            detect = [r.detect_step for r in rs if r.detect_step is not None]
            failed = [r for r in rs if r.failed_unmonitored]
            rescued = sum(r.rescued for r in failed)
            loss = statistics.median(r.final_loss for r in rs)
            healthy = statistics.median(r.healthy_loss for r in rs)
            out.append(
                f"{scenario:<18} {arm:<24} {len(failed):>3}/{len(rs):<2} {rescued:>5}/{len(failed):<2} "
                f"{sum(r.worse_than_unmonitored for r in rs):>5} {sum(r.stopped_at is not None for r in rs):>5} "
                f"{statistics.mean(r.wasted_steps_pct for r in rs):>8.1f} "
                f"{(str(int(statistics.median(detect))) if detect else '-'):>7} "
                f"{statistics.mean(r.interventions for r in rs):>6.1f}  {loss:.3f} ({healthy:.3f})")
        out.append("")
    return out


def summary(rows: list[Row], arms: list[str]) -> list[str]:
    out = [f"{'arm':<28} {'rescue rate':>16} {'worse':>6} {'false interv.':>14} {'wasted% (rescued)':>18} "
           f"{'steps wasted/rescue':>20} {'goodput% (rescued)':>19}"]
    for arm in arms:
        rs = [r for r in rows if r.arm == arm]
        pool = [r for r in rs if r.failed_unmonitored and r.rescuable and not r.healthy_control]
        rescued = [r for r in pool if r.rescued]
        rate = f"{len(rescued)}/{len(pool)} ({100 * len(rescued) / len(pool):.0f}%)" if pool else "-"
        wasted = f"{statistics.mean(r.wasted_steps_pct for r in rescued):.1f}" if rescued else "-"
        steps = f"{statistics.mean(r.wasted_steps for r in rescued):.1f}" if rescued else "-"
        goodput = f"{statistics.mean(r.goodput_pct for r in rescued):.1f}" if rescued else "-"
        out.append(f"{arm:<28} {rate:>16} {sum(r.worse_than_unmonitored for r in rs):>6} "
                   f"{sum(r.false_interventions for r in rs):>14} {wasted:>18} {steps:>20} {goodput:>19}")
    return out


# -- the sweep behind lr-too-high -----------------------------------------------------------------------------
def sweep_case(seed: int, lrs: list[float], warmups: list[int]) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(1)
    healthy = tiny_gpt.train(sc.healthy_config("healthy", seed)).val_loss
    out = []
    for warmup in warmups:
        for lr in lrs:
            loss = tiny_gpt.train(sc.scenario("healthy").config(seed, lr=lr, warmup=warmup)).val_loss
            out.append({"seed": seed, "lr": lr, "warmup": warmup, "val_loss": loss, "healthy": healthy,
                        "failed": not _within(loss, healthy)})
    return out


def sweep(seeds: list[int], jobs: int, lrs: list[float], warmups: list[int]) -> list[dict[str, Any]]:
    with ProcessPoolExecutor(jobs) as pool:
        results = [r for rs in pool.map(sweep_case, seeds, [lrs] * len(seeds), [warmups] * len(seeds)) for r in rs]
    print(f"{'warmup':>6} {'peak lr':>8} {'x stable':>8} {'failed':>8}  val loss per seed")
    for warmup in warmups:
        for lr in lrs:
            rs = [r for r in results if r["lr"] == lr and r["warmup"] == warmup]
            losses = " ".join(f"{r['val_loss']:.2f}" for r in rs)
            print(f"{warmup:>6} {lr:>8.3g} {lr / 3e-3:>8.0f} {sum(r['failed'] for r in rs):>5}/{len(rs):<2}  {losses}")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5, help="seeds per scenario (default 5)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="parallel processes")
    p.add_argument("--json", type=Path, default=None, help="write one object per (scenario, seed, arm)")
    p.add_argument("--scenarios", default=",".join(sc.SCENARIOS), help="comma-separated scenario names")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms")
    p.add_argument("--sweep", action="store_true", help="run the learning-rate sweep instead")
    p.add_argument("--lrs", default="0.03,0.1,0.3,1.0", help="--sweep: peak learning rates")
    p.add_argument("--warmups", default=f"{sc.BASE['warmup']},{sc.BASE['steps']}", help="--sweep: warm-up steps")
    p.add_argument("--table", type=Path, default=None, help="print the tables of a --json file and exit")
    p.add_argument("--signals", type=int, default=ATTENTION_EVERY,
                   help="stabmon arms sample attention logits and update ratios every N steps (default "
                        f"{ATTENTION_EVERY}; 0: the monitor's defaults)")
    args = p.parse_args(argv)
    if args.table is not None:
        # a file written before the absolute waste and the goodput were recorded: those columns read nan
        rows = [Row(**{"wasted_steps": math.nan, "goodput_pct": math.nan, **r}) for r in
                json.loads(args.table.read_text())]
        report(rows, [a for a in ARMS if any(r.arm == a for r in rows)])
        return 0
    if args.seeds < 1 or args.jobs < 1:
        p.error("--seeds and --jobs must be >= 1")
    if args.signals < 0:
        p.error(f"--signals must be >= 0, got {args.signals}")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    if args.sweep:
        lrs = [float(v) for v in args.lrs.split(",") if v]
        warmups = [int(v) for v in args.warmups.split(",") if v]
        results = sweep(seeds, args.jobs, lrs, warmups)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        return 0
    names = [n for n in args.scenarios.split(",") if n]
    arms = [a for a in args.arms.split(",") if a]
    for name in names:
        if name not in sc.SCENARIOS:
            p.error(f"--scenarios: unknown scenario {name!r} (known: {', '.join(sc.SCENARIOS)})")
    for arm in arms:
        if arm.removesuffix(SNAPSHOTS) not in ARMS and not (arm.startswith("stabmon:")
                                                             and Path(arm.split(":", 1)[1]).is_file()):
            p.error(f"--arms: unknown arm {arm!r} (known: {', '.join(ARMS)}, or stabmon:PATH of a runbook YAML)")
    cases = [(n, s) for s in seeds for n in names]  # seed by seed: a stopped run still has whole seeds
    rows: list[Row] = []
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_case, n, s, arms, args.signals) for n, s in cases]
        for done, future in enumerate(as_completed(futures), 1):
            rows.extend(future.result())
            print(f"[{done}/{len(cases)} cases done]", file=sys.stderr, flush=True)
            if args.json:  # written as cases complete, so a long run can be read before it ends
                args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    report(rows, arms)
    return 0


def report(rows: list[Row], arms: list[str]) -> None:
    order = {(n, a): i for i, (n, a) in enumerate((n, a) for n in sc.SCENARIOS for a in arms)}
    rows = sorted(rows, key=lambda r: (order.get((r.scenario, r.arm), 0), r.seed))
    seeds = sorted({r.seed for r in rows})
    print(f"recovery: {len({r.scenario for r in rows})} scenarios x seeds {', '.join(map(str, seeds))} x {len(arms)} "
          f"arms; rescued = final held-out loss within {RESCUE_TOLERANCE:.0%} of the same seed's healthy run\n")
    print("\n".join(table(rows, arms)))
    print("rescue rate over the runs that failed unmonitored (rescuable scenarios):")
    print("\n".join(summary(rows, arms)))


if __name__ == "__main__":
    sys.exit(main())
