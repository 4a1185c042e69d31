"""Search detector parameters against labelled runs, cross-validated, and write the winner as an override
file.

Every candidate is a set of ``detector.param=value`` overrides. It is scored on a set of labelled runs by
replaying them through stabmon (the same detectors and, when given, runbook as
:func:`stabmon.replay.eval.evaluate`) and applying :func:`objective`: recall on the numeric incidents, plus a
small reward for lead time, minus a penalty per false alarm per 10k steps. Runs are split into ``folds``
groups (``leave_one_out``: one group per run); for each fold the best candidate on the other runs is reported on
the held-out one (so the figures are not fitted to the runs they describe), and the candidate best over all
runs is the one written. :func:`held_out` sums the held-out folds into one figure. With the local engine
candidates are scored in parallel processes (``jobs``), each worker importing the runs once; with a distributed
engine (``engine="ray"``, :mod:`stabmon.replay.engines`) each run is one task that imports it from its files and
replays every candidate on it. Both give the same result.

The output is a YAML mapping ``{"detectors": {name: {param: value}}}`` that a runbook merges with
``include: tuned.yaml``.

>>> space = {"spike.z_threshold": [4.0, 6.0], "spike.alpha": [0.05]}
>>> grid(space)
[{'spike.z_threshold': 4.0, 'spike.alpha': 0.05}, {'spike.z_threshold': 6.0, 'spike.alpha': 0.05}]
>>> len(random_candidates(space, 1, seed=0)), len(random_candidates(space, 9, seed=0))  # at most the grid
(1, 2)
>>> objective({"recall": 1.0, "mean_lead": 4.0, "false_alarms_per_10k": 0.5})
0.99
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from stabmon.replay.engines import Engine, LocalEngine, make_engine, spawn_context
from stabmon.replay.eval import RunAlerts, alerts_for, default_factory, score
from stabmon.replay.importers.pattern import compile_patterns
from stabmon.replay.labels import Label, RunSpec, read_labels, runs_of

DEFAULT_SPACE: dict[str, list[Any]] = {
    "spike.z_threshold": [4.0, 6.0, 8.0],
    "robust_spike.z_threshold": [4.0, 6.0, 8.0],
    "spike.alpha": [0.02, 0.05],
}

LEAD_WEIGHT = 0.01  # per step of lead, capped at +-LEAD_CAP steps
LEAD_CAP = 10
FA_WEIGHT = 0.1  # per false alarm per 10k steps


def objective(
    metrics: Mapping[str, Any], *, fa_weight: float = FA_WEIGHT, lead_weight: float = LEAD_WEIGHT
) -> float:
    """``recall + lead_weight * clip(mean lead, +-10) - fa_weight * false alarms per 10k steps`` (rounded)."""
    recall = metrics.get("recall") or 0.0
    lead = metrics.get("mean_lead") or 0.0
    fa = metrics.get("false_alarms_per_10k") or 0.0
    return round(recall + lead_weight * max(-LEAD_CAP, min(LEAD_CAP, lead)) - fa_weight * fa, 6)


def grid(space: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    keys = list(space)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(space[k] for k in keys))]


def random_candidates(space: Mapping[str, Sequence[Any]], n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` candidates drawn uniformly from the grid (without repeats while the grid allows)."""
    rng = random.Random(seed)
    full = grid(space)
    if n >= len(full):
        return full
    return rng.sample(full, n)


def validate_space(space: Mapping[str, Any]) -> dict[str, list[Any]]:
    """A search space maps ``detector.param`` to a non-empty list of values; one-line ValueError otherwise."""
    if not isinstance(space, Mapping) or not space:
        raise ValueError("tune.space must be a non-empty mapping of detector.param to a list of values")
    out = {}
    for key, values in space.items():
        if not isinstance(key, str) or len(key.split(".")) != 2:
            raise ValueError(f"tune.space.{key} must name detector.param, e.g. spike.z_threshold")
        if not isinstance(values, (list, tuple)) or not values:
            raise ValueError(f"tune.space.{key} must be a non-empty list of values, got {values!r}")
        out[key] = list(values)
    return out


