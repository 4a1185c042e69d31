"""``stabmon events RUN [--json]``: the anomalies the detectors found in a run, with their evidence."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from stabmon.cli._common import DbOption, LatestRunArg, echo, fail, print_json, run_events

_SEVERITIES = ("info", "warning", "error", "critical")
_MIN_HELP = "Lowest severity shown: info, warning, error or critical."


def _row(a: Any) -> str:
    thr = "" if a.threshold is None else f"/{a.threshold:.3g}"
    return (f"{a.step:>9}  {a.severity.value:<8}  {a.kind:<19}  {a.metric:<18}  {a.score:>8.3g}{thr:<7}  "
            f"{a.message}")


def events(
    run: LatestRunArg = "latest",
    db: DbOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (all fields, evidence too).")] = False,
    kind: Annotated[str | None, typer.Option("--kind", help="Only this kind (spike, nonfinite...).")] = None,
    min_severity: Annotated[str, typer.Option("--min-severity", help=_MIN_HELP)] = "info",
    evidence: Annotated[bool, typer.Option("--evidence", help="Also print each evidence window.")] = False,
) -> None:
    """List a run's anomalies in step order: step, severity, kind, metric, score/threshold, message."""
    from stabmon.events import Anomaly, Severity, to_dict

    if min_severity not in _SEVERITIES:
        fail(f"--min-severity must be one of {', '.join(_SEVERITIES)}, got {min_severity!r}")
    floor = Severity(min_severity)
    run_id, name, loaded = run_events(db, run)
    anomalies = [e for e in loaded if isinstance(e, Anomaly) and e.severity >= floor
                 and (kind is None or e.kind == kind)]
    if as_json:
        print_json({"run_id": run_id, "run_name": name, "anomalies": [to_dict(a) for a in anomalies]})
        return
    echo(f"run {run_id} ({name}): {len(anomalies)} anomal{'y' if len(anomalies) == 1 else 'ies'}")
    if anomalies:
        echo(f"{'step':>9}  {'severity':<8}  {'kind':<19}  {'metric':<18}  {'score/thr':<16}  message")
    for a in anomalies:
        echo(_row(a))
        if evidence:
            echo("           evidence: " + ", ".join(f"{st}:{v:.4g}" for st, v in a.evidence))


def register(app: typer.Typer) -> None:
    app.command("events")(events)
