"""``stabmon tune``: search detector parameters against labelled runs and write an override file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from stabmon.cli._common import echo, fail, print_json
from stabmon.cli.eval import EngineOption, GroupWandbOption, make_engine_or_fail
from stabmon.cli.importing import PatternOption
from stabmon.replay.progress import progress_bar, wanted


def tune_command(
    labels: Annotated[Path, typer.Option("--labels", help="LABELS.csv (file paths relative to it).")],
    out: Annotated[Path, typer.Option("--out", help="Override file to write (YAML).")],
    use_grid: Annotated[bool, typer.Option("--grid", help="Try every combination (the default).")] = False,
    n_random: Annotated[
        int | None, typer.Option("--random", help="Try N random combinations instead.")
    ] = None,
    space: Annotated[
        Path | None, typer.Option("--space", help="YAML: detector.param -> list of values.")
    ] = None,
    jobs: Annotated[
        int, typer.Option("--jobs", help="Candidates scored in parallel processes (ray: a local instance's CPUs).")
    ] = 1,
    folds: Annotated[int, typer.Option("--folds", help="Cross-validation folds over the runs.")] = 2,
    leave_one_out: Annotated[
        bool, typer.Option("--leave-one-out", help="One fold per run (overrides --folds).")
    ] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed of --random.")] = 0,
    runbook: Annotated[
        str | None, typer.Option("--runbook", help="Runbook to replay with (default: none).")
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    patterns: PatternOption = None,
    engine: EngineOption = "local",
    group_wandb: GroupWandbOption = False,
) -> None:
    """Search detector parameters (grid or random, in parallel), objective recall and lead time penalised by
    false alarms, cross-validated over runs; write the winner as a file a runbook can `include:`."""
    from stabmon.replay.tune import count_candidates, held_out, tune

    if n_random is not None and n_random < 1:
        fail(f"--random must be >= 1, got {n_random}")
    if use_grid and n_random:
        fail("--grid and --random are exclusive")
    if folds < 2:
        fail(f"--folds must be >= 2 (each fold is held out once for cross-validation), got {folds}")
    if jobs < 1:
        fail(f"--jobs must be >= 1, got {jobs}")
    if not labels.is_file():
        fail(f"no such labels file: {labels}")
    runner = make_engine_or_fail(engine, jobs)
    _check_out(out)
    space_map = _read_space(space) if space else None
    try:
        total = count_candidates(space_map, n_random)
        with progress_bar("tune", total=total, enabled=wanted(json_output)) as advance:
            result = tune(
                labels,
                space=space_map,
                n_random=n_random,
                seed=seed,
                folds=folds,
                leave_one_out=leave_one_out,
                jobs=jobs,
                runbook=runbook,
                progress=advance,
                patterns=tuple(patterns or ()),
                engine=runner,
                group_wandb=group_wandb,
            )
    except (ValueError, OSError) as exc:
        fail(str(exc).splitlines()[0])
    try:
        out.write_text(result.overrides_yaml())
    except OSError as exc:
        fail(f"--out {out}: cannot write: {exc.strerror or exc}")
    if json_output:
        print_json(
            {
                "best": result.best,
                "metrics": result.best_metrics,
                "folds": result.folds,
                "held_out": held_out(result.folds),
                "candidates": result.candidates,
                "out": str(out),
            }
        )
        return
    echo(f"best of {len(result.candidates)} candidates: {result.best}")
    m = result.best_metrics
    echo(f"  on all runs: recall {m.get('recall')}, false alarms/10k {m.get('false_alarms_per_10k')}")
    for f in result.folds:
        tm = f["test_metrics"]
        echo(
            f"  fold {f['fold']}: tuned on {len(f['train_runs'])} runs -> {f['overrides']}; held-out "
            f"{', '.join(f['test_runs'])}: recall {tm.get('recall')}, "
            f"false alarms/10k {tm.get('false_alarms_per_10k')}"
        )
    if result.folds:
        h = held_out(result.folds)
        echo(f"  held out, all folds: {h['detected']}/{h['numeric_incidents']} incidents detected "
                   f"(recall {h['recall']}), {h['false_alarms']} false alarms in {h['steps']} steps")
    echo(f"wrote {out} (use it with `include: {out}` in a runbook)")


def _check_out(out: Path) -> None:
    """Fail before the search when the override file could not be written afterwards."""
    import os

    if out.is_dir():
        fail(f"--out {out} is a directory; name the file to write")
    parent = out.parent
    if not parent.is_dir():
        fail(f"--out {out}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        fail(f"--out {out}: not writable")


def _read_space(space: Path) -> dict[str, list[Any]]:
    """The --space file, validated: a mapping of detector.param to a non-empty list of values."""
    import yaml

    from stabmon.replay.tune import validate_space

    if not space.is_file():
        fail(f"no such space file: {space}")
    try:
        return validate_space(yaml.safe_load(space.read_text()))
    except (ValueError, OSError, yaml.YAMLError) as exc:
        fail(f"--space {space}: {str(exc).splitlines()[0]}")


def register(app: typer.Typer) -> None:
    app.command("tune")(tune_command)