@dataclass
class LabelledRun:
    name: str
    records: list[Any]  # empty where the run was replayed in a distributed engine's task, not here
    restarts: list[int]
    labels: list[Label]


def labelled_specs(
    labels_path: str | Path, patterns: Sequence[str] = (), *, group_wandb: bool = False
) -> list[tuple[RunSpec, list[Label]]]:
    """Every run with files and at least one numeric or control label, with its labels, in name order."""
    labels_path = Path(labels_path)
    labels = read_labels(labels_path)
    label_runs, specs = runs_of(labels, labels_path.parent, patterns=patterns, group_wandb=group_wandb)
    by_run: dict[str, list[Label]] = {}
    for i, lb in enumerate(labels):
        by_run.setdefault(label_runs[i], []).append(lb)
    return [(specs[n], by_run[n]) for n in sorted(specs)
            if specs[n].error is None and any(lb.category != "other" for lb in by_run[n])]


def load_runs(labels_path: str | Path, patterns: Sequence[str] = (), *, group_wandb: bool = False) -> list[LabelledRun]:
    """Every run with at least one numeric or control label, imported (segments stitched), in name order; a
    file is read with its row's ``format`` / ``pattern`` column, else with ``patterns`` when given
    (``importers/pattern.py``), else its sniffed format. A run no importer reads is left out."""
    if patterns:
        compile_patterns(patterns)  # a bad pattern is one error here, not every run silently left out
    runs = []
    for spec, labels in labelled_specs(labels_path, patterns, group_wandb=group_wandb):
        try:
            imported = spec.read()
        except Exception:  # noqa: BLE001 - a run no importer reads is left out of tuning
            continue
        runs.append(LabelledRun(spec.name, imported.records, imported.restarts, labels))
    return runs


def metrics_for(runs: Sequence[LabelledRun], alerts: Mapping[str, RunAlerts]) -> dict[str, Any]:
    labels = [lb for r in runs for lb in r.labels]
    label_runs = {i: r.name for i, (r, _) in enumerate((r, lb) for r in runs for lb in r.labels)}
    report = score(labels, {r.name: alerts[r.name] for r in runs}, label_runs)
    summary = report.summary.get("stabmon", {})
    leads = [
        x["lead_steps"]
        for x in report.incidents
        if x["method"] == "stabmon" and x["category"] == "numeric" and x["lead_steps"] is not None
    ]
    return {**summary, "mean_lead": sum(leads) / len(leads) if leads else None}


_RUNS: list[LabelledRun] = []


def _init_worker(labels_path: str, patterns: Sequence[str], group_wandb: bool) -> None:
    global _RUNS
    _RUNS = load_runs(labels_path, patterns, group_wandb=group_wandb)


def _factory(overrides: Mapping[str, Any], runbook: Any) -> Callable[[], Any]:
    items = tuple(f"{k}={v}" for k, v in overrides.items())
    return functools.partial(default_factory, runbook=runbook, overrides=items)


def _candidate_alerts(
    overrides: Mapping[str, Any], runbook: Any, runs: Sequence[LabelledRun] | None = None
) -> dict[str, RunAlerts]:
    factory = _factory(overrides, runbook)
    return {
        r.name: alerts_for(r.records, run=r.name, factory=factory, restarts=r.restarts, peers=False)
        for r in (runs if runs is not None else _RUNS)
    }


def _run_candidates(spec: RunSpec, candidates: Sequence[Mapping[str, Any]], runbook: Any) -> list[RunAlerts] | None:
    """One run's task in a distributed engine: import it from its files, replay every candidate on it (None: no
    importer reads it, and it is left out, as :func:`load_runs` leaves it out)."""
    try:
        imported = spec.read()
    except Exception:  # noqa: BLE001 - a run no importer reads is left out of tuning
        return None
    records = imported.records
    return [alerts_for(records, run=spec.name, factory=_factory(c, runbook), restarts=imported.restarts, peers=False)
            for c in candidates]


