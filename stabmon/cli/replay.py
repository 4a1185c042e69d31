"""``stabmon replay``: run a recorded run through the detectors and a runbook, interventions simulated."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from stabmon.cli._common import DbOption, console, db_url, echo, fail, print_json
from stabmon.cli.importing import PatternOption
from stabmon.replay.progress import progress_bar, wanted

SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", help="detector.param=value override, repeatable (e.g. spike.z_threshold=5)."),
]


MODES = ("apply", "propose")


def _looks_like_path(ref: str) -> bool:
    """Whether a replay argument reads as a file path: a path separator or a file extension."""
    return "/" in ref or os.sep in ref or bool(Path(ref).suffix)


def _from_store(ref: str, url: str) -> tuple[list[Any], str, str, dict[str, Any]]:
    """(records, run id, run name, run config) of a stored run; ``ref`` is not an existing file."""
    from stabmon.store import RunNotFoundError, StoreConfig, open_store
    from stabmon.store.codec import decode
    from stabmon.store.database import sqlite_path
    from stabmon.store.repo import load_steps, resolve_run

    path_like = _looks_like_path(ref)
    if path_like:
        try:
            db_file = sqlite_path(url)
        except Exception:  # noqa: BLE001 - a URL that does not parse is reported by open_store below
            db_file = None
        if db_file is not None and not db_file.exists():  # no runs to match: do not create a database
            fail(f"no such file: {ref}")
    try:
        with open_store(url, config=StoreConfig(fail_fast=True)) as store, store.session() as session:
            run = resolve_run(session=session, ref=ref)
            config = decode(run.config) if run.config else {}
            return load_steps(session=session, run_id=run.id), run.id, run.name, dict(config or {})
    except RunNotFoundError as exc:
        if path_like and str(exc).startswith("no run matches"):
            # with a separator it reads as a file only; a bare "name.ext" could be a run name too
            fail(f"no such file: {ref}" if "/" in ref or os.sep in ref else f"no file or run named {ref!r}")
        fail(str(exc))
    except ValueError as exc:
        fail(str(exc))


def _live_flush_every(config: dict[str, Any]) -> int:
    """The flush cadence a stored live run was monitored with (1 when it was not recorded)."""
    monitor = config.get("monitor") if isinstance(config, dict) else None
    value = monitor.get("flush_every") if isinstance(monitor, dict) else None
    return value if isinstance(value, int) and value >= 1 else 1


def _live_watch(config: dict[str, Any]) -> tuple[int, int]:
    """The closer flushes a stored live run was monitored with (``MonitorConfig.watch``; none when not
    recorded: a run stored before it, or a file)."""
    monitor = config.get("monitor") if isinstance(config, dict) else None
    watch = monitor.get("watch") if isinstance(monitor, dict) else None
    if not isinstance(watch, dict):
        return 0, 1
    steps, every = watch.get("steps"), watch.get("flush_every")
    if isinstance(steps, int) and isinstance(every, int) and steps >= 0 and every >= 1:
        return steps, every
    return 0, 1


def _live_alarm(config: dict[str, Any]) -> tuple[bool, float | None]:
    """The loss alarm a stored live run flushed on (``MonitorConfig.flush_on_nonfinite``, ``flush_on_rise``; one
    process only; none when not recorded: a run stored before it, or a file)."""
    monitor = config.get("monitor") if isinstance(config, dict) else None
    if not isinstance(monitor, dict) or config.get("world_size", 1) != 1:
        return False, None
    rise = monitor.get("flush_on_rise")
    return monitor.get("flush_on_nonfinite") is True, rise if isinstance(rise, (int, float)) and rise > 1 else None


def _live_checkpoints(config: dict[str, Any]) -> int | None:
    """The checkpoint cadence of a stored live run (None: it saved none, so its rollbacks failed); 1 for a
    recording that says nothing about checkpoints (an imported log: assume one may be anywhere)."""
    monitor = config.get("monitor") if isinstance(config, dict) else None
    if not isinstance(monitor, dict) or "checkpoint_every" not in monitor:
        return 1
    every = monitor["checkpoint_every"]
    return every if isinstance(every, int) and every >= 1 else None


def replay_command(
    source: Annotated[list[str], typer.Argument(help="A stored run (name or id) or log file(s) to import.")],
    runbook: Annotated[str, typer.Option("--runbook", help="Runbook name or YAML path.")] = "default",
    sets: SetOption = None,
    approve: Annotated[bool, typer.Option("--approve", help="Approve every proposal (apply-mode view).")] = False,
    fmt: Annotated[str | None, typer.Option("--format", help="Format of FILE (default: detected).")] = None,
    maps: Annotated[list[str] | None, typer.Option("--map", help="COLUMN=METRIC for FILE, repeatable.")] = None,
    patterns: PatternOption = None,
    flush_every: Annotated[
        int | None,
        typer.Option("--flush-every", help="Live flush cadence to mimic (default: the stored run's, else 1)."),
    ] = None,
    mode: Annotated[
        str | None,
        typer.Option("--mode", help="apply | propose (default: the stored run's, else the runbook's)."),
    ] = None,
    store_result: Annotated[bool, typer.Option("--store/--no-store", help="Store the replay as a run.")] = True,
    name: Annotated[str | None, typer.Option("--name", help="Name of the stored replay run.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object per event, one per line.")] = False,
    thresholds: Annotated[
        Path | None,
        typer.Option("--thresholds", help="Detector settings file (what `stabmon tune --out` writes), over the "
                                          "runbook's; --set on top."),
    ] = None,
    show_all: Annotated[bool, typer.Option("--all", help="Also list the info reports in the event table.")] = False,
    check: Annotated[
        bool, typer.Option("--check/--no-check", help="Check each suggested setting by replaying again.")
    ] = True,
    report: Annotated[
        Path | None, typer.Option("--report", help="Also write the replay's HTML report (as `stabmon report`).")
    ] = None,
    db: DbOption = None,
) -> None:
    """Replay a recorded run through the same detector and runbook engine classes as live, with interventions
    simulated, and print what would have fired where."""
    from stabmon.cli.importing import read_inputs
    from stabmon.replay.replay import event_rows, replay

    url = db_url(db)
    if thresholds is not None:
        from stabmon.detect.config import load_thresholds

        try:
            sets = [*load_thresholds(thresholds), *(sets or [])]
        except ValueError as exc:
            fail(f"--{exc}")
    parent_id = None
    restarts: list[int] = []
    config: dict[str, Any] = {}
    if flush_every is not None and flush_every < 1:
        fail(f"--flush-every must be >= 1, got {flush_every}")
    if mode is not None and mode not in MODES:
        fail(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    missing = [s for s in source if not Path(s).exists()]
    if missing and len(source) > 1:
        fail(f"no such file: {', '.join(missing)} (name one stored run or several existing files)")
    if not missing:
        pipeline, target = _pipeline(runbook, sets, mode)  # a bad runbook or --set fails before the import
        imported = read_inputs([Path(s) for s in source], fmt, maps, None, patterns)
        records, label, restarts = imported.records, ", ".join(source), imported.restarts
    else:
        if fmt or maps or patterns:
            fail(f"--format, --map and --pattern read a FILE; {source[0]!r} is not a file (a stored run is "
                 "replayed as stored)")
        records, parent_id, label, config = _from_store(source[0], url)
        stored_mode = config.get("mode") if config.get("mode") in MODES else None
        pipeline, target = _pipeline(runbook, sets, mode or stored_mode, _live_checkpoints(config), config)
    every = flush_every or _live_flush_every(config)
    watch = _live_watch(config) if flush_every is None else (0, 1)  # (--flush-every: that cadence throughout)
    alarm = _live_alarm(config) if flush_every is None else (False, None)
    with progress_bar("replay", total=len(records), enabled=wanted(json_output)) as advance:
        result = replay(
            records,
            pipeline=pipeline,
            target=target,
            approve=approve,
            restarts=restarts,
            flush_every=every,
            watch=watch,
            alarm=alarm,
            progress=advance,
        )
    stored_mode = config.get("mode") if config.get("mode") in MODES else None

    def again(extra: list[str]) -> list[Any]:
        """The replay's events with ``extra`` detector settings (the check of a suggestion)."""
        p, t = _pipeline(runbook, [*(sets or []), *extra], mode or stored_mode,
                         _live_checkpoints(config) if missing else 1, config or None)
        return replay(records, pipeline=p, target=t, approve=approve, restarts=restarts, flush_every=every,
                      watch=watch, alarm=alarm).events

    low = [e for e in result.events if type(e).__name__ != "StepRecord"]
    run_id = _store(url, name or f"replay of {label}", low, parent_id, label, runbook, sets) if store_result else None
    if report is not None:
        _write_report(report, records, low, run_id or "not stored", name or f"replay of {label}", label, parent_id,
                      url)
    rows = event_rows(low)
    from stabmon.replay.advice import advise, summarize

    summary = summarize(low)
    advice = advise(summary, _detector_configs(pipeline), again if check else None,
                    tune_hint=f"stabmon tune --labels LABELS.csv --runbook {runbook}")
    if json_output:
        for row in rows:
            print_json(row)
        print_json({"type": "summary", "run_id": run_id, **result.summary(), "verdict": summary.verdict,
                    "detectors": {f.detector: f.counts for f in summary.firings},
                    "advice": [{"detector": a.detector, "setting": a.setting, "text": a.line, **a.checked}
                               for a in advice]})
        return
    _print_summary(label, summary, advice)
    if check:
        from stabmon.replay.advice import together

        both = together(summary, advice, again)
        if both is not None:
            echo(f"tune: {both}")
    shown = rows if show_all else [r for r in rows if not (r["type"] == "Anomaly" and r.get("severity") == "info")]
    hidden = len(rows) - len(shown)
    if shown:
        _print_table(shown)
    if hidden:
        echo(f"({hidden} info report(s) not listed: --all lists them)")
    s = result.summary()
    echo(
        f"{s['steps']} steps replayed: {s['anomalies']} anomalies, {s['decisions']} decisions, "
        f"{s['interventions']} simulated interventions, {s['outcomes']} outcomes"
        + (f"; stored as replay run {run_id}" if run_id else "")
    )
    t = s["target"] or {}
    if t.get("stopped_at") is not None:
        echo(f"the run would have stopped at step {t['stopped_at']}")
    for step in t.get("not_diagnosed", []):
        echo(f"diagnose at step {step} not run: a replay has no model, so no verdict; the diagnose rule's "
                   "next rung followed (the live run followed its verdict)")
    for rb in t.get("rollbacks", []):
        echo(
            f"rollback at step {rb['step']} to checkpoint step {rb['checkpoint_step']}"
            f" (skipping batches {rb['skipped_batches'] or 'none'})"
        )


