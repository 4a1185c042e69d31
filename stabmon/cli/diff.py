"""``stabmon diff RUN_A RUN_B``: where two runs' environments and metric trajectories part.

Exit status: 0 when the runs were compared (they agree or diverge), 3 when they share no (metric, step) pair and
so nothing could be compared (an empty run, or step ranges that do not meet), 1 on a user error."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import typer

from stabmon.cli._common import DbOption, echo, fail, print_json, store_session

NO_OVERLAP_EXIT = 3

PresetOption = Annotated[
    str, typer.Option("--preset", help="tight (bit-identical, the default) | loose (same recipe: 5% or 1e-3).")
]


def diff(
    run_a: Annotated[str, typer.Argument(help="First run: id, unique id prefix, name, or 'latest'.")],
    run_b: Annotated[str, typer.Argument(help="Second run.")],
    preset: PresetOption = "tight",
    rtol: Annotated[float | None, typer.Option("--rtol", help="Relative tolerance (overrides the preset's).")] = None,
    atol: Annotated[float | None, typer.Option("--atol", help="Absolute tolerance (overrides the preset's).")] = None,
    metrics: Annotated[
        list[str] | None, typer.Option("--metric", help="Compare only this metric, repeatable (default: all shared).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
    db: DbOption = None,
) -> None:
    """Environment-fingerprint differences and the first step at which the metric trajectories diverge."""
    from stabmon.diff import PRESETS, Tolerance, diff_trajectories, environment_differences
    from stabmon.recipe import recipe_differences

    if preset not in PRESETS:
        fail(f"--preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    base = PRESETS[preset]
    try:
        tol = Tolerance(rtol=base.rtol if rtol is None else rtol, atol=base.atol if atol is None else atol,
                        name=base.name if rtol is None and atol is None else "custom")
    except ValueError as exc:
        fail(str(exc).replace("diff.tolerance.", "--"))
    runs, configs, envs, frames = _load(db, [run_a, run_b])
    try:
        result = diff_trajectories(frames[0], frames[1], tolerance=tol, metrics=metrics)
    except ValueError as exc:
        fail(str(exc))
    env = environment_differences(envs[0], envs[1])
    recipe = recipe_differences(configs[0], configs[1])
    if as_json:
        print_json({**_as_json(runs, tol, env, result), "recipe": [dataclasses.asdict(d) for d in recipe]})
    else:
        for line in _lines(runs, env, result, recipe):
            echo(line)
    if result.verdict == "no-overlap":
        raise typer.Exit(code=NO_OVERLAP_EXIT)


def _load(
    db: str | None, refs: list[str]
) -> tuple[list[tuple[str, str]], list[dict[str, Any]], list[dict[str, Any]], list[Any]]:
    """Each run's (id, name), stored config (recipe included), environment and metrics."""
    from stabmon.store import RunNotFoundError, repo

    runs, configs, envs, frames = [], [], [], []
    with store_session(db) as s:
        for ref in refs:
            try:
                run = repo.resolve_run(session=s, ref=ref)
            except RunNotFoundError as exc:
                fail(str(exc))
            runs.append((run.id, run.name))
            config, environment = repo.run_config(session=s, run_id=run.id)
            configs.append(config)
            envs.append(environment)
            frames.append(repo.get_metrics(session=s, run_id=run.id))
    return runs, configs, envs, frames


def _as_json(runs: list[tuple[str, str]], tol: Any, env: list[Any], result: Any) -> dict[str, Any]:
    return {
        "run_a": {"id": runs[0][0], "name": runs[0][1], "steps": result.steps_a},
        "run_b": {"id": runs[1][0], "name": runs[1][1], "steps": result.steps_b},
        "tolerance": dataclasses.asdict(tol),
        "verdict": result.verdict,
        "compared": result.compared,
        "first_divergence": result.first_divergence,
        "metrics": {k: dataclasses.asdict(v) for k, v in result.metrics.items()},
        "only_in_a": result.only_in_a,
        "only_in_b": result.only_in_b,
        "environment": [dataclasses.asdict(d) for d in env],
    }


def _lines(runs: list[tuple[str, str]], env: list[Any], result: Any, recipe: list[Any]) -> list[str]:
    t = result.tolerance
    out = [f"A: {runs[0][0]} ({runs[0][1]}), steps {_span(result.steps_a)}",
           f"B: {runs[1][0]} ({runs[1][1]}), steps {_span(result.steps_b)}"]
    for title, found in (("recipe", recipe), ("environment", env)):
        out.append(f"{title}: {len(found)} difference(s)" + (":" if found else ""))
        out += [f"  {d.path:<40} {d.a!s:<28} -> {d.b!s}" for d in found]
    out.append(f"trajectories ({t.name}: rtol {t.rtol:g}, atol {t.atol:g}):")
    for m in result.metrics.values():
        if not m.compared:
            out.append(f"  {m.name:<32} no shared step")
        elif m.first_divergence is None:
            out.append(f"  {m.name:<32} agree over {m.compared} shared steps")
        else:
            out.append(f"  {m.name:<32} diverge at step {m.first_divergence}: {m.a!r} vs {m.b!r} "
                       f"(abs {m.abs_diff:.3g}, rel {m.rel_diff:.3g})")
    for side, names in (("A", result.only_in_a), ("B", result.only_in_b)):
        if names:
            out.append(f"  only in {side}: {', '.join(names)}")
    first = result.first_divergence
    if result.verdict == "no-overlap":
        out.append(f"nothing to compare: the runs share no step of any metric (A: steps {_span(result.steps_a)}, "
                   f"B: steps {_span(result.steps_b)})")
        return out
    out.append("first divergence: " + ("none (the trajectories agree)" if first is None else f"step {first}"))
    return out


def _span(r: tuple[int, int] | None) -> str:
    return "none" if r is None else f"{r[0]}-{r[1]}"


def register(app: typer.Typer) -> None:
    app.command("diff")(diff)
