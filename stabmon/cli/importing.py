"""``stabmon import``: read recorded logs into the store as a run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from stabmon.cli._common import DbOption, db_url, echo, fail, print_json
from stabmon.replay.importers.base import ImportResult
from stabmon.replay.progress import progress_bar, wanted

BATCH = 5000
FLUSH_EVERY = 50_000
"""Records queued to the store before the import waits for the database to take them (bounds the memory the
queue holds, whatever the file's length)."""
MAX_RESTARTS_KEPT = 100
"""Restart steps kept in the run's config (``restarts_total`` counts them all)."""
IMPORT_FLUSH_TIMEOUT = 600.0


def check_storable(run: str, result: ImportResult, files: list[Path]) -> None:
    """Refuse, before any run is created, an import that would store nothing or names the store cannot hold."""
    from stabmon.store.limits import name_problem

    problem = name_problem("--run", run)
    if problem is None:
        names = result.metric_names(keep=lambda n: name_problem("metric name", n) is not None)
        problem = next((name_problem(f"metric name {n[:40]!r}...", n) for n in names), None)
    if problem is not None:
        fail(problem)


PatternOption = Annotated[
    list[str] | None,
    typer.Option("--pattern", help="Regex with a (?P<step>...) group and one named group per metric, for any "
                 "text log; repeatable (the first that matches a line reads it). Implies --format pattern."),
]


def read_inputs(
    files: list[Path],
    fmt: str | None,
    maps: list[str] | None,
    step_column: str | None,
    patterns: list[str] | None = None,
) -> ImportResult:
    """Import FILE... (segments of one run, stitched) with the CLI's options; user errors exit 1, and so does
    an import that found no step, or no metric at all."""
    from stabmon.replay.importers.sniff import UnknownFormatError, import_files, nothing_read

    for f in files:
        if not f.exists():
            fail(f"no such file: {f}")
    try:
        fmt, options = _options(fmt, maps, step_column, patterns)
        result = import_files(files, format=fmt, **options)
    except (UnknownFormatError, ValueError) as exc:
        fail(str(exc))
    problem = nothing_read(result, files)
    if problem is not None:
        result.close()
        fail(problem)
    return result


def _options(fmt: str | None, maps: list[str] | None, step_column: str | None,
             patterns: list[str] | None) -> tuple[str | None, dict[str, Any]]:
    """The format and the importer's options the CLI's flags ask for; ValueError on a bad flag."""
    from stabmon.replay.importers.generic import parse_mapping
    from stabmon.replay.importers.pattern import FORMAT as PATTERN
    from stabmon.replay.importers.pattern import compile_patterns

    options: dict[str, Any] = {"mapping": parse_mapping(maps)} if maps else {}
    if step_column:
        options["step_column"] = step_column
    if patterns:
        if fmt not in (None, PATTERN):
            raise ValueError(f"--pattern reads the file with your regex; it cannot be combined with --format {fmt}")
        fmt, options["patterns"] = PATTERN, compile_patterns(patterns)
    elif fmt == PATTERN:
        raise ValueError("--format pattern needs --pattern REGEX")
    return fmt, options


def import_command(
    files: Annotated[list[Path], typer.Argument(help="Log files; several are the segments of one run.")],
    run: Annotated[str, typer.Option("--run", help="Name of the run to create.")],
    fmt: Annotated[str | None, typer.Option("--format", help="Format (default: detected).")] = None,
    maps: Annotated[list[str] | None, typer.Option("--map", help="COLUMN=METRIC, repeatable.")] = None,
    step_column: Annotated[str | None, typer.Option("--step-column", help="Column holding the step.")] = None,
    patterns: PatternOption = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print a JSON summary.")] = False,
    replace: Annotated[bool, typer.Option("--replace", help="Replace the run of this name if there is one.")] = False,
    db: DbOption = None,
) -> None:
    """Import recorded training logs (Megatron, fairseq, llm.c, DeepSpeed, W&B, TensorBoard,
    CSV/JSONL/Parquet, nanoGPT, any text log with --pattern) as a run of kind "import". Malformed lines are
    counted and reported, never fatal; an import that found no metric at all is an error. One run per name: an
    earlier import of the same name that was interrupted is replaced; any other run of that name is an error
    unless --replace."""
    with read_inputs(files, fmt, maps, step_column, patterns) as result:
        check_storable(run, result, files)
        run_id = _store_run(run, result, files, db, progress=wanted(json_output), replace=replace)
        summary = {
            "run_id": run_id,
            "run": run,
            "format": result.format,
            "records": len(result),
            "malformed": result.malformed,
            "problems": result.problems,
            "restarts": result.restarts[:MAX_RESTARTS_KEPT],
            "restarts_total": len(result.restarts),
            "first_step": result.first_step,
            "last_step": result.last_step,
        }
    if json_output:
        print_json(summary)
        return
    _echo_summary(summary, result)


def _make_room(store: Any, run: str, *, replace: bool) -> None:
    """One run per name: delete an earlier run named ``run`` when it is an interrupted (or failed) import or
    ``replace`` asks; exit 1 naming it otherwise (or when another process is importing it right now)."""
    from sqlalchemy import select

    from stabmon.store import repo
    from stabmon.store.models import Run

    with store.session() as s:
        for found in s.scalars(select(Run).where(Run.name == run)).all():
            status = repo.run_status(found)
            if status == "running":
                fail(f"run {run!r} [{found.id}] is being written right now ({found.kind}); wait for it, or choose "
                     "another --run")
            redo = found.kind == "import" and status in ("interrupted", "failed")
            if not (redo or replace):
                fail(f"a run named {run!r} exists already [{found.id}, {found.kind}, {status}]; pass --replace to "
                     "replace it, or choose another --run")
            repo.delete_run(session=s, run_id=found.id)
            echo(f"replacing run {run!r} [{found.id}, {found.kind}, {status}]", err=True)


def _store_run(run: str, result: ImportResult, files: list[Path], db: str | None, *, progress: bool,
               replace: bool = False) -> str:
    """Write the records to a new run, a batch at a time, waiting for the database every ``FLUSH_EVERY``
    records; an import the database did not take in full is marked failed and exits 1, one stopped by Ctrl-C
    is marked interrupted (one killed outright reads as interrupted once its lease is gone)."""
    from stabmon.store import StoreConfig, open_store

    try:
        store = open_store(db_url(db), config=StoreConfig(fail_fast=True))  # an import does not wait for a server
    except ValueError as exc:
        fail(str(exc))
    with store, progress_bar("import", total=len(result), enabled=progress) as advance:
        _make_room(store, run, replace=replace)
        run_id = store.start_run(
            name=run,
            kind="import",
            source=", ".join(str(f) for f in files),
            config={
                "format": result.format,
                "restarts": result.restarts[:MAX_RESTARTS_KEPT],
                "restarts_total": len(result.restarts),
                "malformed": result.malformed,
            },
        )
        try:
            complete = _write_records(store, run_id, result, advance)
        except BaseException:  # Ctrl-C, SIGTERM turned into SystemExit: say so before the store closes
            store.end_run(run_id=run_id, status="interrupted")
            raise
        if complete:
            store.end_run(run_id=run_id, status="completed")
        if not complete or not store.flush(IMPORT_FLUSH_TIMEOUT) or store.stats.rejected_batches:
            store.end_run(run_id=run_id, status="failed")
            fail(f"import of run {run!r} [{run_id}] is incomplete: the database did not take every row "
                 f"({store.stats.rejected_batches} batch(es) refused; see the store's log)")
    return run_id


def _write_records(store: Any, run_id: str, result: ImportResult, advance: Any) -> bool:
    """Queue every record, waiting for the database every ``FLUSH_EVERY``; False when it did not take them."""
    queued = 0
    for chunk in result.batches(BATCH):
        store.write_steps(run_id=run_id, records=chunk)
        advance(len(chunk))
        queued += len(chunk)
        if queued >= FLUSH_EVERY:
            if not store.flush(IMPORT_FLUSH_TIMEOUT):
                return False
            queued = 0
    return True


def _echo_summary(summary: dict[str, Any], result: ImportResult) -> None:
    echo(
        f"imported {summary['records']} steps ({result.format}) as run {summary['run']!r} [{summary['run_id']}]"
        f"; steps {summary['first_step']}..{summary['last_step']}"
    )
    if result.restarts:
        more = len(result.restarts) - MAX_RESTARTS_KEPT
        shown = f"{result.restarts[:MAX_RESTARTS_KEPT]}" + (f" and {more} more" if more > 0 else "")
        echo(f"restarts (a later segment superseded an earlier one): {shown}")
    if result.malformed:
        echo(f"{result.malformed} malformed line(s); first ones:")
        for p in result.problems:
            echo(f"  {p}")


def register(app: typer.Typer) -> None:
    app.command("import")(import_command)
