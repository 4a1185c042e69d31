"""``stabmon demo``: train the tiny GPT example under the monitor and summarise what was recorded."""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any

import typer

from stabmon.cli._common import DbOption, db_url, echo, fail
from stabmon.interventions.traits import recorded_traits

_HERE = Path(__file__).resolve()


def load_example(name: str = "tiny_gpt") -> ModuleType:
    """Import an example script: shipped in the package (``stabmon/_examples``) or the checkout's
    examples/."""
    places = (_HERE.parents[1] / "_examples", _HERE.parents[2] / "examples")
    for candidate in (place / f"{name}.py" for place in places):
        if candidate.is_file():
            spec = importlib.util.spec_from_file_location(f"stabmon_example_{name}", candidate)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            return module
    raise FileNotFoundError(f"the {name} example is not part of this installation")


def _check_store(url: str) -> None:
    """Open (and, for a new SQLite file, create) the store before training, so a bad --db is one line."""
    from stabmon.store import StoreConfig, open_store

    try:
        open_store(url, config=StoreConfig(fail_fast=True)).close()  # a demo does not wait for a server
    except ValueError as exc:  # StoreError included: already one line naming the store and the URL
        fail((str(exc).splitlines() or [type(exc).__name__])[0])


def _where(url: str) -> str:
    from stabmon.store.database import parse_url, safe_url

    u = parse_url(url)
    if u.get_backend_name() == "sqlite" and u.database:
        return str(Path(u.database).resolve())
    return safe_url(url)


def _series(records: Any, name: str) -> list[tuple[int, float]]:
    return [(r.step, r.metrics[name]) for r in records if name in r.metrics]


def _fmt(values: list[tuple[int, float]], label: str) -> str:
    if not values:
        return f"  {label:<22} (not recorded)"
    vals = [v for _, v in values]
    peak = max(values, key=lambda sv: sv[1] if sv[1] == sv[1] else float("inf"))
    low = min(values, key=lambda sv: sv[1] if sv[1] == sv[1] else float("inf"))
    return (
        f"  {label:<22} first {vals[0]:.4g}  min {low[1]:.4g}  median {statistics.median(vals):.4g}  "
        f"last {vals[-1]:.4g}  max {peak[1]:.4g} (step {peak[0]})  n={len(vals)}"
    )


def summary(monitor: Any, url: str, result: Any) -> list[str]:
    """The lines ``stabmon demo`` prints about a finished monitored run."""
    recs = list(monitor.records)
    lines = [
        f"database: {_where(url)}",
        f"run: {monitor.run_id} ({monitor.run_name}), {monitor.step} steps ({result.steps} trained, rolled-back "
        f"ones included) in {result.seconds:.1f}s, exit code {result.exit_code}"
        + f", held-out loss {result.val_loss:.4f}",
        "signals:",
        _fmt(_series(recs, "loss"), "loss"),
        _fmt(_series(recs, "grad_norm"), "grad_norm"),
        _fmt(_series(recs, "lr"), "lr"),
        _fmt(_series(recs, "loss_scale"), "loss_scale"),
        _fmt(_series(recs, "step_time"), "step_time (s)"),
        _fmt(_series(recs, "tokens_per_sec"), "tokens_per_sec"),
    ]
    for prefix in ("act_rms/", "emb_drift/", "emb_update/", "update_ratio"):
        names = sorted({k for r in recs for k in r.metrics if k.startswith(prefix)})
        lines.extend(_fmt(_series(recs, n), n) for n in names)
    kinds = Counter(type(e).__name__ for e in monitor.events)
    lines.append("events: " + (", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none"))
    anomalies = Counter((a.kind, a.metric) for a in monitor.anomalies)
    for (kind, metric), n in anomalies.most_common(8):
        first = next(a for a in monitor.anomalies if (a.kind, a.metric) == (kind, metric))
        lines.append(f"  anomaly {kind:<18} {metric:<24} x{n:<4} first at step {first.step}")
    for e in monitor.events:
        if type(e).__name__ in ("Decision", "InterventionRecord", "Outcome"):
            lines.append("  " + _describe(e))
    from stabmon.store.database import safe_url

    shown = safe_url(url)  # never print a password
    lines.append(f"next: stabmon runs --db {shown}   stabmon metrics {monitor.run_id} --db {shown}")
    return lines