@dataclass
class TuneResult:
    best: dict[str, Any]
    best_metrics: dict[str, Any]
    candidates: list[dict[str, Any]] = field(default_factory=list)  # overrides, objective on all runs
    folds: list[dict[str, Any]] = field(
        default_factory=list
    )  # per fold: train/test runs, winner, held-out metrics

    def overrides_yaml(self) -> str:
        nested: dict[str, dict[str, Any]] = {}
        for key, value in self.best.items():
            det, param = key.split(".")
            nested.setdefault(det, {})[param] = value
        head = (
            "# detector settings chosen by `stabmon tune`; merge into a runbook with `include: <this file>`\n"
        )
        return head + yaml.safe_dump({"detectors": nested}, sort_keys=True)


def tune(
    labels_path: str | Path,
    *,
    space: Mapping[str, Sequence[Any]] | None = None,
    n_random: int | None = None,
    seed: int = 0,
    folds: int = 2,
    leave_one_out: bool = False,
    jobs: int = 1,
    runbook: Any = None,
    score_fn: Callable[[Mapping[str, Any]], float] = objective,
    progress: Callable[[int], None] | None = None,
    patterns: Sequence[str] = (),
    engine: str | Engine = "local",
    group_wandb: bool = False,
) -> TuneResult:
    """Search, cross-validate and pick the winner; see the module docstring. ``engine``: ``"local"`` (``jobs``
    processes, one candidate each at a time), ``"ray"`` (one task per run) or an :class:`Engine`."""
    space = validate_space(space if space is not None else DEFAULT_SPACE)
    if folds < 1:
        raise ValueError(f"tune.folds must be >= 1, got {folds}")
    if jobs < 1:
        raise ValueError(f"tune.jobs must be >= 1, got {jobs}")
    candidates = random_candidates(space, n_random, seed=seed) if n_random else grid(space)
    runner = make_engine(engine, jobs=jobs) if isinstance(engine, str) else engine
    if runner.distributed:
        runs, per_candidate = _distributed(runner, labels_path, candidates, runbook, patterns, group_wandb, progress)
    else:
        runs = load_runs(labels_path, patterns, group_wandb=group_wandb)
        if not runs:
            raise ValueError(f"{labels_path}: no labelled run could be imported")
        per_candidate = _local(runner, runs, labels_path, candidates, runbook, patterns, group_wandb, progress)
    rows: list[dict[str, Any]] = []
    for cand, alerts in zip(candidates, per_candidate, strict=True):
        m = metrics_for(runs, alerts)
        rows.append({"overrides": cand, "objective": score_fn(m), "metrics": m})
    best_i = max(range(len(rows)), key=lambda i: (rows[i]["objective"], -i))
    k = len(runs) if leave_one_out else min(folds, len(runs))
    fold_rows = []
    if k >= 2:
        for f in range(k):
            test = [r for i, r in enumerate(runs) if i % k == f]
            train = [r for i, r in enumerate(runs) if i % k != f]
            scores = [score_fn(metrics_for(train, a)) for a in per_candidate]
            win = max(range(len(scores)), key=lambda i: (scores[i], -i))
            held = metrics_for(test, per_candidate[win])
            fold_rows.append(
                {
                    "fold": f,
                    "train_runs": [r.name for r in train],
                    "test_runs": [r.name for r in test],
                    "overrides": candidates[win],
                    "train_objective": scores[win],
                    "test_objective": score_fn(held),
                    "test_metrics": held,
                }
            )
    return TuneResult(
        best=candidates[best_i], best_metrics=rows[best_i]["metrics"], candidates=rows, folds=fold_rows
    )


