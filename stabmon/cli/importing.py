"""``stabmon import``: read recorded logs into the store as a run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from stabmon.cli._common import DbOption, db_url, fail, print_json
from stabmon.replay.importers.base import ImportResult
from stabmon.replay.progress import progress_bar, wanted

BATCH = 5000


def read_inputs(
    files: list[Path], fmt: str | None, maps: list[str] | None, step_column: str | None
) -> ImportResult:
    """Import FILE... (segments of one run, stitched) with the CLI's options; user errors exit 1."""
    from stabmon.replay.importers.detect import UnknownFormatError, import_files
    from stabmon.replay.importers.generic import parse_mapping

    for f in files:
        if not f.exists():
            fail(f"no such file: {f}")
    try:
        options: dict[str, Any] = {"mapping": parse_mapping(maps)} if maps else {}
        if step_column:
            options["step_column"] = step_column
        return import_files(files, format=fmt, **options)
    except (UnknownFormatError, ValueError) as exc:
        fail(str(exc))


def import_command(
    files: Annotated[list[Path], typer.Argument(help="Log files; several are the segments of one run.")],
    run: Annotated[str, typer.Option("--run", help="Name of the run to create.")],
    fmt: Annotated[str | None, typer.Option("--format", help="Format (default: detected).")] = None,
    maps: Annotated[list[str] | None, typer.Option("--map", help="COLUMN=METRIC, repeatable.")] = None,
    step_column: Annotated[str | None, typer.Option("--step-column", help="Column holding the step.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print a JSON summary.")] = False,
    db: DbOption = None,
) -> None:
    """Import recorded training logs (Megatron, fairseq, llm.c, DeepSpeed, W&B, TensorBoard,
    CSV/JSONL/Parquet) as a run of kind "import". Malformed lines are counted and reported, never fatal."""
    from stabmon.store import open_store

    result = read_inputs(files, fmt, maps, step_column)
    try:
        store = open_store(db_url(db))
    except ValueError as exc:
        fail(str(exc))
    with store, progress_bar("import", total=len(result.records), enabled=wanted(json_output)) as advance:
        run_id = store.start_run(
            name=run,
            kind="import",
            source=", ".join(str(f) for f in files),
            config={"format": result.format, "restarts": result.restarts, "malformed": result.malformed},
        )
        for i in range(0, len(result.records), BATCH):
            chunk = result.records[i : i + BATCH]
            store.write_steps(run_id=run_id, records=chunk)
            advance(len(chunk))
        store.end_run(run_id=run_id, status="completed")
        store.flush()
    summary = {
        "run_id": run_id,
        "run": run,
        "format": result.format,
        "records": len(result.records),
        "malformed": result.malformed,
        "problems": result.problems,
        "restarts": result.restarts,
        "first_step": result.records[0].step if result.records else None,
        "last_step": result.records[-1].step if result.records else None,
    }
    if json_output:
        print_json(summary)
        return
    typer.echo(
        f"imported {summary['records']} steps ({result.format}) as run {run!r} [{run_id}]"
        f"; steps {summary['first_step']}..{summary['last_step']}"
    )
    if result.restarts:
        typer.echo(f"restarts (a later segment superseded an earlier one): {result.restarts}")
    if result.malformed:
        typer.echo(f"{result.malformed} malformed line(s); first ones:")
        for p in result.problems:
            typer.echo(f"  {p}")


def register(app: typer.Typer) -> None:
    app.command("import")(import_command)