def _describe(e: Any) -> str:
    name = type(e).__name__
    if name == "Decision":
        return f"decision   step {e.step:<5} {e.action} {dict(e.params)} [{e.status.value}] rule {e.rule} (id {e.id})"
    if name == "InterventionRecord" and recorded_traits(e.action).diagnoses and "verdict" in e.after:
        return f"diagnosed  step {e.step:<5} verdict {e.after['verdict']}: {e.after.get('summary', '')}"
    if name == "InterventionRecord" and e.not_applied is not None:
        return f"skipped    step {e.step:<5} {e.action}: {e.not_applied}"
    if name == "InterventionRecord":
        return f"applied    step {e.step:<5} {e.action} {dict(e.before)} -> {dict(e.stored_after())}"
    return f"outcome    step {e.step:<5} {e.verdict.value}"


def _scenarios() -> ModuleType:
    try:
        load_example("tiny_gpt")
        return load_example("scenarios")
    except FileNotFoundError as exc:
        fail(str(exc))
        raise  # unreachable: fail() exits


def demo(
    db: DbOption = None,
    steps: Annotated[int | None, typer.Option(help="Training steps (default: the scenario's, 300).")] = None,
    scenario: Annotated[
        str, typer.Option(help="bad-shard | lr-too-high | fp16-overflow | weight-corruption | flaky-gpu | "
                               "frozen-pos-emb | activation-drift | healthy (examples/scenarios.py)")
    ] = "bad-shard",
    runbook: Annotated[str, typer.Option(help="Runbook name or path, 'none' to only watch.")] = "default",
    mode: Annotated[str, typer.Option(help="apply | propose | observe")] = "apply",
    seed: Annotated[int, typer.Option(help="Seed of the data and the model (every seed shows the same story).")] = 0,
) -> None:
    """Train a tiny GPT that runs into trouble under the monitor, then summarise what was recorded."""
    if steps is not None and steps < 1:
        fail(f"--steps must be >= 1, got {steps}")
    if mode not in ("apply", "propose", "observe"):
        fail(f"--mode must be apply, propose or observe, got {mode!r}")
    sc = _scenarios()
    if scenario not in sc.SCENARIOS:
        fail(f"--scenario must be one of {', '.join(sc.SCENARIOS)}, got {scenario!r}")
    if runbook != "none":  # checked before anything is created (database, checkpoint folder)
        from stabmon.runbook import load_runbook

        try:
            load_runbook(runbook)
        except Exception as exc:  # noqa: BLE001 - a runbook that does not load is a user error here
            fail(f"--runbook {runbook!r}: {(str(exc).splitlines() or [type(exc).__name__])[0]}")
    url = db_url(db)
    _check_store(url)
    from stabmon.collect.config import UpdateConfig
    from stabmon.monitor import Monitor, MonitorConfig

    chosen = sc.SCENARIOS[scenario]
    config = chosen.config(seed, **({} if steps is None else {"steps": steps}))
    base = Path(_where(url)).parent if url.startswith("sqlite") else Path.cwd()
    ckpt_dir = base / "stabmon-demo-checkpoints" / time.strftime("%Y%m%d-%H%M%S")  # one directory per run
    made: list[Any] = []

    def factory(model: Any, opt: Any, sched: Any, scaler: Any = None) -> Any:
        mon = Monitor(
            model,
            opt,
            scheduler=sched,
            scaler=scaler,
            store=url,
            runbook=None if runbook == "none" else runbook,
            mode=mode,
            config=MonitorConfig(clip=config.clip, checkpoint_every=25, checkpoint_keep=40,
                                 updates=UpdateConfig(every=10)),
            checkpoint_dir=str(ckpt_dir),
            run_name=f"demo-tiny-gpt-{scenario}",
            recipe={"scenario": scenario, **dataclasses.asdict(config)},
        )
        made.append(mon)
        return mon

    echo(f"training the tiny GPT for {config.steps} steps, scenario {scenario}: {chosen.origin}")
    echo(f"runbook {runbook}, mode {mode}, seed {seed}; monitored into {_where(url)}, "
               f"checkpoints in {ckpt_dir} ...")
    try:
        result = sc.tiny_gpt.train(config, monitor=factory)
    except ValueError as exc:
        fail(str(exc))
    for line in summary(made[0], url, result):
        echo(line)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