def _local(
    runner: Engine, runs: list[LabelledRun], labels_path: str | Path, candidates: list[dict[str, Any]], runbook: Any,
    patterns: Sequence[str], group_wandb: bool, progress: Callable[[int], None] | None,
) -> list[dict[str, RunAlerts]]:
    """Per candidate, its alerts on every run: candidates in ``jobs`` processes, each importing the runs once."""
    jobs = runner.jobs if isinstance(runner, LocalEngine) else 1
    per_candidate: list[dict[str, RunAlerts]] = []
    if jobs > 1:
        init = (str(labels_path), tuple(patterns), group_wandb)
        with ProcessPoolExecutor(max_workers=jobs, mp_context=spawn_context(), initializer=_init_worker,
                                 initargs=init) as pool:
            for res in pool.map(functools.partial(_candidate_alerts, runbook=runbook), candidates):
                per_candidate.append(res)
                if progress:
                    progress(1)
    else:
        for cand in candidates:
            per_candidate.append(_candidate_alerts(cand, runbook, runs))
            if progress:
                progress(1)
    return per_candidate


def _distributed(
    runner: Engine, labels_path: str | Path, candidates: list[dict[str, Any]], runbook: Any,
    patterns: Sequence[str], group_wandb: bool, progress: Callable[[int], None] | None,
) -> tuple[list[LabelledRun], list[dict[str, RunAlerts]]]:
    """(runs, per candidate its alerts on every run) with one task per run, each reading its own files."""
    if patterns:
        compile_patterns(patterns)
    pairs = labelled_specs(labels_path, patterns, group_wandb=group_wandb)
    share = _Share(len(candidates), len(pairs), progress)
    work = functools.partial(_run_candidates, candidates=candidates, runbook=runbook)
    results = runner.map(work, [spec for spec, _ in pairs], progress=share.advance)
    kept = [(spec, labels, res) for (spec, labels), res in zip(pairs, results, strict=True) if res is not None]
    if not kept:
        raise ValueError(f"{labels_path}: no labelled run could be imported")
    runs = [LabelledRun(spec.name, [], [], labels) for spec, labels, _ in kept]
    return runs, [{spec.name: res[c] for spec, _, res in kept} for c in range(len(candidates))]


class _Share:
    """A progress callback counted in candidates, advanced by runs done (``total`` candidates over ``runs``)."""

    def __init__(self, total: int, runs: int, progress: Callable[[int], None] | None) -> None:
        self.total, self.runs, self.progress, self.done, self.shown = total, max(runs, 1), progress, 0, 0

    def advance(self, n: int) -> None:
        self.done += n
        now = self.total * self.done // self.runs
        if self.progress and now > self.shown:
            self.progress(now - self.shown)
        self.shown = max(self.shown, now)


def held_out(folds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The held-out folds together: incidents detected / numeric incidents, false alarms and steps, summed
    over the folds' test runs (each run is held out exactly once).

    >>> held_out([{"test_metrics": {"numeric_incidents": 2, "detected": 1, "false_alarms": 3, "steps": 100}},
    ...           {"test_metrics": {"numeric_incidents": 0, "detected": 0, "false_alarms": 0, "steps": 50}}])
    {'numeric_incidents': 2, 'detected': 1, 'recall': 0.5, 'false_alarms': 3, 'steps': 150}
    """
    total = {k: sum(int(f["test_metrics"].get(k) or 0) for f in folds)
             for k in ("numeric_incidents", "detected", "false_alarms", "steps")}
    n = total["numeric_incidents"]
    return {"numeric_incidents": n, "detected": total["detected"],
            "recall": round(total["detected"] / n, 3) if n else None,
            "false_alarms": total["false_alarms"], "steps": total["steps"]}


def count_candidates(space: Mapping[str, Sequence[Any]] | None, n_random: int | None) -> int:
    total = math.prod(len(v) for v in validate_space(space if space is not None else DEFAULT_SPACE).values())
    return min(total, n_random) if n_random else total
