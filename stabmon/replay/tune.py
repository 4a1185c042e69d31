"""Search detector parameters against labelled runs, cross-validated, and write the winner as an override
file.

Every candidate is a set of ``detector.param=value`` overrides. It is scored on a set of labelled runs by
replaying them through stabmon (the same detectors and, when given, runbook as
:func:`stabmon.replay.eval.evaluate`) and applying :func:`objective`: recall on the numeric incidents, plus a
small reward for lead time, minus a penalty per false alarm per 10k steps. Runs are split into ``folds``
groups (``leave_one_out``: one group per run); for each fold the best candidate on the other runs is reported on
the held-out one (so the figures are not fitted to the runs they describe), and the candidate best over all
runs is the one written. :func:`held_out` sums the held-out folds into one figure. Candidates are
scored in parallel processes (``jobs``); each worker imports the runs once.

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

from stabmon.replay.eval import RunAlerts, _spawn, alerts_for, default_factory, score
from stabmon.replay.importers.pattern import compile_patterns
from stabmon.replay.importers.sniff import import_files
from stabmon.replay.labels import Label, read_labels, run_files

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
    records: list[Any]
    restarts: list[int]
    labels: list[Label]


def load_runs(labels_path: str | Path, patterns: Sequence[str] = ()) -> list[LabelledRun]:
    """Every run with at least one numeric or control label, imported (segments stitched), in name order;
    with ``patterns`` every file is read as a text log with them (``importers/pattern.py``)."""
    labels_path = Path(labels_path)
    if patterns:
        compile_patterns(patterns)  # a bad pattern is one error here, not every run silently left out
    runs: dict[str, LabelledRun] = {}
    for lb in read_labels(labels_path):
        name, files = run_files(lb, labels_path.parent)
        if not files:
            continue
        if name not in runs:
            try:
                imported = import_files(files, format="pattern" if patterns else None, patterns=patterns)
            except Exception:  # noqa: BLE001 - a run no importer reads is left out of tuning
                continue
            runs[name] = LabelledRun(name, imported.records, imported.restarts, [])
        runs[name].labels.append(lb)
    return [runs[k] for k in sorted(runs) if any(lb.category != "other" for lb in runs[k].labels)]


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


def _init_worker(labels_path: str, patterns: Sequence[str]) -> None:
    global _RUNS
    _RUNS = load_runs(labels_path, patterns)


def _candidate_alerts(
    overrides: Mapping[str, Any], runbook: Any, runs: Sequence[LabelledRun] | None = None
) -> dict[str, RunAlerts]:
    items = tuple(f"{k}={v}" for k, v in overrides.items())
    factory = functools.partial(default_factory, runbook=runbook, overrides=items)
    return {
        r.name: alerts_for(r.records, run=r.name, factory=factory, restarts=r.restarts, peers=False)
        for r in (runs if runs is not None else _RUNS)
    }


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
) -> TuneResult:
    """Search, cross-validate and pick the winner; see the module docstring."""
    space = validate_space(space if space is not None else DEFAULT_SPACE)
    if folds < 1:
        raise ValueError(f"tune.folds must be >= 1, got {folds}")
    if jobs < 1:
        raise ValueError(f"tune.jobs must be >= 1, got {jobs}")
    candidates = random_candidates(space, n_random, seed=seed) if n_random else grid(space)
    runs = load_runs(labels_path, patterns)
    if not runs:
        raise ValueError(f"{labels_path}: no labelled run could be imported")
    per_candidate: list[dict[str, RunAlerts]] = []
    if jobs > 1:
        init = (str(labels_path), tuple(patterns))
        with ProcessPoolExecutor(max_workers=jobs, mp_context=_spawn(), initializer=_init_worker,
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
