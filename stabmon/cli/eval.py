"""``stabmon eval``: stabmon and the peer rules against labelled incidents."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from stabmon.cli._common import console, fail, print_json, safe
from stabmon.cli.importing import PatternOption
from stabmon.cli.replay import SetOption
from stabmon.replay.progress import progress_bar, wanted

EngineOption = Annotated[
    str,
    typer.Option("--engine", help="local: --jobs processes here; ray: one Ray task per run, on the cluster at "
                 "RAY_ADDRESS or a local instance of --jobs CPUs (pip install 'stabmon[ray]')."),
]
GroupWandbOption = Annotated[
    bool,
    typer.Option("--group-wandb", help="Also join files named <prefix>_<8-character W&B run id> with the other "
                 "segments of that prefix beside them into one run (else a run is a label's glob or its run "
                 "column)."),
]


def make_engine_or_fail(engine: str, jobs: int) -> Any:
    """The engine ``--engine`` names, or one line: an unknown name, ``--jobs`` < 1, ray not installed."""
    from stabmon.replay.engines import make_engine

    try:
        return make_engine(engine, jobs=jobs)
    except ValueError as exc:
        fail(str(exc).splitlines()[0])


def eval_command(
    labels: Annotated[Path, typer.Option("--labels", help="LABELS.csv (file paths relative to it).")],
    runbook: Annotated[str, typer.Option("--runbook", help="Runbook for stabmon's decisions.")] = "default",
    sets: SetOption = None,
    jobs: Annotated[
        int, typer.Option("--jobs", help="Runs evaluated in parallel (processes, or a local Ray instance's CPUs).")
    ] = 1,
    pre: Annotated[int, typer.Option("--pre", help="Steps before step_start that still count.")] = 100,
    min_severity: Annotated[
        str, typer.Option("--min-severity", help="Lowest anomaly severity that alerts.")
    ] = ("warning"),
    peers: Annotated[bool, typer.Option("--peers/--no-peers", help="Also run the peer rules.")] = True,
    json_output: Annotated[
        bool, typer.Option("--json", help="One JSON object per row, one per line.")
    ] = False,
    patterns: PatternOption = None,
    engine: EngineOption = "local",
    group_wandb: GroupWandbOption = False,
) -> None:
    """Per labelled incident: detected, first alert, lead steps; per run: false alarms; for stabmon and the
    peer rules (LLM Foundry, OLMo-core, ZClip, Lightning, Megatron) side by side."""
    from stabmon.events import Severity
    from stabmon.replay.eval import count_runs, evaluate

    if not labels.is_file():
        fail(f"no such labels file: {labels}")
    if jobs < 1:
        fail(f"--jobs must be >= 1, got {jobs}")
    allowed = [s.value for s in Severity]
    if min_severity not in allowed:
        fail(f"--min-severity must be one of {', '.join(allowed)}, got {min_severity!r}")
    severity = Severity(min_severity)
    runner = make_engine_or_fail(engine, jobs)
    try:
        _check_runbook(runbook)
        total = count_runs(labels, group_wandb=group_wandb)
        with progress_bar("eval", total=total, enabled=wanted(json_output)) as advance:
            report = evaluate(
                labels,
                runbook=runbook,
                overrides=tuple(sets or ()),
                jobs=jobs,
                pre=pre,
                min_severity=severity,
                peers=peers,
                progress=advance,
                patterns=tuple(patterns or ()),
                engine=runner,
                group_wandb=group_wandb,
            )
    except ValueError as exc:
        fail(str(exc).splitlines()[0])
    if json_output:
        for row in report.rows():
            print_json(row)
        for method, s in report.summary.items():
            print_json({"type": "summary", "method": method, **s})
        return
    _print(report)


def _check_runbook(runbook: str) -> None:
    from stabmon.runbook import load_runbook

    try:
        load_runbook(runbook)
    except Exception as exc:  # noqa: BLE001 - a runbook that does not load is a user error here
        raise ValueError(f"runbook {runbook!r}: {exc}") from exc


def _print(report: Any) -> None:
    from rich.table import Table

    out = console()
    methods = list(report.summary)
    for category, title in (
        ("numeric", "numeric incidents"),
        ("control", "healthy controls"),
        ("other", "other incidents (reported separately)"),
    ):
        rows = [r for r in report.incidents if r["category"] == category]
        if not rows:
            continue
        table = Table("file", "steps", "kind", *methods, title=title)
        keys = list(dict.fromkeys((r["file"], r["step_start"], r["step_end"], r["kind"]) for r in rows))
        for key in keys:
            cells = []
            for m in methods:
                r = next(
                    x
                    for x in rows
                    if (x["file"], x["step_start"], x["step_end"], x["kind"]) == key and x["method"] == m
                )
                cells.append("error" if r["error"] else (f"lead {r['lead_steps']}" if r["detected"] else "-"))
            table.add_row(key[0][-48:], f"{key[1]}-{key[2]}", key[3][:28], *cells)
        out.print(table)
    channels = _channels(report)
    fa = Table("run", "steps", *methods, *(f"sent to {ch}" for ch in channels),
               title="false alarms (alert episodes outside incident windows); episodes sent under default routing")
    for run in dict.fromkeys(r["file"] for r in report.files):
        by_method = {r["method"]: r for r in report.files if r["file"] == run}
        first = next(iter(by_method.values()))
        stab = by_method.get("stabmon", {})
        fa.add_row(run[-48:], str(first["steps"]), *(str(by_method[m]["false_alarms"]) for m in methods),
                   *(str(stab.get(f"sent_{ch}", "-")) for ch in channels))
    out.print(fa)
    summary = Table(
        "method",
        "recall",
        "recall (author/paper)",
        "median lead",
        "false alarms",
        "per 10k steps",
        title="summary",
    )
    for m, s in report.summary.items():
        summary.add_row(
            m,
            str(s["recall"]),
            str(s["recall_ground_truth"]),
            str(s["median_lead_steps"]),
            str(s["false_alarms"]),
            str(s["false_alarms_per_10k"]),
        )
        if s.get("recall_at_error") is not None:  # stabmon's second operating point: error-or-worse alerts only
            steps = s["steps"] or 0
            per10k = round(1e4 * s["false_alarms_at_error"] / steps, 3) if steps else None
            summary.add_row(f"{m} (error+)", str(s["recall_at_error"]), "-", "-",
                            str(s["false_alarms_at_error"]), str(per10k))
    out.print(summary)
    for m, s in report.summary.items():
        if channels and all(f"recall_sent_{ch}" in s for ch in channels):  # stabmon's rows: the peers send nothing
            out.print(_routing_line(m, s, channels))
    for m, s in report.summary.items():
        if s.get("healthy_runs"):
            out.print(_healthy_line(m, s, channels))
    stab = [r for r in report.files if r["method"] == "stabmon" and r.get("intervention_decisions")]
    for r in stab:
        out.print(f"stabmon would have intervened {r['intervention_decisions']} time(s) on {r['file']}")
    errors = {r["file"]: r["error"] for r in report.files if r["error"]}
    for run, err in errors.items():
        from rich.text import Text

        out.print(Text.assemble(("not evaluated", "yellow"), f" {safe(str(run))}: {safe(str(err))}"))


def _channels(report: Any) -> list[str]:
    """The default channels the report has ``sent_*`` columns for (stabmon rows only)."""
    row: dict[str, Any] = next((r for r in report.files if r["method"] == "stabmon"), {})
    return [k[len("sent_"):] for k in row if k.startswith("sent_")]


def _routing_line(method: str, s: dict[str, Any], channels: list[str]) -> str:
    """One line: per default channel, recall of what is sent and how many episodes are sent."""
    n = s["numeric_incidents"]
    parts = [
        f"{ch}: recall {s[f'recall_sent_{ch}']} ({s[f'detected_sent_{ch}']}/{n}), {s[f'sent_{ch}']} alert "
        f"episode(s) sent, {s[f'false_sent_{ch}']} outside incident windows"
        for ch in channels
    ]
    return f"{method} under default routing - " + "; ".join(parts)


def _healthy_line(method: str, s: dict[str, Any], channels: list[str]) -> str:
    """One line on the runs labelled healthy only: how many the runbook would have changed, and how often each
    default channel would have been messaged (episodes per 10k logged steps of those runs)."""
    sent = ", ".join(f"{ch} {s.get(f'healthy_sent_{ch}_per_10k')} per 10k steps" for ch in channels)
    return (f"{method} on the {s['healthy_runs']} healthy run(s): training changed on {s['healthy_runs_changed']}; "
            f"sent: {sent}")


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