def _write_report(path: Path, records: list[Any], events: list[Any], run_id: str, name: str, source: str,
                  parent_id: str | None, url: str) -> None:
    """The replay's report: its records and simulated events, with the environment of the run it replays."""
    from stabmon.report import RunInfo, build_report, records_frame, write_report

    environment: dict[str, Any] = {}
    if parent_id is not None:
        from stabmon.store import open_store
        from stabmon.store.repo import run_config

        with open_store(url) as store, store.session() as session:
            environment = run_config(session=session, run_id=parent_id)[1]
    info = RunInfo(id=run_id, name=name, kind="replay", status="completed", source=source, parent_run_id=parent_id)
    data = build_report(records_frame(records), events, run=info, environment=environment)
    try:
        write_report(data, path)
    except OSError as exc:
        fail(f"--report: cannot write {path}: {exc.strerror or exc}")
    echo(f"wrote report {path}", err=True)


def _pipeline(runbook: str, sets: list[str] | None, mode: str | None, every: int | None = 1,
              live: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """The replay pipeline and simulated target (checkpoints every ``every`` steps, None: none); ``live``: the
    stored config of the live run replayed (the rungs its loop could not act on are dropped here too, when the
    runbook is the one it ran); a runbook or override that does not load is one line."""
    from stabmon.replay.replay import simulated_pipeline
    from stabmon.replay.simulate import Simulation

    try:
        target = Simulation(checkpoint_interval=every)
        return simulated_pipeline(runbook=runbook, overrides=tuple(sets or ()), mode=mode, target=target,
                                  live_config=live)
    except (ValueError, KeyError) as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def _store(
    url: str,
    name: str,
    events: list[Any],
    parent_id: str | None,
    source: str,
    runbook: str,
    sets: list[str] | None,
) -> str | None:
    from stabmon.store import StoreConfig, open_store

    try:
        with open_store(url, config=StoreConfig(fail_fast=True)) as store:
            run_id = store.start_run(
                name=name,
                kind="replay",
                parent_run_id=parent_id,
                source=source,
                config={"runbook": runbook, "overrides": list(sets or ())},
            )
            store.write_events(run_id=run_id, events=events)
            store.end_run(run_id=run_id, status="completed")
            store.flush()
            return run_id
    except ValueError as exc:
        fail(str(exc))


def _detector_configs(pipeline: Any) -> dict[str, Any]:
    """The replay's detector configs by name (none for a suite that does not say)."""
    from stabmon.detect import DetectorSuite

    return dict(pipeline.detectors.configs) if isinstance(pipeline.detectors, DetectorSuite) else {}


def _print_summary(label: str, summary: Any, advice: list[Any]) -> None:
    """The first screen: the verdict, each detector that fired, what to tune."""
    echo(f"{label}: {summary.verdict}" + (f" ({', '.join(summary.changes)})" if summary.changes else ""))
    for f in summary.firings:
        counts = ", ".join(f"{n} {s}" for s, n in f.counts.items() if n)
        echo(f"  {f.detector:<16} {', '.join(f.metrics)[:40]:<40} {counts}")
    if not summary.firings:
        echo("  no detector fired")
    if summary.firings and not advice:
        echo("tune: nothing to tune: no detector reported 3 or more times below the severity it should keep")
    for a in advice:
        echo(f"tune: {a.line}")
        if a.setting is not None:
            echo(f"      try: --set {a.setting}  (or put it in a thresholds file: --thresholds FILE)")


def _print_table(rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table("step", "event", "kind", "metric", "severity", "detail")
    for r in rows:
        detail = r.get("message") or r.get("reason") or ""
        if r["type"] == "Decision":
            rung = r.get("rung")
            shown = rung + 1 if isinstance(rung, int) else rung  # 1-based, as in `stabmon trace` and the reasons
            # rule and rung first: a long parameter (an alert's text) must not push them out of the column
            detail = f"{r.get('status')} ({r.get('rule')} rung {shown}) {r.get('params')}"
        elif r["type"] == "InterventionRecord" and r.get("kind") == "diagnose":
            after = r.get("after") or {}
            detail = f"verdict {after.get('verdict')}: {after.get('summary', '')}"
        elif r["type"] == "InterventionRecord":
            detail = f"{r.get('before')} -> {r.get('after')}"
        table.add_row(
            str(r["step"]),
            r["type"],
            str(r.get("kind")),
            str(r.get("metric") or ""),
            str(r.get("severity") or ""),
            str(detail)[:80],
        )
    console().print(table)


def register(app: typer.Typer) -> None:
    app.command("replay")(replay_command)
